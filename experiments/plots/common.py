"""Small pieces shared by the figure scripts."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd


def save_with_csv(fig: plt.Figure, out: str | Path, series: list[pd.DataFrame]) -> Path:
    """Write the PNG and, next to it, the plotted numbers as CSV, then close the figure.

    A figure can so always be checked against the numbers it shows; no CSV is written when
    nothing was plotted.

    Args:
        fig: The figure.
        out: PNG path (parent directories are created).
        series: Frames of the plotted points, concatenated into ``<out>.csv``.

    Returns:
        The PNG path.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    if series:
        pd.concat(series).to_csv(out.with_suffix(".csv"), index=False)
    return out
