"""FGN paper: Figure 2 mechanism checks, the Cars196 head (Figure 3, Table 1), report items."""
