"""``python -m curvopt.report``: build the reproduction report (:func:`curvopt.report.build.main`)."""

from curvopt.report.build import main

main()
