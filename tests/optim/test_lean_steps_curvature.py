"""Lean GPU steps of FGN, SGN, K-FAC and FOSI, proven on the CPU (issue 41, item 2).

* No host read in a plain step: four steps on accelerator tensors that raise on any host read —
  ``fake_cuda()`` (``FakeTensorMode`` CUDA tensors) where the step needs no autograd (FGN's closed
  form, FOSI's optimizer step between two ESEs), the ``meta`` device where it does (FGN's generic
  path, SGN, K-FAC): autograd on a fake CUDA tensor asks a CPU-only torch for a CUDA stream and
  aborts the process. Meta tensors have no data either: ``.item()``, ``float()``, ``bool()``,
  ``.tolist()`` and copies to the CPU raise, and the ``"auto"`` switches take their accelerator
  setting there (anything but the CPU).
* Zero host reads counted by :class:`~curvopt.profiling.DispatchCounter` on the CPU with the
  accelerator settings (``Tensor.tolist``, which dispatches no op on the CPU, is counted too).
* The accelerator settings give the CPU defaults' trajectory: bit for bit for FGN (masked CG
  iterations add exactly 0), to rounding for SGN (device step sizes instead of fused Python-float
  ones); the deferred batch checks raise the eager errors with the parameters untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from curvopt.curvature.cg import STOP_REASONS, cg
from curvopt.objective import Objective
from curvopt.optim.fgn import FGN
from curvopt.optim.fosi import FOSI, make_base_optimizer
from curvopt.optim.kfac import KFAC, _closed_form_lstsq
from curvopt.optim.sgn import SGN, fixed_length_cg
from curvopt.profiling import DispatchCounter, fake_cuda


def _mlp(d_in: int = 6, hidden: int = 5, d_out: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def _on_fake_cuda(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with fake CUDA parameters (call inside ``fake_cuda``; init kernels cannot run)."""
    with torch.device("meta"):
        model = build()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(0.1 * torch.randn(p.shape, device="cuda"))
    return model


@contextlib.contextmanager
def _count_reads() -> Iterator[DispatchCounter]:
    """A DispatchCounter whose ``host_reads`` also counts ``Tensor.tolist`` calls."""
    original = torch.Tensor.tolist
    counter = DispatchCounter()

    def counted(self: torch.Tensor):  # noqa: ANN202
        counter.host_reads += 1
        counter.reads_by_name["Tensor.tolist"] += 1
        return original(self)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def _labels(b: int, c: int, device: str) -> torch.Tensor:
    return torch.arange(b, device=device) % c


# -- no host read on accelerator tensors ------------------------------------------------------------
def test_fgn_closed_form_makes_no_host_read_on_fake_cuda():
    with fake_cuda():
        model = _on_fake_cuda(lambda: nn.Linear(16, 32))
        x, y = torch.randn(8, 16, device="cuda"), _labels(8, 32, "cuda")
        fgn = FGN(Objective(model, "cross_entropy"), host_stats=False)
        assert (fgn.implementation, fgn.cg_early_exit, fgn.check_finite) == ("affine", False, "deferred")
        for _ in range(4):
            stats = fgn.step((x, y))
        assert isinstance(stats["loss"], torch.Tensor) and fgn.steps == 4


@pytest.fixture
def meta_allowed(monkeypatch):
    """The meta device is this file's host-read harness (autograd on fake CUDA aborts a CPU-only torch);
    the Algorithms refuse meta parameters when built for a user (issue 43), so that check is patched out."""
    import curvopt.optim.checks as checks_mod
    import curvopt.optim.kfac as kfac_mod

    monkeypatch.setattr(checks_mod, "check_materialised", lambda owner, named: None)
    monkeypatch.setattr(kfac_mod, "check_materialised", lambda owner, named: None)


@pytest.mark.parametrize("model", ["mlp", "linear"])
def test_fgn_generic_and_sgn_make_no_host_read_on_the_meta_device(model, meta_allowed):
    build = (lambda: _mlp(16, 8, 5)) if model == "mlp" else (lambda: nn.Linear(16, 5))
    with torch.device("meta"):
        x, y = torch.ones(8, 16), torch.zeros(8, dtype=torch.long)
        algs = [
            FGN(Objective(build(), "cross_entropy"), implementation="generic", host_stats=False),
            SGN(Objective(build(), "cross_entropy"), host_stats=False),
        ]
        for alg in algs:
            assert (alg.cg_early_exit, alg.check_finite) == (False, "deferred")
            for _ in range(4):
                stats = alg.step((x, y))
            assert alg.steps == 4 and isinstance(stats["loss"], torch.Tensor)


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_kfac_makes_no_host_read_on_the_meta_device(kind, meta_allowed):
    """Four steps from scratch: step 0 inverts the factors, 1-3 are plain (the damping update, which
    reads ρ, comes at step 4); adaptive lr and momentum, sampled targets."""
    with torch.device("meta"):
        if kind == "mlp":
            model, x = _mlp(8, 16, 5), torch.ones(32, 8)
        else:
            conv = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(108, 5))
            model, x = conv, torch.ones(16, 2, 6, 6)
        kfac = KFAC(Objective(model, "cross_entropy"), host_stats=False)
        for _ in range(4):
            stats = kfac.step((x, torch.zeros(x.shape[0], dtype=torch.long)))
        assert kfac.step_count == 4 and isinstance(stats["lr_coeff"], torch.Tensor)


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("base", ["heavy_ball", "adam"])
def test_fosi_steps_between_eses_make_no_host_read_on_fake_cuda(base, fast_path):
    """The basis is installed as an ESE would (its eigenvalues read on the host once), then four
    optimizer steps; Adam is the fused kernel the training loop builds (``make_base_optimizer``)."""
    with fake_cuda():
        model = _on_fake_cuda(_mlp)
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        opt = FOSI(
            make_base_optimizer(base, params, lr=0.01),
            nn.functional.cross_entropy,
            (None, None),
            model=model,
            k=3,
            l=1,
            ese_period=None,
            ese_warmup=10**9,
            fast_path=fast_path,
        )
        opt.set_basis(torch.linalg.qr(torch.randn(n, 4, device="cuda"))[0].T, [-0.5, 1.0, 2.0, 3.0])
        for _ in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        assert opt.last_info["fosi_active"] == 1 and opt.last_info["lambda_max"] == 3.0


# -- zero host reads counted on the CPU ----------------------------------------------------------------
LEAN = {"cg_early_exit": False, "check_finite": "deferred", "host_stats": False}


def _cpu_problem(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(16, 12) if kind == "linear" else _mlp(16, 8, 12)
    return model, torch.randn(20, 16), torch.randint(0, 12, (20,))


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("fgn-affine", lambda o: FGN(o, **LEAN)),
        ("fgn-generic", lambda o: FGN(o, implementation="generic", **LEAN)),
        ("sgn", lambda o: SGN(o, **LEAN)),
    ],
)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_row_and_parameter_space_steps_count_no_host_read_on_the_cpu(name, make, kind):
    if name == "fgn-affine" and kind == "mlp":
        pytest.skip("the closed form needs a linear head")
    model, x, y = _cpu_problem(kind)
    alg = make(Objective(model, "cross_entropy"))
    for _ in range(4):
        with _count_reads() as counter:
            stats = alg.step((x, y))
        assert counter.host_reads == 0, counter.reads_by_name
    values = alg.read_stats(stats)  # the caller's one read when it logs
    assert math.isfinite(values["loss"]) and isinstance(values["cg_iters"], int)


def test_kfac_steps_between_inversions_count_no_host_read_on_the_cpu():
    model, x, y = _cpu_problem("mlp")
    kfac = KFAC(Objective(model, "cross_entropy"), host_stats=False)
    kfac.step((x, y))  # step 0: the first factors and inversion
    for _ in range(3):  # steps 1-3: plain (inversions every 5 steps, damping update at step 4)
        with _count_reads() as counter:
            stats = kfac.step((x, y))
        assert counter.host_reads == 0, counter.reads_by_name
    assert set(KFAC.read_stats(stats)) == {"loss", "damping", "lr_coeff", "momentum_coeff", "qmodel"}


@pytest.mark.parametrize("base", ["heavy_ball", "adam"])
def test_fosi_steps_between_eses_count_no_host_read_on_the_cpu(base):
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
    loss_fn = nn.functional.cross_entropy
    opt = FOSI(make_base_optimizer(base, model.parameters(), lr=0.01), loss_fn, (x, y), model=model, k=3)
    opt.ese_warmup = 1
    for t in range(5):  # step 0: base only; step 1: the ESE; steps 2-4 counted
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if t < 2:
            opt.step()
            continue
        with _count_reads() as counter:
            opt.step()
        assert counter.host_reads == 0, counter.reads_by_name
    assert opt.ese_count == 1


# -- the same numbers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["affine", "generic"])
def test_fgn_accelerator_settings_give_the_cpu_trajectory_bit_for_bit(implementation):
    torch.manual_seed(0)
    models = [nn.Linear(16, 12) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(20, 16), torch.randint(0, 12, (20,))
    eager = FGN(Objective(models[0], "cross_entropy"), implementation=implementation, cg_maxiter=8)
    lean = FGN(Objective(models[1], "cross_entropy"), implementation=implementation, cg_maxiter=8, **LEAN)
    assert eager.cg_early_exit and eager.check_finite == "eager" and eager.host_stats
    for _ in range(5):
        a, b = eager.step((x, y)), lean.read_stats(lean.step((x, y)))
        assert a == b
        assert a["cg_iters"] < 8  # the early exit did fire: the masked iterations were no-ops
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("float64_dots", [False, True])
def test_sgn_accelerator_settings_give_the_cpu_trajectory_to_rounding(float64_dots):
    torch.manual_seed(0)
    models = [_mlp(16, 8, 12) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(20, 16), torch.randint(0, 12, (20,))
    kw = {"cg_maxiter": 8, "cg_float64_dots": float64_dots}
    eager = SGN(Objective(models[0], "cross_entropy"), **kw)
    lean = SGN(Objective(models[1], "cross_entropy"), **kw, **LEAN)
    for _ in range(5):
        a, b = eager.step((x, y)), lean.read_stats(lean.step((x, y)))
        assert (a["cg_iters"], a["cg_stop"], a["cg_breakdown"]) == (
            b["cg_iters"],
            b["cg_stop"],
            b["cg_breakdown"],
        )
        for key in ("loss", "grad_norm", "step_norm", "cg_residual", "xi_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager.previous, lean.previous, rtol=1e-4, atol=1e-6)


def _spd(n: int, seed: int, shift: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.T + shift * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize(
    ("case", "maxiter", "tol"),
    [("maxiter", 3, 1e-12), ("converged", 50, 1e-6), ("converged_at_0", 5, 1e3), ("warm", 4, 1e-12)],
)
def test_fixed_length_cg_matches_cg(case, maxiter, tol):
    a = _spd(10, 1, shift=10.0)  # well conditioned: CG converges in a few iterations, no round-off growth
    b = torch.randn(10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x0 = 0.1 * b if case == "warm" else None
    ref = cg(lambda v: a @ v, b, x0=x0, tol=tol, maxiter=maxiter, dot_dtype=None)
    x, info = fixed_length_cg(lambda v: a @ v, b, x0=x0, tol=tol, maxiter=maxiter)
    torch.testing.assert_close(x, ref.x, rtol=1e-10, atol=1e-12)
    expected = {
        "maxiter": "maxiter",
        "converged": "converged",
        "converged_at_0": "converged",
        "warm": "maxiter",
    }
    assert ref.stop_reason == expected[case] and (ref.iterations == 0) == (case == "converged_at_0")
    assert int(info["iters"]) == ref.iterations
    assert STOP_REASONS[int(info["stop"])] == ref.stop_reason
    assert float(info["rnorm"] / info["b_norm"]) == pytest.approx(ref.rel_residual, rel=1e-9)


@pytest.mark.parametrize(
    ("diag", "reason"), [([1.0, -1.0], "negative_curvature"), ([1.0, math.inf], "breakdown")]
)
def test_fixed_length_cg_stops_like_cg_on_bad_curvature(diag, reason):
    a = torch.diag(torch.tensor(diag, dtype=torch.float64))
    b = torch.tensor([1.0, 1.0], dtype=torch.float64)
    ref = cg(lambda v: a @ v, b, tol=1e-10, maxiter=5, dot_dtype=None)
    x, info = fixed_length_cg(lambda v: a @ v, b, tol=1e-10, maxiter=5)
    assert ref.stop_reason == reason == STOP_REASONS[int(info["stop"])]
    assert int(info["iters"]) == ref.iterations == 0
    assert torch.equal(x, ref.x)


def test_kfac_closed_form_solve_matches_lstsq():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2):
        for _ in range(20):
            m = torch.randn(k, k, generator=g, dtype=torch.float64)
            a, b = (
                m @ m.T + 0.1 * torch.eye(k, dtype=torch.float64),
                torch.randn(k, generator=g, dtype=torch.float64),
            )
            ref = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)
            torch.testing.assert_close(_closed_form_lstsq(a, b), ref, rtol=1e-12, atol=1e-14)
    # rank one and zero: the minimum-norm solution, as gelsy / the pseudo-inverse
    for a in ([[1.0, 2.0], [2.0, 4.0]], [[0.0, 0.0], [0.0, 3.0]], [[0.0, 0.0], [0.0, 0.0]]):
        a = torch.tensor(a, dtype=torch.float64)
        b = torch.tensor([1.0, -0.5], dtype=torch.float64)
        torch.testing.assert_close(_closed_form_lstsq(a, b), torch.linalg.pinv(a) @ b, rtol=1e-12, atol=1e-14)


# -- the deferred checks keep the contract ----------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("fgn-affine", lambda o: FGN(o, check_finite="deferred")),
        ("fgn-generic", lambda o: FGN(o, implementation="generic", check_finite="deferred")),
        ("sgn", lambda o: SGN(o, check_finite="deferred", cg_early_exit=False)),
    ],
)
@pytest.mark.parametrize("host_stats", [True, False])
def test_deferred_checks_raise_the_eager_errors_and_change_nothing(name, make, host_stats):
    model, x, y = _cpu_problem("linear")
    alg = make(Objective(model, "cross_entropy"))
    alg.host_stats = host_stats
    alg.step((x, y))  # a warm start for SGN
    before = [p.detach().clone() for p in model.parameters()]
    previous = getattr(alg, "previous", None)
    previous = None if previous is None else previous.clone()
    bad_batches = [
        ((x * float("nan"), y), FloatingPointError, "non-finite logits"),
        ((x, y + 12), ValueError, r"labels must lie in \[0, 12\); this batch has labels in \[12, 23\]"),
        ((x, y - 20), ValueError, r"labels must lie in \[0, 12\)"),
    ]
    for batch, error, match in bad_batches:
        with pytest.raises(error, match=match):
            out = alg.step(batch)
            if not host_stats:
                alg.read_stats(out)
        for p, q in zip(before, model.parameters()):
            assert torch.equal(p, q)
        if previous is not None:
            assert torch.equal(alg.previous, previous)
    assert alg.steps == (1 if host_stats else 4)  # with host_stats the error comes before the count


@pytest.mark.parametrize("cls", [FGN, SGN])
def test_raise_if_nonfinite_reports_a_deferred_step_of_several(cls):
    """As RACS's deferred mode: steps that read nothing, then one check for all of them."""
    model, x, y = _cpu_problem("linear")
    alg = cls(Objective(model, "cross_entropy"), check_finite="deferred", host_stats=False)
    assert cls(Objective(model, "cross_entropy"), check_finite="auto").check_finite == "eager"  # CPU
    alg.raise_if_nonfinite()  # nothing pending
    alg.step((x, y))
    alg.raise_if_nonfinite()  # a good step: nothing to raise
    alg.step((x, y))
    before = [p.detach().clone() for p in model.parameters()]
    alg.step((x * float("inf"), y))  # refused: changes nothing
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)
    alg.step((x, y + 30))  # also refused; the first failure is the one reported
    alg.step((x, y))
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        alg.raise_if_nonfinite()
    alg.raise_if_nonfinite()  # reported once
    with pytest.raises(ValueError, match="check_finite"):
        cls(Objective(model, "cross_entropy"), check_finite="lazy")
