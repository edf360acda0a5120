"""FOSI paper, quadratic experiments (Figures 3, 4, 7, 8, 9): runs, figures, report items."""
