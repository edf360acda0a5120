"""Hessian-vector products on a flat parameter vector, for Lanczos (FOSI's ESE).

Lanczos works on ℝⁿ; networks keep their parameters as a dict of tensors. :func:`make_flat_hvp`
bridges the two: it returns ``v ↦ H v`` with ``v`` and the result flat vectors in the parameters'
order, for the Hessian of ``loss_fn(model(x; θ), y)`` at the current θ on one fixed batch.

Why a module of its own rather than :meth:`curvopt.objective.Objective.hvp`:

* **BatchNorm.** The FOSI authors' JAX code evaluates the ESE loss in training mode (batch
  statistics) and throws the state update away. A ``torch.func`` transform of a module in train
  mode would instead write the running statistics from inside the transform (an error, or
  silently corrupted statistics). :func:`hvp_module` therefore runs the product on a copy whose
  BatchNorm layers use batch statistics and keep no running statistics
  (``torch.func.replace_all_batch_norm_modules_``), so the live model's buffers are never touched.
* **Dropout.** A random loss makes ``v ↦ Hv`` a different matrix at every call, which Lanczos
  cannot detect and turns into garbage Ritz pairs; the copy runs dropout in eval mode.
* **Two modes.** ``forward_over_reverse`` (default, the authors' choice: ``jvp(grad(f))``, one
  forward and one backward with dual numbers) and ``reverse_over_reverse`` (double backward,
  for layers without forward-mode rules, and the faster of the two on the CPU).
* **Primal work once per ESE.** Lanczos applies the same Hessian 40 times; ``reuse=True`` builds
  the product once at the point (linearised jvp, or a retained first backward) so each product
  costs only its tangent part.

A model without BatchNorm or dropout is used as is (no copy, no extra memory).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, linearize, replace_all_batch_norm_modules_

from curvopt.objective import flatten

log = logging.getLogger(__name__)

HVP_MODES = ("forward_over_reverse", "reverse_over_reverse")
LossFn = Callable[[Tensor, Tensor], Tensor]

_BN = (nn.modules.batchnorm._BatchNorm,)
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def hvp_module(model: nn.Module) -> nn.Module:
    """The module to differentiate for Hessian products.

    ``model`` itself when it has no BatchNorm or dropout, else a copy with batch-statistics
    BatchNorm (no running stats) and dropout off. Parameters are always passed explicitly, so
    the copy's own values are unused.

    Args:
        model: The live network (left untouched).

    Returns:
        ``model`` or a deep copy of it prepared as above.
    """
    mods = list(model.modules())
    if not any(isinstance(m, _BN + _DROPOUT) for m in mods):
        return model
    clone = copy.deepcopy(model)
    replace_all_batch_norm_modules_(clone)
    for mod in clone.modules():
        if isinstance(mod, _BN):
            mod.train()  # batch statistics even if the live model is evaluated in eval mode
        if isinstance(mod, _DROPOUT):
            mod.eval()
    return clone


def flat_hvp(
    loss_of: Callable[[dict[str, Tensor]], Tensor],
    params: dict[str, Tensor],
    mode: str = "forward_over_reverse",
    reuse: bool = True,
) -> Callable[[Tensor], Tensor]:
    """Hessian-vector product ``v ↦ ∇²L(θ)·v`` of a functional loss on flat vectors.

    ``L = loss_of(params_dict)`` is differentiated at ``θ = params``; ``v`` and the result are
    flat vectors in the dict's order.

    ``reuse=True`` (for Lanczos: many products at one point) does the primal work once: the
    forward-over-reverse product is linearised (``torch.func.linearize`` of ``grad(L)``: each call
    then runs only the tangent computations), the reverse-over-reverse one keeps the first
    backward's graph and runs one double-backward per call. Measured on the 2-core CPU
    (benchmarks/bench_fosi.py) this takes a product from ≈3.3 to ≈1.5–1.9 gradient evaluations
    (forward-over-reverse) or ≈1.3–1.7 (reverse-over-reverse). The product is then tied to the
    parameter values at creation. ``reuse=False`` re-evaluates at the current values of
    ``params`` on each call. If linearisation fails (an op torch.fx cannot trace), the plain
    per-call ``jvp(grad(L))`` is used.

    Args:
        loss_of: Maps a name → tensor dict to the scalar loss.
        params: The point θ (name → tensor dict; also fixes the flat order).
        mode: ``"forward_over_reverse"`` (``jvp(grad(L))``) or ``"reverse_over_reverse"``
            (double backward); see :data:`HVP_MODES`.
        reuse: Do the primal work once at creation (see above).

    Returns:
        A function mapping a flat vector of ``Σ numel(params)`` entries to ``∇²L(θ) v``.

    Raises:
        ValueError: If ``mode`` is unknown (and, from the returned function, if a vector has
            the wrong number of entries).
    """
    if mode not in HVP_MODES:
        raise ValueError(f"hvp mode must be one of {HVP_MODES}, got {mode!r}")
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    n = sum(sizes)

    def split(v: Tensor) -> dict[str, Tensor]:
        if v.numel() != n:
            raise ValueError(f"vector has {v.numel()} entries, parameters need {n}")
        return {k: t.view(s) for k, t, s in zip(names, torch.split(v, sizes), shapes)}

    if mode == "forward_over_reverse":
        g_fn = grad(loss_of)
        if reuse:
            try:
                with warnings.catch_warnings():  # torch.fx const-folding chatter, harmless
                    warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
                    _, linear = linearize(g_fn, {k: params[k].detach() for k in names})
            except Exception as err:  # noqa: BLE001 - any tracing failure: fall back, same maths
                log.info("linearize failed (%s: %s); plain jvp(grad) per product", type(err).__name__, err)
            else:
                return lambda v: flatten(linear(split(v)))

        def hvp(v: Tensor) -> Tensor:
            primal = {k: params[k].detach() for k in names}
            return flatten(jvp(g_fn, (primal,), (split(v),))[1])

        return hvp

    if reuse:
        primal = {k: params[k].detach().requires_grad_(True) for k in names}
        with torch.enable_grad():
            gs = torch.autograd.grad(loss_of(primal), list(primal.values()), create_graph=True)
        inputs = list(primal.values())

        def hvp_cached(v: Tensor) -> Tensor:
            tangent = split(v)
            with torch.enable_grad():
                hv = torch.autograd.grad(
                    gs, inputs, grad_outputs=[tangent[k] for k in names], retain_graph=True
                )
            return flatten(list(hv))

        return hvp_cached

    def hvp_rr(v: Tensor) -> Tensor:
        primal = {k: params[k].detach().requires_grad_(True) for k in names}
        with torch.enable_grad():
            gs = torch.autograd.grad(loss_of(primal), list(primal.values()), create_graph=True)
            tangent = split(v)
            hv = torch.autograd.grad(gs, list(primal.values()), grad_outputs=[tangent[k] for k in names])
        return flatten(list(hv))

    return hvp_rr


def make_flat_hvp(
    model: nn.Module,
    loss_fn: LossFn,
    params: dict[str, Tensor],
    batch: tuple[Tensor, Tensor],
    mode: str = "forward_over_reverse",
    reuse: bool = True,
) -> Callable[[Tensor], Tensor]:
    """Flat Hessian-vector product ``v ↦ ∇²_θ loss_fn(model(x; θ), y) · v`` on one batch.

    Args:
        model: The module to differentiate, preferably from :func:`hvp_module`.
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar.
        params: θ as a name → tensor dict in the flat order; parameters of ``model`` not in
            it are held fixed.
        batch: The fixed ``(x, y)`` batch.
        mode: As in :func:`flat_hvp`.
        reuse: As in :func:`flat_hvp`.

    Returns:
        The product as a function of a flat vector.
    """
    x, y = batch

    def loss_of(p: dict[str, Tensor]) -> Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    return flat_hvp(loss_of, params, mode, reuse)


def named_subset(model: nn.Module, tensors: Sequence[Tensor]) -> dict[str, Tensor]:
    """Name the given parameters of ``model``, in the given order.

    FOSI needs the loss as a function of exactly the tensors it optimises.

    Args:
        model: The module owning the tensors.
        tensors: Parameters of ``model`` (identity, not value, is matched).

    Returns:
        A name → tensor dict in the order of ``tensors``.

    Raises:
        ValueError: If a tensor is not a parameter of ``model``.
    """
    by_id = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, Tensor] = {}
    for t in tensors:
        name = by_id.get(id(t))
        if name is None:
            raise ValueError(
                "an optimised tensor is not a parameter of the model given for the Hessian products"
            )
        out[name] = t
    return out
