"""Speed and memory benchmarks (ratios against a baseline measured in the same run).

Run them as modules from the repository root, e.g. ``python -m benchmarks.bench_fosi --clock cpu``
(the ``make bench-*`` targets and ``python -m experiments.report.bench run`` do).
"""
