"""curvopt: reproducible PyTorch implementations of SHF-LSMR, Fast Gauss-Newton, FOSI and RACS/Alice."""
