"""CLI for :mod:`experiments.runs`: run the missing runs of an experiment (see `make help`)."""

from experiments.runs import main

if __name__ == "__main__":
    main()
