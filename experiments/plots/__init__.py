"""Figures drawn from run records only, each saved with the CSV of its plotted numbers."""
