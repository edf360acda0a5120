"""One way to declare and check hyper-parameters (``curvopt.optim.checks``), and the issue-43 bad arguments.

Each optimizer declares its ranges once (``RANGES`` / a module-level table) and checks them with
:func:`~curvopt.optim.checks.check_hparams`; a refusal is one line naming the owner, the argument, the
value and what is allowed. Tensor values (a 0-d tensor ``lr``) are checked by value.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from curvopt.errors import NonFiniteError
from curvopt.optim import RACS, Alice, MatrixOptimizer
from curvopt.optim.checks import (
    FLAG,
    NONNEG,
    POSITIVE,
    UNIT,
    as_number,
    at_least,
    check_hparams,
    count,
    one_of,
    optional,
    real,
    tuple_of,
    typed,
)

NAN, INF = math.nan, math.inf


# ------------------------------------------------------------------------------- the checker
@pytest.mark.parametrize(
    ("rng", "good", "bad"),
    [
        (
            NONNEG,
            [0, 0.0, 3, 1e300, torch.tensor(0.5)],
            [-1e-9, NAN, INF, True, "1", None, torch.tensor(NAN)],
        ),
        (POSITIVE, [1e-30, 2], [0.0, -1, NAN, INF]),
        (UNIT, [0.0, 0.999], [1.0, -0.1, NAN]),
        (at_least(1.0), [1.0, 1.01, 7], [0.99, INF, NAN]),
        (count(1), [1, 5, 5.0], [0, -3, 2.5, NAN, INF, True]),
        (count(0), [0, 2], [-1]),
        (one_of("a", None), ["a", None], ["b", 1]),
        (FLAG, [True, False], [1, 0, "true", None]),
        (optional(POSITIVE), [None, 1.0], [0.0]),
        (tuple_of(2, UNIT), [(0.9, 0.999), [0.0, 0.5]], [(0.9,), (0.9, 1.0), (NAN, 0.9), 0.9]),
        (real(0.0, 1.0, low_open=True), [1.0, 1e-9], [0.0, 1.1]),
        (real(finite=False, low=0.0), [INF, 0.0], [NAN, -INF]),
        (real(0.0, low_open=True, also=("adaptive",)), ["adaptive", 0.1], ["auto", 0.0]),
    ],
)
def test_a_range_accepts_its_values_and_refuses_the_rest(rng, good, bad):
    for value in good:
        rng.check("Owner", "x", value)
    for value in bad:
        with pytest.raises(ValueError, match=r"^Owner: x must be .+, got "):
            rng.check("Owner", "x", value)


def test_the_message_names_owner_argument_value_and_what_is_allowed():
    with pytest.raises(ValueError) as err:
        check_hparams("RACS", {"gamma": at_least(1.0)}, {"gamma": INF})
    assert str(err.value) == "RACS: gamma must be a finite number >= 1, got inf"
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got tensor\(nan\)"):
        check_hparams("X", {"lr": NONNEG}, {"lr": torch.tensor(NAN)})
    with pytest.raises(ValueError, match=r"must be one of 'eager', 'deferred', got 'lazy'"):
        one_of("eager", "deferred").check("X", "check_finite", "lazy")


def test_tensor_values_are_read_on_the_cpu_and_not_on_meta():
    assert as_number(torch.tensor(0.25, dtype=torch.float64)) == 0.25
    assert as_number(torch.tensor([0.25])) == 0.25  # one element
    assert as_number(torch.ones(2)) is None  # not a scalar
    assert as_number(torch.tensor(True)) is None
    NONNEG.check("X", "lr", torch.empty((), device="meta"))  # no value to read: the shape only
    with pytest.raises(ValueError, match="a tensor of shape \\(2,\\)"):
        NONNEG.check("X", "lr", torch.ones(2))


def test_undeclared_values_are_not_looked_at():
    check_hparams("X", {"lr": NONNEG}, {"lr": 0.1, "whatever": NAN})


def test_typed_keeps_the_declared_types_and_literals():
    ranges = {
        "lr": NONNEG,
        "n": count(1, also=("auto",)),
        "on": FLAG,
        "mode": one_of("a", "b"),
        "cap": optional(POSITIVE),
    }
    values = {"lr": 2, "n": 250.0, "on": True, "mode": "b", "cap": None, "unused": NAN}
    out = typed(ranges, values, ["n", "lr", "on", "mode", "cap"])
    assert list(out) == ["n", "lr", "on", "mode", "cap"]
    assert [(v, type(v)) for v in out.values()] == [
        (250, int),
        (2.0, float),
        (True, bool),
        ("b", str),
        (None, type(None)),
    ]
    assert typed(ranges, {"n": "auto"}, ["n"]) == {"n": "auto"}


# ------------------------------------------------------------------------------- RACS / Alice / base
def _groups():
    w = nn.Parameter(torch.randn(6, 9))
    b = nn.Parameter(torch.randn(9))
    return w, b, [{"params": [w]}, {"params": [b], "adam": True}]


def _build(name, groups, **kw):
    if name == "RACS":
        return RACS(groups, **kw)
    if name == "Alice":
        return Alice(groups, **{"rank": 2, "leading": 1, "update_interval": 2, **kw})
    return MatrixOptimizer([{**g, "adam": True} for g in groups], {"lr": 0.02, **kw})


@pytest.mark.parametrize("name", ["RACS", "Alice", "MatrixOptimizer"])
@pytest.mark.parametrize("lr", [NAN, -1.0, INF])
def test_a_tensor_lr_is_validated(name, lr):
    """Issue 43: a NaN tensor lr passed and turned every parameter into NaN."""
    _, _, groups = _groups()
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got tensor\("):
        _build(name, groups, lr=torch.tensor(lr))


@pytest.mark.parametrize("name", ["RACS", "Alice", "MatrixOptimizer"])
def test_a_valid_tensor_lr_steps_like_the_float(name):
    w1, b1, g1 = _groups()
    w2, b2, g2 = [nn.Parameter(p.detach().clone()) for p in (w1, b1)] + [None]
    g2 = [{"params": [w2]}, {"params": [b2], "adam": True}]
    opt1, opt2 = _build(name, g1, lr=0.02), _build(name, g2, lr=torch.tensor(0.02))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        gw, gb = torch.randn(6, 9, generator=gen), torch.randn(9, generator=gen)
        w1.grad, b1.grad, w2.grad, b2.grad = gw, gb, gw.clone(), gb.clone()
        opt1.step()
        opt2.step()
    torch.testing.assert_close(w1, w2)
    torch.testing.assert_close(b1, b2)


@pytest.mark.parametrize("name", ["RACS", "Alice"])
def test_gamma_inf_is_refused(name):
    _, _, groups = _groups()
    with pytest.raises(ValueError, match=f"^{name}: gamma must be a finite number >= 1, got inf$"):
        _build(name, groups, gamma=INF)


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_alice_subspace_steps_below_one_are_refused(steps):
    _, _, groups = _groups()
    with pytest.raises(ValueError, match="Alice: subspace_steps must be an integer >= 1"):
        _build("Alice", groups, subspace_steps=steps)


@pytest.mark.parametrize(
    "bad",
    [
        {"n_iter": 0},
        {"n_iter": 2.5},
        {"eps": 0.0},
        {"eps": INF},
        {"alpha": INF},
        {"warm_start": "yes"},
        {"check_finite": "lazy"},
        {"foreach": 1},
        {"compile": "no"},
        {"adam_eps": -1.0},
        {"weight_decay": INF},
    ],
)
def test_racs_refuses_each_bad_setting_by_name(bad):
    _, _, groups = _groups()
    (key,) = bad
    with pytest.raises(ValueError, match=f"^RACS: {key} must be "):
        _build("RACS", groups, **bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"rank": 0},
        {"leading": -1},
        {"update_interval": 0},
        {"alpha_c": INF},
        {"switch": "random"},
        {"betas": (0.9, 0.9)},
        {"seed": -1},
        {"bias_correction": 1},
    ],
)
def test_alice_refuses_each_bad_setting_by_name(bad):
    _, _, groups = _groups()
    (key,) = bad
    with pytest.raises(ValueError, match=f"^Alice: {key} must be "):
        _build("Alice", groups, **bad)


@pytest.mark.parametrize("flag", ["maximize", "differentiable"])
def test_matrix_optimizer_refuses_maximize_instead_of_ignoring_it(flag):
    """Issue 43: maximize=True was silently ignored (the step still descended)."""
    _, _, groups = _groups()
    with pytest.raises(ValueError, match=f"MatrixOptimizer: {flag}=True is not supported"):
        _build("MatrixOptimizer", groups, **{flag: True})
    with pytest.raises(ValueError, match=f"RACS: {flag}=True is not supported"):
        RACS([{**groups[0], flag: True}])
    _build("MatrixOptimizer", groups, maximize=False)  # the default, said out loud, is fine


@pytest.mark.parametrize("name", ["RACS", "Alice"])
@pytest.mark.parametrize("mode", ["eager", "deferred"])
@pytest.mark.parametrize("scale", [1e30, 1e20])
def test_huge_gradients_are_refused_before_any_change(name, mode, scale):
    """Issue 43: gradients ×1e30 gave NaN parameters (RACS) or an eigh LAPACK error (Alice)."""
    w, b, groups = _groups()
    opt = _build(name, groups, lr=0.02, check_finite=mode, foreach=mode == "deferred")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # past Alice's first refresh
        w.grad, b.grad = torch.randn(6, 9, generator=gen), torch.randn(9, generator=gen)
        opt.step()
    before = [w.detach().clone(), b.detach().clone()]
    state = {k: v.clone() for k, v in opt.state[w].items() if isinstance(v, torch.Tensor)}
    w.grad, b.grad = scale * torch.randn(6, 9, generator=gen), torch.randn(9, generator=gen)
    with pytest.raises(NonFiniteError, match=f"{name}: .*(beyond the .* without overflow|too large)"):
        opt.step()
        opt.raise_if_nonfinite()
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    for k, v in state.items():
        assert torch.equal(opt.state[w][k], v), k


@pytest.mark.parametrize("name", ["RACS", "Alice"])
@pytest.mark.parametrize("scale", [1e-30, 1e6])
def test_small_and_large_but_representable_gradients_still_step(name, scale):
    w, b, groups = _groups()
    opt = _build(name, groups, lr=0.02)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        w.grad, b.grad = scale * torch.randn(6, 9, generator=gen), scale * torch.randn(9, generator=gen)
        opt.step()
    assert torch.isfinite(w).all() and torch.isfinite(b).all()


def test_the_adam_fallback_refuses_a_gradient_it_cannot_square():
    """Adam's v = EMA(g²) overflows to inf past √max: every later step of that parameter would be 0."""
    w, b, groups = _groups()
    opt = _build("MatrixOptimizer", groups)
    w.grad, b.grad = torch.randn(6, 9), torch.full((9,), 1e30)
    with pytest.raises(NonFiniteError, match=r"parameter #1 \(shape \(9,\)\) reaches \|g\| = 1e\+30"):
        opt.step()


# ------------------------------------------------------------------------------- the Algorithms
def _mlp() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


_X = torch.randn(80, 4, generator=torch.Generator().manual_seed(1))
_YC = torch.randint(0, 3, (80,), generator=torch.Generator().manual_seed(2))
_YR = torch.randn(80, 3, generator=torch.Generator().manual_seed(3))


def _build_algorithm(name: str, model: nn.Module | None = None, **kw):
    from curvopt.api import DataBundle
    from curvopt.objective import Objective
    from curvopt.optim import FGN, HFCG, KFAC, SGN, SHF

    model = _mlp() if model is None else model
    if name == "SHF":
        data = DataBundle(train=(_X[:64], _YR[:64]), val=(_X[64:], _YR[64:]))
        return SHF(Objective(model, "squared_error"), data, **{"batch_size": 16, "max_batch_size": 32, **kw})
    objective = Objective(model, "cross_entropy")
    if name == "HFCG":
        data = DataBundle(train=(_X[:64], _YC[:64]), val=(_X[64:], _YC[64:]))
        return HFCG(objective, data, **{"numchunks": 2, "cg_maxiter": 3, **kw})
    return {"FGN": FGN, "SGN": SGN, "KFAC": KFAC}[name](objective, **kw)


def _numeric_settings(name: str) -> dict[str, Any]:
    from curvopt.optim import fgn, hf_cg, kfac, sgn, shf
    from curvopt.optim.checks import GN_STEP_RANGES

    table = {
        "SHF": shf.SHF_RANGES,
        "HFCG": hf_cg.HFCG_RANGES,
        "FGN": {**GN_STEP_RANGES, **fgn.FGN_RANGES},
        "SGN": {**GN_STEP_RANGES, **sgn.SGN_RANGES},
        "KFAC": kfac.KFAC_RANGES,
    }[name]
    return {k: r for k, r in table.items() if r.kind in ("real", "int")}


OWNER = {"SHF": "SHF", "HFCG": "HF-CG", "FGN": "FGN", "SGN": "SGN", "KFAC": "K-FAC"}


@pytest.mark.parametrize("name", ["SHF", "HFCG", "FGN", "SGN", "KFAC"])
def test_every_numeric_setting_refuses_nan_negative_and_inf(name):
    """Issue 43: SHF accepted 40 of 66 such settings, HF-CG 32 of 54, FGN 5 of 15 (margin_clamp, cg_tol=inf),
    SGN 2 of 12 (cg_tol=inf), K-FAC 9 of 38 (its damping thresholds, periods of inf)."""
    settings = _numeric_settings(name)
    assert len(settings) >= 4
    accepted = []
    for key, rng in settings.items():
        for bad in (NAN, -1.0, INF):
            if rng.accepts(bad):  # the seed (any integer), K-FAC's max_damping (inf: no cap)
                continue
            try:
                _build_algorithm(name, **{key: bad})
            except ValueError as err:
                message = str(err)
                assert message.startswith(f"{OWNER[name]}: {key} must be "), message
                assert "\n" not in message
                continue
            accepted.append(f"{key}={bad}")
    assert not accepted, f"{name} accepted {accepted}"


@pytest.mark.parametrize("name", ["SHF", "HFCG"])
def test_a_model_with_nothing_trainable_is_refused_by_name(name):
    """Issue 43: SHF raised a bare StopIteration (HF-CG accepted it)."""
    model = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match=f"{OWNER[name]}: the model has no trainable parameter"):
        _build_algorithm(name, model)


@pytest.mark.parametrize("name", ["SHF", "HFCG"])
def test_mixed_float32_float64_parameters_are_refused_up_front(name):
    """Issue 43: the step failed inside torch.func (mat1 and mat2 must have the same dtype)."""
    model = _mlp()
    model[2].double()
    with pytest.raises(
        ValueError, match=r"needs one dtype; got 0\.weight is torch\.float32, 2\.weight is torch\.float64"
    ):
        _build_algorithm(name, model)


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("KFAC", {"damping_lower_threshold": 0.8, "damping_upper_threshold": 0.2}),
        ("SHF", {"rho_low": 0.9, "rho_high": 0.1}),
        ("HFCG", {"rho_low": 0.9, "rho_high": 0.1}),
    ],
)
def test_crossed_thresholds_are_refused(name, kw):
    with pytest.raises(ValueError, match="<="):
        _build_algorithm(name, **kw)


@pytest.mark.parametrize("name", ["FGN", "SGN"])
def test_fgn_and_sgn_share_one_validation(name):
    from curvopt.optim.checks import GN_STEP_RANGES

    for key in GN_STEP_RANGES:
        bad = "nope"
        with pytest.raises(ValueError, match=f"^{name}: {key} must be "):
            _build_algorithm(name, **{key: bad})


def test_kfac_keeps_adaptive_and_an_uncapped_max_damping():
    kfac = _build_algorithm("KFAC", lr="adaptive", momentum="adaptive", max_damping=INF)
    assert kfac.lr == "adaptive" and kfac.max_damping == INF
    with pytest.raises(ValueError, match="K-FAC: lr must be 'adaptive' or a finite number > 0, got 'auto'"):
        _build_algorithm("KFAC", lr="auto")


def test_a_device_tensor_lr_is_not_read_inside_step():
    """On fake CUDA tensors (any host read raises) a tensor lr builds and steps without a read.

    A real accelerator tensor is read once, at construction (checks.as_number); a fake one has no
    value and is checked for its shape only.
    """
    from curvopt.profiling import fake_cuda

    with fake_cuda():
        w = nn.Parameter(torch.randn(6, 9, device="cuda"))
        b = nn.Parameter(torch.randn(9, device="cuda"))
        lr = torch.tensor(0.02, device="cuda")
        opt = RACS([{"params": [w]}, {"params": [b], "adam": True}], lr=lr, check_finite="deferred")
        for _ in range(2):
            w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
            opt.step()
        assert isinstance(opt.nonfinite_pending, torch.Tensor)
        with pytest.raises(
            ValueError, match=r"lr must be a finite number >= 0, got a tensor of shape \(2,\)"
        ):
            RACS([w], lr=torch.ones(2, device="cuda"))


@pytest.mark.parametrize("name", ["RACS", "Alice"])
def test_a_state_dict_of_groups_in_another_order_is_refused_before_loading(name):
    """torch.optim maps saved groups by position: a matrix's state would land on a bias."""
    w, b, groups = _groups()
    opt = _build(name, groups, lr=0.02)
    for _ in range(2):
        w.grad, b.grad = torch.randn(6, 9), torch.randn(9)
        opt.step()
    sd = opt.state_dict()
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    swapped = _build(name, [{"params": [b2], "adam": True}, {"params": [w2]}], lr=0.02)
    with pytest.raises(
        ValueError, match=f"{name}: parameter group #0 was saved with adam=False but is adam=True"
    ):
        swapped.load_state_dict(sd)
    assert not swapped.state
    # same kinds, other shapes: the state sizes do not fit
    v1, v2 = nn.Parameter(torch.randn(6, 9)), nn.Parameter(torch.randn(9, 4))
    a = _build(name, [{"params": [v1, v2]}], lr=0.02) if name == "RACS" else None
    if a is not None:
        v1.grad, v2.grad = torch.randn(6, 9), torch.randn(9, 4)
        a.step()
        u1, u2 = nn.Parameter(torch.randn(9, 4)), nn.Parameter(torch.randn(6, 9))
        b_opt = _build(name, [{"params": [u1, u2]}], lr=0.02)
        with pytest.raises(ValueError, match=r"the saved 's' of parameter #0 \(group #0\) has 9 elements"):
            b_opt.load_state_dict(a.state_dict())
