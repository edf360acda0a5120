"""Reading run records: load runs into pandas frames, pack large sweeps, align and average curves."""
