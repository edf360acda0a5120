"""Lean GPU steps of RACS, Alice and Alice-0, proven on the CPU (docs/lean_steps.md).

* No host read in a plain step: four steps on ``FakeTensorMode`` CUDA tensors (any ``.item()``,
  ``float()``, ``bool()``, ``.tolist()``, boolean mask or copy to the CPU raises there), and zero host
  reads counted by :class:`curvopt.profiling.DispatchCounter`.
* Few ops: at the 56 LLaMA-60M matrices a plain step dispatches at most 350 (RACS) / 250 (Alice)
  ops on CUDA (it was 4,713 / 2,689 per matrix, 577 / 357 stacked).
* ``check_finite="deferred"``: a NaN gradient changes nothing and is raised at the next check; on
  finite gradients the deferred step equals the eager one.
* State banks: the per-parameter state is a slice of one stacked tensor per shape, rebuilt after
  ``load_state_dict`` / ``deepcopy``, and ``state_dict`` keeps ``torch.optim``'s layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo import config as dynamo_config

from curvopt.errors import NonFiniteError
from curvopt.optim import build_optimizer
from curvopt.optim.alice import Alice
from curvopt.optim.alice_basis import canonical_signs
from curvopt.optim.grouping import optimizer_state_bytes
from curvopt.optim.racs import RACS
from curvopt.profiling import DispatchCounter, HostReadError, fake_cuda

# LLaMA-60M's 56 block matrices (8 layers × q, k, v, o, gate, up, down), as nn.Linear stores them
LLAMA60M = [(512, 512)] * 4 + [(1376, 512)] * 2 + [(512, 1376)]
LLAMA60M = LLAMA60M * 8
SMALL = [(6, 9), (6, 9), (9, 6), (6, 9), (7, 7), (9, 6)]


def _make(method: str, params: list[torch.nn.Parameter], **kw) -> torch.optim.Optimizer:
    rank = kw.pop("rank", 4)
    if method == "racs":
        return RACS(params, lr=0.02, **kw)
    betas = (0.9, 0.9, 0.0) if method == "alice0" else (0.9, 0.9, 0.999)
    return Alice(params, lr=0.02, rank=rank, leading=min(40, rank), update_interval=200, betas=betas, **kw)


def _fake_steps(method: str, shapes, plain_steps: int, **kw) -> DispatchCounter:
    """Build the optimizer on fake CUDA parameters, take its first step (a refresh for Alice, which
    checks eagerly: its one host read is patched out here), then ``plain_steps`` counted steps."""
    with fake_cuda():
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        opt = _make(method, params, **kw)
        opt._check_finite_gradients = lambda ps: None  # the first step's eager check (one read)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        del opt._check_finite_gradients
        counter = DispatchCounter()
        for _ in range(plain_steps):
            for p in params:
                p.grad = torch.randn_like(p)
            with counter:
                opt.step()
        assert isinstance(opt.nonfinite_pending, torch.Tensor)
    return counter


@pytest.mark.parametrize("method", ["racs", "alice", "alice0"])
def test_plain_steps_make_no_host_read_on_cuda(method):
    counter = _fake_steps(method, SMALL, plain_steps=4)
    assert counter.host_reads == 0, counter.reads_by_name


@pytest.mark.parametrize(("method", "limit"), [("racs", 350), ("alice", 250), ("alice0", 250)])
def test_plain_step_op_counts_at_llama60m_shapes(method, limit):
    counter = _fake_steps(method, LLAMA60M, plain_steps=1, rank=128)
    assert counter.host_reads == 0
    assert counter.ops <= limit, (counter.summary(), counter.by_name.most_common(10))


@pytest.mark.parametrize("beta3", [0.999, 0.0])
def test_alice_refresh_is_batched_per_shape(beta3):
    """A refresh of all 56 matrices (subspace iteration, Switch, Q̃ re-projection) is batched per
    shape: ≤ 800 ops (5,545 one matrix at a time) and no host read beyond its eager finiteness check
    (patched out here; on CUDA each batched ``eigh`` adds one hidden info check: 3 per refresh)."""
    with fake_cuda():
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in LLAMA60M]
        opt = Alice(params, lr=0.02, rank=128, leading=40, update_interval=200, betas=(0.9, 0.9, beta3))
        opt._check_finite_gradients = lambda ps: None
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        for st in opt.state.values():
            st["step"] = 399  # the next step, t = 400, refreshes
        for p in params:
            p.grad = torch.randn_like(p)
        with DispatchCounter() as counter:
            opt.step()
    assert counter.host_reads == 0, counter.reads_by_name
    assert counter.ops <= 800, counter.by_name.most_common(10)
    assert all(st["n_switch"] == 2 for st in opt.state.values())


def test_fake_cuda_catches_host_reads():
    """The harness itself: every kind of host read raises under fake_cuda."""
    reads = [
        lambda t: float(t.sum()),
        lambda t: bool((t > 0).all()),
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: t[t > 0],
        lambda t: t.nonzero(),
        lambda t: t.cpu(),
        lambda t: t.to("cpu"),
        lambda t: torch.zeros(3).copy_(t),
    ]
    with fake_cuda():
        t = torch.randn(3, device="cuda")
        for read in reads:
            with pytest.raises((RuntimeError, HostReadError)):
                read(t)


def test_eager_mode_reads_once_per_step_and_the_old_per_matrix_check_is_gone():
    """On the CPU (eager by default) a step reads one flag for all gradients, not one per matrix."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SMALL]
    opt = RACS(params, lr=0.02, foreach=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        with DispatchCounter() as counter:
            opt.step()
    assert counter.host_reads == 1
    assert counter.by_name["aten.sum.default"] == 0  # no per-gradient sums


def _pair(method: str, dtype=torch.float64, **kw):
    g = torch.Generator().manual_seed(0)
    shapes = SMALL + [(5,), (3, 4, 2)]
    a = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]

    def groups(ps):
        return [
            {"params": [p for p in ps if p.dim() == 2]},
            {"params": [p for p in ps if p.dim() != 2], "adam": True},
        ]

    oa = _make(method, groups(a), foreach=True, check_finite="eager", weight_decay=0.1, **kw)
    ob = _make(method, groups(b), foreach=True, check_finite="deferred", weight_decay=0.1, **kw)
    return a, b, oa, ob


def _grads(params, g, bad_index=None):
    out = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    if bad_index is not None:
        out[bad_index].view(-1)[0] = float("nan")
    return out


@pytest.mark.parametrize("method", ["racs", "alice", "alice0"])
def test_deferred_equals_eager_on_finite_gradients(method):
    a, b, oa, ob = _pair(method)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for pa, pb, gr in zip(a, b, _grads(a, g)):
            pa.grad, pb.grad = gr.clone(), gr.clone()
        oa.step()
        ob.step()
    ob.raise_if_nonfinite()  # nothing pending
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("method", ["racs", "alice", "alice0"])
@pytest.mark.parametrize("bad_index", [0, 6])  # a method matrix, an Adam-group vector
def test_deferred_nan_step_changes_nothing_and_is_raised_later(method, bad_index):
    _, b, _, ob = _pair(method)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, gr in zip(b, _grads(b, g)):
            p.grad = gr
        ob.step()
    before = [p.detach().clone() for p in b]
    state = copy.deepcopy(ob.state_dict())
    for p, gr in zip(b, _grads(b, g, bad_index)):
        p.grad = gr
    ob.step()  # no read, no raise: the step is gated on the device flag
    assert all(torch.equal(x, p) for x, p in zip(before, b))
    for i, st in ob.state_dict()["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                assert torch.equal(value, state["state"][i][key]), (i, key)
    assert bool(ob.nonfinite_pending)
    with pytest.raises(NonFiniteError, match="deferred"):
        ob.raise_if_nonfinite()
    assert ob.nonfinite_pending is None
    ob.raise_if_nonfinite()  # cleared


def test_training_algorithm_raises_the_deferred_flag_with_its_loss_read():
    from curvopt.objective import Objective
    from curvopt.training.algorithm import TorchOptimizerAlgorithm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = build_optimizer(model, "racs", lr=0.02, foreach=True, check_finite="deferred")
    algo = TorchOptimizerAlgorithm(Objective(model, "squared_error"), opt)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    assert isinstance(algo.step((x, y))["loss"], float)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError):
        algo.step((x, torch.full_like(y, float("nan"))))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("method", ["racs", "alice"])
def test_state_banks_are_slices_and_survive_deepcopy_and_reload(method):
    a, _, oa, _ = _pair(method)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, gr in zip(a, _grads(a, g)):
            p.grad = gr
        oa.step()
    mats = [p for p in a if p.dim() == 2]
    key = "s" if method == "racs" else "U"
    views = [oa.state[p][key] for p in mats]
    assert all(v._base is not None for v in views)  # slices of a bank
    assert len({v.untyped_storage().data_ptr() for v in views}) == 3  # one bank per shape
    assert optimizer_state_bytes(oa) == sum(
        t.numel() * t.element_size() for st in oa.state.values() for t in st.values() if torch.is_tensor(t)
    )
    # a deepcopy and a state-dict reload both go on exactly as the original
    copied = copy.deepcopy(oa)
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    reloaded = _make(
        method,
        [
            {"params": [p for p in c if p.dim() == 2]},
            {"params": [p for p in c if p.dim() != 2], "adam": True},
        ],
        foreach=True,
        weight_decay=0.1,
    )
    reloaded.load_state_dict(copy.deepcopy(oa.state_dict()))
    d = [p for group in copied.param_groups for p in group["params"]]
    order = [p for group in oa.param_groups for p in group["params"]]
    c_order = [p for group in reloaded.param_groups for p in group["params"]]
    grads = _grads(order, g)
    for ps, opt in ((order, oa), (d, copied), (c_order, reloaded)):
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
    for p, q, r in zip(order, d, c_order):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
        torch.testing.assert_close(r, p, rtol=0, atol=0)


def test_canonical_signs_without_a_mask_write():
    U = torch.tensor([[0.0, -2.0, 1.0], [0.0, 1.0, -3.0]])
    out = canonical_signs(U)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, -1.0], [0.0, -1.0, 3.0]]))
    with DispatchCounter() as counter:
        canonical_signs(torch.randn(5, 3))
    assert counter.host_reads == 0


def test_bad_check_finite_value_is_named():
    with pytest.raises(ValueError, match="check_finite"):
        RACS([torch.nn.Parameter(torch.zeros(3, 4))], check_finite="sometimes")


def test_docs_example_runs_as_printed(capsys):
    """docs/lean_steps.md's loop with deferred checking runs as printed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "lean_steps.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    assert len(blocks) == 1
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(blocks[0], "docs/lean_steps.md", "exec"), namespace)  # noqa: S102
    assert len(namespace["losses"]) == 2
    assert "2 checks" in capsys.readouterr().out


def _compile_pair(method: str, steps: int = 4):
    """The same run eager and compiled (stacked both), with a scheduled lr that changes every step."""
    g = torch.Generator().manual_seed(4)
    a = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SMALL]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa = _make(method, a, foreach=True)
    ob = _make(method, b, compile=True)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda t: 1.0 / (1 + t))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda t: 1.0 / (1 + t))
    for t in range(steps):
        for pa, pb, gr in zip(a, b, _grads(a, g)):
            pa.grad, pb.grad = gr.clone(), gr.clone()
        oa.step()
        # from the third step on (Alice's first is the looped EVD start), a new lr must not recompile
        with dynamo_config.patch(error_on_recompile=t >= 2):
            ob.step()
        sa.step()
        sb.step()
    return a, b


@pytest.mark.parametrize("method", ["racs", "alice", "alice0"])
def test_compiled_update_is_one_graph_without_recompiles(method, monkeypatch):
    """compile=True: fullgraph capture, no recompilation when the lr changes, the eager numbers.
    (aot_eager here for speed; the inductor test below is slow-marked.)"""
    import functools

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    a, b = _compile_pair(method)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["racs", "alice"])
def test_compiled_update_with_inductor_matches_eager(method):
    torch._dynamo.reset()
    a, b = _compile_pair(method)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)


# -- on a real GPU (run with `pytest -m gpu`; skipped without CUDA) ---------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["racs", "alice", "alice0"])
def test_cuda_plain_steps_never_synchronise(method):
    """With torch.cuda.set_sync_debug_mode("error") any synchronising call raises: a plain step makes none."""
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SMALL]
    opt = _make(method, params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step (Alice: the EVD start) checks eagerly
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@cuda
def test_cuda_deferred_nan_step_changes_nothing():
    """NaN survives torch._foreach_norm(·, inf) on CUDA too: the deferred flag catches it."""
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SMALL]
    opt = RACS(params, lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    params[2].grad[1, 1] = float("nan")
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    with pytest.raises(NonFiniteError):
        opt.raise_if_nonfinite()
