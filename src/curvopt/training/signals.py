"""Stop signals during training: SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop) are deferred.

The first signal lets the current step and its records finish; the loop then writes a checkpoint
at that step boundary and stops, so ``trainer.resume=true`` continues with metrics identical to an
uninterrupted run. A second signal stops at once without a new checkpoint (docs/resume.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class StopSignals:
    """Context manager that defers SIGINT and SIGTERM while installed.

    The first signal only sets :attr:`received` (the loop stops at the next step boundary, with a
    checkpoint); a second one raises ``KeyboardInterrupt`` at once. Handlers can only be
    installed from the main thread; elsewhere (a run started from a worker thread) signals keep
    their previous behaviour. It takes no constructor arguments.
    """

    NAMES = {signal.SIGINT: "sigint", signal.SIGTERM: "sigterm"}

    def __init__(self) -> None:
        self.received: int | None = None
        self.shield = False  # set while the records are written: further signals are only logged
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        """``"sigint"`` or ``"sigterm"`` for the received signal, ``None`` before one arrives."""
        return self.NAMES.get(self.received) if self.received is not None else None

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.shield:
            log.warning("%s received while the run's records are written; stopping right after", signum)
            self.received = self.received or signum
            return
        if self.received is not None:
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name})")
        self.received = signum
        log.warning(
            "%s received: finishing the current step, then checkpoint and stop "
            "(send it again to stop at once, without a new checkpoint)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
