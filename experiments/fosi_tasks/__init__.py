"""FOSI DNN tasks: driver, analysis, figures and report items (see docs/fosi_tasks.md)."""
