"""Gauss-Newton operators of the scaled residual map ``R(w; X) = (net(w; X) − Y)/√n``.

SHF-LSMR needs, once per outer iteration and then many times inside LSMR, the Jacobian ``J = ∇R``
applied forward (``J v``) and backward (``Jᵀ U``), plus two "per-example squared" reductions:
Chapelle–Erhan's diagonal estimate (Algorithm 3) and the per-example gradient variance of the
batch-size test (Algorithm 2). Two implementations share one interface:

* :class:`MLPGaussNewton`: the paper's Algorithms 4/5, hand-written for an ``nn.Sequential`` of
  ``nn.Linear`` layers with elementwise activations (sigmoid/tanh/relu/identity). The forward pass
  caches ``S_ℓ`` and ``S'_ℓ`` once; each product is then two matmuls per layer, written straight
  into a flat parameter-space buffer. The per-example reductions use
  ``Σ_i (s̃_i f_iᵀ)² = (S̃²)ᵀ(F²)``, so per-example gradients are never materialised (for MNIST
  they would be n × 2.84M numbers).
* :class:`FuncGaussNewton`: any model, via ``Objective.linearize`` (``torch.func``); its
  per-example reductions fall back to chunked ``vmap`` of per-example VJPs (memory chunk × P).

Vectors in parameter space are flat, in ``flatten(objective.params())`` order; residual-space
vectors are ``(n, m_out)`` matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, linearize, vjp, vmap

from curvopt.objective import Objective, Params, flatten, unflatten

_ACT_KINDS: dict[type[nn.Module], str] = {
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.ReLU: "relu",
    nn.Identity: "identity",
}


@dataclass
class _Layer:
    weight_key: str
    bias_key: str | None
    act: str  # sigmoid | tanh | relu | identity
    w_slice: slice
    b_slice: slice | None
    shape: tuple[int, int]  # (out, in) as nn.Linear stores it


def mlp_layers(model: nn.Module, params: Params) -> list[_Layer] | None:
    """Layer plan of a hand-writable MLP, or ``None`` when the model is not one.

    Accepted: ``nn.Sequential`` of ``nn.Linear`` modules, each followed by at most one of
    Sigmoid/Tanh/ReLU/Identity, whose trainable parameters are exactly the Linear weights/biases.

    Args:
        model: The network.
        params: Its trainable parameters (name → tensor, in flat order); fixes the offsets of
            each layer's slices in a flat parameter vector.

    Returns:
        One entry per Linear layer (keys, activation, flat slices, weight shape), or ``None``.
    """
    if not isinstance(model, nn.Sequential):
        return None
    offsets: dict[str, slice] = {}
    pos = 0
    for name, t in params.items():
        offsets[name] = slice(pos, pos + t.numel())
        pos += t.numel()
    layers: list[_Layer] = []
    used: set[str] = set()
    pending: _Layer | None = None
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            if pending is not None:
                layers.append(pending)
            wk, bk = f"{name}.weight", (f"{name}.bias" if module.bias is not None else None)
            if wk not in offsets or (bk is not None and bk not in offsets):
                return None
            used.update(k for k in (wk, bk) if k is not None)
            pending = _Layer(
                wk, bk, "identity", offsets[wk], offsets[bk] if bk else None, tuple(module.weight.shape)
            )
        elif type(module) in _ACT_KINDS:
            if pending is None or pending.act != "identity":
                return None  # activation first, or two activations in a row
            pending.act = _ACT_KINDS[type(module)]
        else:
            return None
    if pending is not None:
        layers.append(pending)
    if not layers or used != set(params):
        return None
    return layers


def supports_hand_written(objective: Objective) -> bool:
    """Whether :class:`MLPGaussNewton` applies (squared error on a plain MLP).

    Args:
        objective: The model and its loss kind.

    Returns:
        ``True`` for a squared-error loss on a model :func:`mlp_layers` accepts.
    """
    return (
        objective.loss_kind == "squared_error" and mlp_layers(objective.model, objective.params()) is not None
    )


def _activate(z: Tensor, act: str) -> tuple[Tensor, Tensor | None]:
    """In-place activation of ``z``; returns ``(S, S')`` with ``S' = None`` for identity."""
    if act == "sigmoid":
        s = torch.sigmoid_(z)
        return s, s * (1 - s)
    if act == "tanh":
        s = torch.tanh_(z)
        return s, 1 - s * s
    if act == "relu":
        s = torch.relu_(z)
        return s, (s > 0).to(s.dtype)
    return z, None


class GaussNewtonBase:
    """Interface shared by the hand-written and the ``torch.func`` operators.

    Attributes:
        residual: ``R(w; X) = (out − Y)/√n`` at the cached point, shape ``(n, m_out)``.
        n: Number of examples in the batch.
        numel: Number of parameters P (length of a flat parameter-space vector).
        scale: ``1/√n``.
    """

    residual: Tensor  # R(w; X) = (out − Y)/√n, shape (n, m_out)
    n: int
    numel: int
    scale: float  # 1/√n

    def jvp(
        self, v: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None
    ) -> Tensor:  # pragma: no cover - interface
        """Jacobian-vector product ``J v`` of the scaled residual map.

        Args:
            v: Flat parameter-space vector of length P.
            out: Optional ``(n, m_out)`` tensor to write the result into.
            col_scale: Right diagonal scaling ``c``: computes ``J(c∘v)``.

        Returns:
            ``J v`` (or ``J(c∘v)``), shape ``(n, m_out)``; ``out`` when given.
        """
        raise NotImplementedError

    def vjp(
        self, u: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None
    ) -> Tensor:  # pragma: no cover - interface
        """Vector-Jacobian product ``Jᵀ U`` of the scaled residual map.

        Args:
            u: Residual-space matrix ``U``, shape ``(n, m_out)``.
            out: Optional flat tensor of length P to write the result into.
            col_scale: Diagonal scaling ``c``: computes ``c∘JᵀU``.

        Returns:
            ``JᵀU`` (or ``c∘JᵀU``), flat of length P; ``out`` when given.
        """
        raise NotImplementedError

    def per_example_moments(self, top: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover
        """Sum and sum of squares of per-example vector-Jacobian products.

        ``g_i = J_iᵀ t_i`` with ``J_i`` the *unscaled* Jacobian of example i's output and
        ``t_i`` row i of ``top``. With ``top = out − Y`` these are the per-example gradients of
        ``f_i = ½‖r_i‖²``; with Rademacher rows, Chapelle–Erhan's ``c_i``.

        Args:
            top: ``(n, m_out)`` output-space rows ``t_i``.

        Returns:
            ``(Σ_i g_i, Σ_i g_i²)``, both flat of length P (squares elementwise).
        """
        raise NotImplementedError

    def gradient(self) -> Tensor:
        """The batch-mean loss gradient ``∇f_S = Jᵀ R``.

        Returns:
            A flat vector of length P.
        """
        return self.vjp(self.residual)

    def loss(self) -> float:
        """The batch loss ``f(w; X) = ½ ‖R‖_F²`` at the cached point.

        Returns:
            The loss as a Python float.
        """
        return 0.5 * float((self.residual * self.residual).sum())

    def gn_diag_estimate(self, generator: torch.Generator | None = None) -> Tensor:
        """Unbiased estimate of ``diag(JᵀJ)`` (Chapelle–Erhan; the paper's Algorithm 3, batched).

        One Rademacher draw ``u_i`` per example: ``(1/n) Σ_i (J_iᵀ u_i)²``.

        Args:
            generator: Random generator for the Rademacher draws (the global one if ``None``).

        Returns:
            The flat estimate, length P.
        """
        u = torch.randint(0, 2, self.residual.shape, generator=generator, device=self.residual.device).to(
            self.residual.dtype
        )
        u.mul_(2).sub_(1)
        _, sq = self.per_example_moments(u)
        return sq / self.n

    def batch_gradient_moments(self) -> tuple[Tensor, Tensor]:
        """Per-example gradient sum and sum of squares at the cached point (``f_i = ½‖r_i‖²``).

        Returns:
            ``(Σ_i ∇f_i, Σ_i (∇f_i)²)``, flat of length P (the inputs of the batch-size test).
        """
        return self.per_example_moments(self.residual / self.scale)


class MLPGaussNewton(GaussNewtonBase):
    """Cached forward + Algorithms 4/5 of the paper for a plain MLP with squared-error residual.

    The cache holds ``S_ℓ`` (layer outputs) and ``S'_ℓ`` (activation derivatives) for the batch; it
    is built once per outer iteration and reused by every LSMR product.

    Args:
        objective: A squared-error objective whose model :func:`mlp_layers` accepts.
        params: The point ``w`` (name → tensor, flat order).
        x: Input batch, ``(n, ...)`` (flattened per example).
        y: Targets, reshaped to ``(n, m_out)``.

    Raises:
        ValueError: If the model is not such an MLP or the loss is not squared error.
    """

    def __init__(self, objective: Objective, params: Params, x: Tensor, y: Tensor) -> None:
        layers = mlp_layers(objective.model, params)
        if layers is None or objective.loss_kind != "squared_error":
            raise ValueError(
                "MLPGaussNewton needs an nn.Sequential MLP of Linear+activation and squared error"
            )
        self.layers = layers
        self.params = params
        self.n = int(x.shape[0])
        self.scale = 1.0 / math.sqrt(self.n)
        self.numel = sum(t.numel() for t in params.values())
        self.dtype, self.device = x.dtype, x.device
        self.inputs: list[Tensor] = []  # S_{ℓ-1}, input of layer ℓ
        self.derivs: list[Tensor | None] = []  # S'_ℓ
        s = x.reshape(self.n, -1)
        with torch.no_grad():
            for layer in layers:
                self.inputs.append(s)
                w = params[layer.weight_key]
                z = s @ w.t() if layer.bias_key is None else torch.addmm(params[layer.bias_key], s, w.t())
                s, sp = _activate(z, layer.act)
                self.derivs.append(sp)
            self.output = s
            self.residual = (s - y.reshape(self.n, -1)) * self.scale
        self._inputs_sq: list[Tensor] | None = None
        self._buffers: dict[tuple[str, int], Tensor] = {}
        self._view_cache: dict[tuple, list[tuple[Tensor, Tensor, Tensor | None]]] = {}
        self._weights_t = [params[layer.weight_key].t() for layer in layers]  # Wᵀ views, built once

    # Algorithm 4 (forward mode)
    @torch.no_grad()
    def jvp(self, v: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
        """``J v`` by the paper's Algorithm 4 (forward mode).

        ``col_scale=c`` gives ``J (c∘v)``: one pass ``c∘v`` into a flat work buffer first. The
        per-layer views of ``v`` (or of that buffer) and of the weights are built once per vector
        storage and reused (:meth:`_layer_views`), so a product dispatches its matmuls and
        elementwise factors only, no views. The hidden layers' tangents live in work buffers owned
        by the operator (fresh multi-MB allocations cost page faults on every LSMR iteration on
        CPU).

        Args:
            v: Flat parameter-space vector of length P.
            out: Optional ``(n, m_out)`` tensor receiving the result.
            col_scale: Right diagonal scaling ``c``.

        Returns:
            ``J v``, shape ``(n, m_out)``: ``out`` if given, else a new tensor.
        """
        if col_scale is not None:
            v = torch.mul(v, col_scale, out=self._flat_work())
        views = self._layer_views(v)
        f: Tensor | None = None
        last = len(self.layers) - 1
        for i, (s_in, sp) in enumerate(zip(self.inputs, self.derivs)):
            _, dw_t, db = views[i]
            if i == last:
                z = out
                if z is None:
                    z = torch.empty(self.n, self.layers[i].shape[0], dtype=self.dtype, device=self.device)
            else:
                z = self._work("jvp", i, self.layers[i].shape[0])
            if db is not None:
                torch.addmm(db, s_in, dw_t, out=z)
            else:
                torch.mm(s_in, dw_t, out=z)
            if f is not None:
                z.addmm_(f, self._weights_t[i])
            if sp is not None:
                z.mul_(sp)
            f = z
        assert f is not None
        return f.mul_(self.scale)

    # Algorithm 5 (backward mode)
    @torch.no_grad()
    def vjp(self, u: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
        """``Jᵀ U`` by the paper's Algorithm 5 (backward mode), written layer by layer.

        The per-layer views of ``out`` and the transposed work buffers are built once and reused;
        ``col_scale`` is one pass over the finished vector.

        Args:
            u: ``(n, m_out)`` residual-space matrix.
            out: Optional flat tensor of length P receiving the result.
            col_scale: Diagonal scaling ``c``: computes ``c∘JᵀU``.

        Returns:
            The flat product: ``out`` if given, else a new vector.
        """
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        views = self._layer_views(out)
        top = self.derivs[-1]
        last = len(self.layers) - 1
        f, f_t = self._work("vjp", last, self.layers[-1].shape[0]), self._work_t("vjp", last)
        if top is None:
            torch.mul(u, self.scale, out=f)
        else:
            torch.mul(u, top, out=f).mul_(self.scale)
        for i in range(last, -1, -1):
            dw, _, db = views[i]
            torch.mm(f_t, self.inputs[i], out=dw)
            if db is not None:
                torch.sum(f, 0, out=db)
            if i > 0:
                g = self._work("vjp", i - 1, self.layers[i].shape[1])
                torch.mm(f, self.params[self.layers[i].weight_key], out=g)
                sp = self.derivs[i - 1]
                if sp is not None:
                    g.mul_(sp)
                f, f_t = g, self._work_t("vjp", i - 1)
        if col_scale is not None:
            out.mul_(col_scale)
        return out

    def _layer_views(self, flat: Tensor) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """Per layer ``(dW, dWᵀ, db)`` views of a flat parameter-space vector, cached per storage.

        The key is the vector's address, shape and strides: views of the same memory are the same
        views whatever tensor object carries them, and the cached views keep that memory alive, so
        the address cannot be handed to another tensor meanwhile. The four most recently used
        vectors are kept (LSMR's and CG's work vectors hit on every call).
        """
        key = (flat.data_ptr(), tuple(flat.shape), flat.stride(), flat.dtype)
        views = self._view_cache.pop(key, None)  # re-inserted below: least recently used goes first
        if views is None:
            views = []
            for layer in self.layers:
                dw = flat[layer.w_slice].view(layer.shape)
                db = flat[layer.b_slice] if layer.b_slice is not None else None
                views.append((dw, dw.t(), db))
            if len(self._view_cache) >= 4:
                self._view_cache.pop(next(iter(self._view_cache)))
        self._view_cache[key] = views
        return views

    def _flat_work(self) -> Tensor:
        """A reused flat buffer of P entries (for ``c∘v``)."""
        buf = self._buffers.get(("flat", 0))
        if buf is None:
            buf = self._buffers[("flat", 0)] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return buf

    def _work(self, kind: str, index: int, width: int) -> Tensor:
        key = (kind, index)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(self.n, width, dtype=self.dtype, device=self.device)
        return buf

    def _work_t(self, kind: str, index: int) -> Tensor:
        """The transpose of a work buffer made by :meth:`_work` (a view built once)."""
        key = (kind + "_t", index)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = self._buffers[(kind, index)].t()
        return buf

    @torch.no_grad()
    def per_example_moments(self, top: Tensor) -> tuple[Tensor, Tensor]:
        """Per-example moments by ``Σ_i (s̃_i f_iᵀ)² = (S̃²)ᵀ(F²)``, without per-example gradients.

        Args:
            top: ``(n, m_out)`` output-space rows ``t_i``.

        Returns:
            ``(Σ_i g_i, Σ_i g_i²)`` as in :meth:`GaussNewtonBase.per_example_moments`.
        """
        if self._inputs_sq is None:
            self._inputs_sq = [s * s for s in self.inputs]
        total = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        sq = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        sp_top = self.derivs[-1]
        f = top.reshape(self.n, -1)
        f = f.clone() if sp_top is None else f * sp_top
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            f2 = f * f
            torch.mm(f.t(), self.inputs[i], out=total[layer.w_slice].view(layer.shape))
            torch.mm(f2.t(), self._inputs_sq[i], out=sq[layer.w_slice].view(layer.shape))
            if layer.b_slice is not None:
                torch.sum(f, 0, out=total[layer.b_slice])
                torch.sum(f2, 0, out=sq[layer.b_slice])
            if i > 0:
                f = f @ self.params[layer.weight_key]
                sp = self.derivs[i - 1]
                if sp is not None:
                    f.mul_(sp)
        return total, sq


class FuncGaussNewton(GaussNewtonBase):
    """The same operator for any model through ``torch.func`` (as in ``Objective.linearize``).

    The per-example reductions have no closed form for a generic model: they vmap per-example VJPs
    over chunks of ``chunk_size`` examples, which holds ``chunk_size × P`` numbers at a time —
    exact, but slower and hungrier than the MLP trick.

    Args:
        objective: A squared-error objective (any model).
        params: The point ``w`` (name → tensor, flat order).
        x: Input batch, ``(n, ...)``.
        y: Targets, reshaped to ``(n, m_out)``.
        chunk_size: Examples per ``vmap`` chunk in :meth:`per_example_moments`.

    Raises:
        ValueError: If the loss is not squared error.
    """

    def __init__(
        self, objective: Objective, params: Params, x: Tensor, y: Tensor, chunk_size: int = 32
    ) -> None:
        if objective.loss_kind != "squared_error":
            raise ValueError("the residual map R = (out − Y)/√n needs loss kind squared_error")
        self.objective = objective
        self.params = params
        self.x, self.y = x, y
        self.n = int(x.shape[0])
        self.scale = 1.0 / math.sqrt(self.n)
        self.numel = sum(t.numel() for t in params.values())
        self.chunk_size = chunk_size
        # one forward with the VJP closure; the JVP (torch.func.linearize, a traced second forward)
        # is built on the first J·v only, so the variance test at a new w pays a forward, not a trace
        f = lambda p: functional_call(objective.model, p, (x,))
        outputs, pullback = vjp(f, params)
        self._pullback = pullback
        self._linear = None
        self.out_shape = outputs.shape
        self.output = outputs.detach().reshape(self.n, -1)
        self.residual = (self.output - y.reshape(self.n, -1)) * self.scale

    def jvp(self, v: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
        """``J v`` through ``torch.func.linearize`` (traced on the first call).

        Args:
            v: Flat parameter-space vector of length P.
            out: Optional ``(n, m_out)`` tensor receiving the result.
            col_scale: Right diagonal scaling ``c``: computes ``J(c∘v)``.

        Returns:
            ``J v``, shape ``(n, m_out)``.
        """
        if col_scale is not None:
            v = v * col_scale
        if self._linear is None:
            f = lambda p: functional_call(self.objective.model, p, (self.x,))
            _, self._linear = linearize(f, self.params)
        with torch.no_grad():
            jv = self._linear(unflatten(v, self.params)).reshape(self.n, -1)
            return torch.mul(jv, self.scale, out=out) if out is not None else jv.mul_(self.scale)

    def vjp(self, u: Tensor, out: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
        """``Jᵀ U`` through the VJP closure of the cached forward.

        Args:
            u: ``(n, m_out)`` residual-space matrix.
            out: Optional flat tensor of length P receiving the result.
            col_scale: Diagonal scaling ``c``: computes ``c∘JᵀU``.

        Returns:
            The flat product.
        """
        with torch.no_grad():
            grads = self._pullback(u.reshape(self.out_shape) * self.scale)[0]
            if out is None:
                out = flatten(grads)
            else:
                torch.cat([t.reshape(-1) for t in grads.values()], out=out)
            return out.mul_(col_scale) if col_scale is not None else out

    def per_example_moments(self, top: Tensor) -> tuple[Tensor, Tensor]:
        """Per-example moments by chunked ``vmap`` of per-example VJPs.

        Args:
            top: ``(n, m_out)`` output-space rows ``t_i``.

        Returns:
            ``(Σ_i g_i, Σ_i g_i²)`` as in :meth:`GaussNewtonBase.per_example_moments`.
        """
        model = self.objective.model
        top = top.reshape(self.n, *self.out_shape[1:])

        def one(p: Params, xi: Tensor, ti: Tensor) -> Params:
            _, pull = vjp(lambda q: functional_call(model, q, (xi.unsqueeze(0),)), p)
            return pull(ti.unsqueeze(0))[0]

        total = torch.zeros(self.numel, dtype=self.output.dtype, device=self.output.device)
        sq = torch.zeros_like(total)
        with torch.no_grad():
            for start in range(0, self.n, self.chunk_size):
                sl = slice(start, start + self.chunk_size)
                grads = vmap(one, in_dims=(None, 0, 0))(self.params, self.x[sl], top[sl])
                flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
                total += flat.sum(0)
                sq += (flat * flat).sum(0)
        return total, sq


def residual_gauss_newton(
    objective: Objective, params: Params, x: Tensor, y: Tensor, hand_written: bool = True
) -> GaussNewtonBase:
    """The Gauss-Newton operator of the residual map at ``params`` on one batch.

    Args:
        objective: A squared-error objective.
        params: The point ``w``.
        x: Input batch.
        y: Targets.
        hand_written: Use :class:`MLPGaussNewton` when the model is a plain MLP.

    Returns:
        :class:`MLPGaussNewton` when requested and applicable, else :class:`FuncGaussNewton`.
    """
    if hand_written and mlp_layers(objective.model, params) is not None:
        return MLPGaussNewton(objective, params, x, y)
    return FuncGaussNewton(objective, params, x, y)
