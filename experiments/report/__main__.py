"""``python -m experiments.report``: build the reproduction report (:func:`experiments.report.build.main`)."""

from experiments.report.build import main

main()
