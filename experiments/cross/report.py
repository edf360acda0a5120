"""``python -m experiments.cross.report``: the cross-paper grid's table (results/tables/cross_grid_<profile>.md
and .csv) and figures (results/figures/cross_<task>_<profile>.png) from the records
(:func:`experiments.report.cross.main`; ``make cross-figures``)."""

from experiments.report.cross import main

if __name__ == "__main__":
    main()
