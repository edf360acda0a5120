"""Experiment tracking backends that mirror the local run records (wandb, or nothing).

A tracker failure must never cost a run: every call is guarded, warns once, and the tracker
switches itself off while the local records keep being written.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

log = logging.getLogger(__name__)


class NullTracker:
    """A tracker that records nothing (``logger=none``); also the interface of the others."""

    def log(self, row: dict[str, Any], step: int) -> None:
        """Record one metrics row.

        Args:
            row: The row as written to ``metrics.jsonl``.
            step: The training step it belongs to.
        """
        del row, step

    def summary(self, summary: dict[str, Any]) -> None:
        """Record the run's summary.

        Args:
            summary: The dict written to ``summary.json``.
        """
        del summary

    def finish(self, exit_code: int = 0) -> None:
        """Close the tracker.

        Args:
            exit_code: The process's exit code (``curvopt.errors``).
        """
        del exit_code


class WandbTracker(NullTracker):
    """Mirror of the run records to Weights & Biases; any failure warns once and switches it off.

    Args:
        project: wandb project.
        name: Run name.
        group: Run group (the experiment).
        config: The resolved run config.
        mode: ``"offline"`` (default, no account needed), ``"online"`` or ``"disabled"``.
        entity: wandb entity (user or team), or ``None``.
        dir: Directory for wandb's files (created if missing).
        silent: Keep wandb's banners (version, sync hints, run history) off the terminal; the
            metrics are logged all the same. ``None``: silent unless the environment sets
            ``WANDB_SILENT`` to false (``WANDB_SILENT=false make ...`` shows them again).
    """

    def __init__(
        self,
        *,
        project: str,
        name: str,
        group: str,
        config: dict[str, Any],
        mode: str = "offline",
        entity: str | None = None,
        dir: str | None = None,
        silent: bool | None = None,
    ) -> None:  # noqa: A002
        self.run = None
        if silent is None:
            silent = wandb_silent_default()
        try:
            import wandb

            if dir is not None:
                from pathlib import Path

                Path(dir).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                group=group,
                config=config,
                mode=mode,
                dir=dir,
                reinit="create_new",
                settings=wandb.Settings(silent=silent, quiet=silent),
            )
        except Exception as err:  # no wandb, bad key, no network in online mode, …
            self._disable("init", err)

    def _disable(self, where: str, err: BaseException) -> None:
        warnings.warn(f"wandb {where} failed ({err!r}); continuing with local run records only", stacklevel=3)
        self.run = None

    def log(self, row: dict[str, Any], step: int) -> None:
        """Log the numeric entries of a metrics row.

        Args:
            row: The row as written to ``metrics.jsonl``; non-numeric values are skipped.
            step: The training step.
        """
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        except Exception as err:
            self._disable("log", err)

    def summary(self, summary: dict[str, Any]) -> None:
        """Copy the scalar (number or string) entries of the summary to the wandb run summary.

        Args:
            summary: The dict written to ``summary.json``.
        """
        if self.run is None:
            return
        try:
            for key, value in summary.items():
                if isinstance(value, (int, float, str)):
                    self.run.summary[key] = value
        except Exception as err:
            self._disable("summary", err)

    def finish(self, exit_code: int = 0) -> None:
        """Finish the wandb run.

        Args:
            exit_code: The process's exit code.
        """
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as err:
            self._disable("finish", err)


def wandb_silent_default() -> bool:
    """Whether wandb keeps quiet on the terminal by default: yes, unless ``WANDB_SILENT`` is false.

    Returns:
        ``False`` when ``WANDB_SILENT`` is ``false``/``0``/``no``, else ``True``.
    """
    return os.environ.get("WANDB_SILENT", "true").strip().lower() not in ("false", "0", "no", "off")


def make_tracker(kind: str, **kwargs: Any) -> NullTracker:
    """Build the tracker of the ``logger`` config.

    Args:
        kind: ``"wandb"`` or ``"none"``.
        **kwargs: Keyword arguments of :class:`WandbTracker`.

    Returns:
        The tracker.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    if kind == "none":
        return NullTracker()
    if kind == "wandb":
        return WandbTracker(**kwargs)
    raise ValueError(f"unknown logger kind {kind!r}; use logger=wandb or logger=none")
