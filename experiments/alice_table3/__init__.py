"""RACS/Alice paper, Table 3: estimated and measured optimizer memory, report item."""
