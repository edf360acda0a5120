"""SHF-LSMR paper: Figures 2-3 and Table 2 from run records, the LSMR audit, report items."""
