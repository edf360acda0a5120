from curvopt.report.build import main

main()
