"""The cross-paper grid (issue 46, docs/cross.md): every method on every paper's task that fits the CPU,
one Hydra multirun per task, judged at equal CPU time and equal work (experiments/report/cross.py)."""
