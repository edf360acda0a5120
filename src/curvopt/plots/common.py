"""Small pieces shared by the figure scripts."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd


def save_with_csv(fig: plt.Figure, out: str | Path, series: list[pd.DataFrame]) -> Path:
    """Write the PNG and, next to it, the plotted numbers as CSV (none when nothing was plotted), so a
    figure can always be checked against the numbers it shows."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    if series:
        pd.concat(series).to_csv(out.with_suffix(".csv"), index=False)
    return out
