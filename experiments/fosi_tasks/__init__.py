"""FOSI DNN tasks: driver, analysis and figures (imported as ``fosi_tasks``; see docs/fosi_tasks.md)."""
