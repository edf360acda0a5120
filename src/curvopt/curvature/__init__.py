"""Matrix-free linear algebra for the curvature methods: CG, LSMR, Lanczos and curvature products."""
