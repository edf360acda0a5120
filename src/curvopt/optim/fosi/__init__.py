"""FOSI: any first-order optimizer plus a Newton step on the extreme Hessian eigenspace.

Sivan, Gabel & Schuster, ICLR 2024; usage and flags in docs/fosi.md, the choices the paper leaves
open in docs/decisions.md, FOSI.

Every ``ese_period`` steps, Lanczos on Hessian-vector products (the ESE) estimates the k largest
and ℓ smallest eigenpairs (λ̂, V̂) of the loss Hessian on an ESE batch. Each step then splits the
gradient g into g₁ = V̂V̂ᵀg and g₂ = g − g₁ and updates

    θ ← θ + d₁ + s·d₂,   d₁ = −α V̂ diag(u) V̂ᵀ v̄,   d₂ = d_b − V̂V̂ᵀ d_b,

where v̄ is g₁ under the base optimizer's momentum form (HB: g₁ + βv̄, Adam: EMA, GD: g₁),
u = 1/max(|λ̂|, ε), d_b is the base optimizer's step on g₂ (the base only ever sees g₂), and
s = clip(|λ̂₁|/|λ̂_k|, 1, c) scales the base step (c = 1 for Adam). Before the first ESE, FOSI *is*
its base optimizer: ``step`` calls ``base.step()`` and nothing else.

Two entry points:

* :class:`FOSI` — a ``torch.optim.Optimizer`` wrapping an already-built base optimizer, for use
  from plain Python: ``loss.backward(); fosi.step()``. It shares the base's ``param_groups``
  (schedulers and manual lr changes reach the base) and ``state``; ``state_dict`` round-trips
  both. Ready-made: :func:`fosi_heavy_ball`, :func:`fosi_adam`, :func:`fosi_gd`.
* :func:`~curvopt.optim.fosi_adapter.build_fosi` — the factory the training loop calls
  (``conf/optimizer/fosi_*.yaml``): an :class:`~curvopt.api.Algorithm` over an ``Objective`` with
  an ESE batch drawn (seeded) from ``data.train``. It and :class:`~curvopt.optim.fosi_adapter.FOSIAlgorithm`
  live in :mod:`curvopt.optim.fosi_adapter` (the adapter to the training loop, which imports this
  module; this module, the optimizer alone, imports nothing of it).

Implementation choices that matter for speed (benchmarks/bench_fosi.py):

* **No flat copies.** V̂ is one ``(k+ℓ, n)`` tensor; each parameter uses the column block that
  belongs to it as a strided view, so V̂ᵀg, the projection written back into ``p.grad`` and the
  final update are gemv calls on the parameters and gradients in place. A non-ESE step reads V̂
  four times (V̂g, g − V̂ᵀc, V̂d_b, the update), three for SGD-type bases (below).
* **Velocity in coefficients.** Only V̂v̄ enters d₁. Between two ESEs V̂ is fixed, so v̄ is kept as
  ``ρ·r + V̂ᵀa`` (a residual vector r from before the last ESE with a decaying scalar ρ, plus k+ℓ
  coefficients a): updating it costs O(k+ℓ) per step instead of two passes over n. It is
  materialised once per ESE, so — as in the authors' code — v̄ is not reset when V̂ changes.
* **SGD fast path: two passes over V̂ per step.** For ``torch.optim.SGD`` (GD, heavy ball or
  Nesterov; no weight decay; one lr/momentum for all groups) the base step is linear in its
  input, so the base is fed the full g and the difference is corrected inside span(V̂): its
  buffer m′ = m + V̂ᵀz differs from the true buffer m (built from g₂) by known coefficients. With
  w = V̂m′ and y = V̂m (y ← βy since V̂g₂ = 0, w ← βw + (1−δ)c) the whole FOSI update is one
  final ``θ += V̂ᵀ(coefficients)``: a step reads V̂ twice (V̂g and the update) instead of four times
  and needs no copy of θ. The buffers are corrected to m (one pass) whenever V̂ changes, the path
  is left, or :meth:`state_dict` is called. The scale s is applied by scaling the group lr for the
  base step (identical for HB/GD, as in the paper). ``fast_path=False`` forces the generic path
  (tests check both against a step-by-step reference of the paper's Algorithm 2 with the
  authors' Newton-part momentum).
* **No host read between ESEs.** The eigenvalues are read on the host once, when a basis is
  installed (an ESE, :meth:`FOSI.set_basis`, a load): the scale s and the logged λ̂ are Python floats
  from then on, so a step between two ESEs (either path, any base that reads nothing itself, e.g.
  SGD or fused Adam) makes no host read and a GPU never waits on the host for it.

The package, one module per responsibility (:class:`FOSI` is composed of the three mixins):

* :mod:`~curvopt.optim.fosi.optimizer` — :class:`FOSI`, the wrapper: options, parameter layout,
  the shared groups and state, :meth:`FOSI.step`;
* :mod:`~curvopt.optim.fosi.schedule` — when an ESE runs and the Lanczos run itself;
* :mod:`~curvopt.optim.fosi.newton` — installing a basis, the Newton part and the update (generic
  path and SGD fast path);
* :mod:`~curvopt.optim.fosi.state` — ``state_dict``, ``load_state_dict``, pickling;
* :mod:`~curvopt.optim.fosi.options` — the allowed option values, presets and their checks;
* :mod:`~curvopt.optim.fosi.factories` — the ready-made variants and :func:`make_base_optimizer`.
"""

from curvopt.optim.fosi.factories import fosi_adam, fosi_gd, fosi_heavy_ball, make_base_optimizer
from curvopt.optim.fosi.optimizer import FOSI
from curvopt.optim.fosi.options import (
    BASES,
    ESE_BATCH_MODES,
    ESE_SCHEDULES,
    FAILURE_MODES,
    LR_REF_KEY,
    NEWTON_MOMENTUM,
    VARIANTS,
)

__all__ = [
    "BASES",
    "ESE_BATCH_MODES",
    "ESE_SCHEDULES",
    "FAILURE_MODES",
    "FOSI",
    "LR_REF_KEY",
    "NEWTON_MOMENTUM",
    "VARIANTS",
    "fosi_adam",
    "fosi_gd",
    "fosi_heavy_ball",
    "make_base_optimizer",
]
