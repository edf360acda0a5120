"""Reproduction report (``make report``) and cross-paper benchmark table (``make bench``)."""

from experiments.report.build import build_report

__all__ = ["build_report"]
