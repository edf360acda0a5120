"""Dense float64 references for the FGN tests (explicit Jacobians, GGN, FGN, residual blocks),
imported by the other test_fgn_* files, plus a check of the reference against Objective.ggn_vp."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from curvopt.objective import flatten, unflatten


def mlp(d_in: int, hidden: int, classes: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).double()


def head(d_in: int, classes: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, classes).double()


@dataclass
class Dense:
    """Per-batch dense quantities at the model's current parameters (float64)."""

    z: Tensor  # (b, C) logits
    jz: Tensor  # (b, C, d) logit Jacobians
    p: Tensor  # (b, C)
    s: Tensor  # (b,)
    rho: Tensor  # (b, C), 0 at the true class
    a: Tensor  # (b, C) ∇_z s
    js: Tensor  # (b, d) margin Jacobian rows
    q: Tensor  # (b,)
    grad: Tensor  # (d,) gradient of the mean CE
    h_ggn: Tensor  # (d, d)
    h_fgn: Tensor  # (d, d)
    r_comp: Tensor  # (d, d) dropped residual, from the block formula (3.4)
    gap: Tensor  # (d, d) from the gap formula (3.5)


def dense(model: nn.Module, x: Tensor, y: Tensor) -> Dense:
    params = {k: v.detach() for k, v in model.named_parameters()}
    flat = flatten(params)

    def logits(w: Tensor) -> Tensor:
        return functional_call(model, unflatten(w, params), (x,))

    z = logits(flat).detach()
    jz = jacrev(logits)(flat)  # (b, C, d)
    b, c = z.shape
    p = torch.softmax(z, 1)
    onehot = torch.nn.functional.one_hot(y, c).double()
    s_list, rho_list = [], []
    for i in range(b):
        comp = [j for j in range(c) if j != int(y[i])]
        zc = z[i, comp]
        s_list.append(torch.logsumexp(zc, 0) - z[i, y[i]])
        r = torch.zeros(c, dtype=z.dtype)
        r[comp] = torch.softmax(zc, 0)
        rho_list.append(r)
    s, rho = torch.stack(s_list), torch.stack(rho_list)
    a = rho - onehot
    js = torch.einsum("bc,bcd->bd", a, jz)
    p_star = (p * onehot).sum(1)
    p_dag = 1 - p_star
    q = p_star * p_dag
    grad = torch.einsum("bc,bcd->d", p - onehot, jz) / b
    d = flat.numel()
    h_ggn = torch.zeros(d, d, dtype=z.dtype)
    h_fgn = torch.zeros(d, d, dtype=z.dtype)
    r_comp = torch.zeros(d, d, dtype=z.dtype)
    gap = torch.zeros(d, d, dtype=z.dtype)
    for i in range(b):
        cov = torch.diag(p[i]) - torch.outer(p[i], p[i])
        h_ggn += jz[i].T @ cov @ jz[i]
        h_fgn += q[i] * torch.outer(js[i], js[i])
        comp = [j for j in range(c) if j != int(y[i])]
        rc = rho[i, comp]
        jc = jz[i, comp]  # (C-1, d)
        r_comp += p_dag[i] * jc.T @ (torch.diag(rc) - torch.outer(rc, rc)) @ jc
        jbar = rc @ jc
        dev = jc - jbar
        gap += p_dag[i] * (dev.T * rc) @ dev
    return Dense(z, jz, p, s, rho, a, js, q, grad, h_ggn / b, h_fgn / b, r_comp / b, gap / b)


def damped_solve(h: Tensor, g: Tensor, lam: float) -> Tensor:
    return -torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), g)


def test_dense_reference_ggn_matches_objective_ggn_vp():
    """The reference itself: its H_GGN equals the project's ``Objective.ggn_vp`` (torch.func)."""
    from curvopt.objective import Objective

    model = mlp(3, 4, 5, seed=7)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randint(0, 5, (4,), generator=g)
    ref = dense(model, x, y)
    obj = Objective(model, "cross_entropy")
    params = obj.params()
    v = torch.randn(ref.h_ggn.shape[0], generator=g, dtype=torch.float64)
    got = flatten(obj.ggn_vp(params, x, y, unflatten(v, params)))
    torch.testing.assert_close(got, ref.h_ggn @ v, rtol=1e-10, atol=1e-12)
