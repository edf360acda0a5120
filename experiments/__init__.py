"""Per-paper drivers, paper numbers and report items, one folder per paper (or part of one).

Each folder holds one paper's drivers (run what is missing, draw figures and tables from the run
records), the paper's own numbers (``paper_*.csv``) and ``report.py``, the items of ``make report``
for that paper. Run the drivers as modules from the repository root, e.g.
``python -m experiments.shf.figures fig2`` (the ``make reproduce-*`` targets do).
"""
