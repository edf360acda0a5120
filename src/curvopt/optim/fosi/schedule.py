"""FOSI's ESE: when it runs (the schedule) and how (Lanczos on Hessian-vector products).

:class:`ESESchedule` is the part of :class:`~curvopt.optim.fosi.FOSI` that decides whether an
ESE is due before a step (``paper`` or ``released`` schedule), builds the Hessian-vector product
of the ESE batch, probes forward mode once, runs Lanczos and hands the eigenpairs to
:meth:`~curvopt.optim.fosi.newton.NewtonUpdate._install` (or drops the basis on a failure).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from curvopt.curvature.hvp import flat_hvp, make_flat_hvp
from curvopt.curvature.lanczos import LanczosError, LanczosResult, lanczos

log = logging.getLogger("curvopt.optim.fosi")  # one logger for the package, as before the split


class ESESchedule:
    """The ESE schedule and the Lanczos run of :class:`~curvopt.optim.fosi.FOSI` (a mixin).

    Reads FOSI's options (``ese_period``, ``ese_warmup``, ``ese_schedule``, ``ese_batch_mode``,
    ``ese_batch``, ``k``, ``l``, ``num_iters``, ``seed``, ``reorth``, ``hvp_mode``, ``hvp_reuse``,
    ``on_ese_failure``, ``debug``), its step counter ``t`` and parameter layout (``n``,
    ``_named``, ``_dtype``, ``_device``); counts ``ese_count`` and sets ``last_ese_error``.
    """

    # -- schedule ----------------------------------------------------------------------------------
    def ese_due(self, t: int | None = None) -> bool:
        """Whether an ESE runs before the update of step ``t``.

        Args:
            t: The 0-based step index; ``None``: the next step (:attr:`t`).

        Returns:
            ``True`` on the schedule's ESE steps (see ``ese_schedule``).
        """
        t = self.t if t is None else t
        T, W = self.ese_period, self.ese_warmup
        if self.ese_schedule == "released":
            return max(1, t + 1 - W) % T == 0
        if t < W:
            return False
        return t == W if T is None else (t - W) % T == 0

    # -- ESE ---------------------------------------------------------------------------------------
    def _hvp(
        self, batch: Any, mode: str | None = None, reuse: bool | None = None
    ) -> Callable[[Tensor], Tensor]:
        mode = self.hvp_mode if mode is None else mode
        reuse = self.hvp_reuse if reuse is None else reuse
        if self.model is not None:
            return make_flat_hvp(self._hvp_model, self.loss_fn, self._named, batch, mode, reuse)
        names, loss_fn = list(self._named), self.loss_fn

        def loss_of(p: dict[str, Tensor]) -> Tensor:
            return loss_fn([p[nm] for nm in names], batch)

        return flat_hvp(loss_of, self._named, mode, reuse)

    def _check_forward_mode(self, batch: Any) -> None:
        """Before the first forward-over-reverse ESE, try one plain ``jvp(grad)`` product.

        Some losses have no working forward-mode derivative of their backward in torch:
        ``F.mse_loss`` raises "ZeroTensors are immutable" under ``jvp(grad)``, and under
        ``torch.func.linearize`` (the ``hvp_reuse`` path) the same bug kills the process with a
        segmentation fault, which no ``except`` can catch. One eager product, which raises instead,
        tells the two apart; on failure FOSI switches to ``reverse_over_reverse`` (double backward:
        the same Hessian) for good, with a warning. The probe runs once per optimizer and is left
        out of the ESE's time; its product is discarded, so the Lanczos run is unchanged.
        """
        if self._forward_mode_checked or self.hvp_mode != "forward_over_reverse" or batch is None:
            return
        probe = torch.ones(self.n, dtype=self._dtype, device=self._device)
        try:
            self._hvp(batch, "forward_over_reverse", reuse=False)(probe)
        except (RuntimeError, NotImplementedError) as err:
            log.warning(
                "FOSI: forward-mode Hessian products fail for this loss, a known torch gap (e.g. "
                "F.mse_loss) [%s: %s]; using hvp_mode='reverse_over_reverse' (double backward) instead",
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self.hvp_mode = "reverse_over_reverse"
        self._forward_mode_checked = True

    @torch.compiler.disable
    def run_ese(self, batch: Any = None) -> LanczosResult | None:
        """Estimate the extreme eigenpairs at the current parameters and install them.

        Never traced by ``torch.compile`` (Lanczos is host-synchronising Python control flow; a
        compiled :meth:`step` runs it eagerly).

        Args:
            batch: The batch to differentiate on with ``ese_batch_mode='current'``; ignored in
                ``fixed`` mode (``ese_batch`` is used).

        Returns:
            The Lanczos result, or ``None`` when the ESE failed and ``on_ese_failure`` is
            ``base`` or ``keep`` (the reason is in :attr:`last_ese_error`).

        Raises:
            ValueError: ``ese_batch_mode='current'`` and no ``batch``.
            LanczosError: The ESE failed and ``on_ese_failure='raise'``.
        """
        ese_batch = self.ese_batch if self.ese_batch_mode == "fixed" else batch
        if ese_batch is None:
            raise ValueError("ese_batch_mode='current' needs the batch: call step(batch=...)")
        self._check_forward_mode(ese_batch)
        try:
            result = lanczos(
                self._hvp(ese_batch),
                self.n,
                self.k,
                self.l,
                num_iters=self.num_iters,
                operator_dtype=self._dtype,
                device=self._device,
                seed=self.seed,
                generator=self._generator,
                reorth=self.reorth,
                symmetry_check=self.debug,
            )
            if not (torch.isfinite(result.eigenvalues).all() and torch.isfinite(result.eigenvectors).all()):
                raise LanczosError("ESE produced non-finite eigenvalues or eigenvectors")
        except LanczosError as err:
            self.last_ese_error = str(err)
            action = {
                "base": "falling back to the base optimizer until the next ESE",
                "keep": "keeping the previous eigenbasis",
                "raise": "raising",
            }[self.on_ese_failure]
            log.warning("FOSI: ESE before step %d failed: %s; %s", self.t, err, action)
            if self.on_ese_failure == "raise":
                raise
            if self.on_ese_failure == "base":
                self._install(None, None, None)
            return None
        self.last_ese_error = None
        self._install(result.eigenvectors.to(self._dtype).contiguous(), result.eigenvalues, result)
        self.ese_count += 1
        return result

    def set_basis(self, eigenvectors: Tensor, eigenvalues: Tensor) -> None:
        """Install a given eigenbasis instead of running Lanczos.

        For tests, and quadratics where the eigenpairs are known. The Newton velocity carries
        over as at an ESE.

        Args:
            eigenvectors: ``(k+ℓ, n)``; row i is the eigenvector of ``eigenvalues[i]`` (copied).
            eigenvalues: ``(k+ℓ,)`` tensor or sequence of floats, ordered ``[ℓ smallest
                ascending, k largest ascending]`` (read on the host once, as at an ESE).

        Raises:
            ValueError: The shapes are not ``(k+ℓ, n)`` and ``(k+ℓ,)``.
        """
        r = self.k + self.l
        lam_shape = tuple(eigenvalues.shape) if isinstance(eigenvalues, Tensor) else (len(eigenvalues),)
        if eigenvectors.shape != (r, self.n) or lam_shape != (r,):
            raise ValueError(f"expected eigenvectors ({r}, {self.n}) and eigenvalues ({r},)")
        self._install(eigenvectors.detach().clone().to(self._dtype).contiguous(), eigenvalues, None)

    def _ese_if_due(self, batch: Any) -> dict[str, Any]:
        """The ESE before this step's update, when the schedule (Algorithm 2) has one due.

        The one-time forward-mode probe runs first and is left out of the ESE's time.

        Returns:
            ``ese_ran``, ``ese_failed``, ``ese_time_s`` and, when an ESE ran, ``lanczos_iters``.
        """
        if not self.ese_due():
            return {"ese_ran": 0, "ese_failed": 0, "ese_time_s": 0.0}
        if not self._forward_mode_checked and self.hvp_mode == "forward_over_reverse":
            self._check_forward_mode(self.ese_batch if self.ese_batch_mode == "fixed" else batch)
        t0 = time.perf_counter()
        result = self.run_ese(batch)
        ese_time = time.perf_counter() - t0
        return {
            "ese_ran": 1,
            "ese_failed": int(result is None),
            "ese_time_s": ese_time,
            "lanczos_iters": result.iterations if result is not None else 0,
        }
