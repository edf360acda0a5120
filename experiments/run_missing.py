"""CLI for :mod:`curvopt.runs`: run the missing runs of an experiment (see `make help`)."""

from curvopt.runs import main

if __name__ == "__main__":
    main()
