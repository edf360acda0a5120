"""RACS/Alice paper, LLaMA on C4: runs, figures, memory and basis-stability drivers, report items."""
