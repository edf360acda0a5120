"""Dispatch budget of the curvature solvers (issue 41, item 4): what one iteration asks of a GPU.

Counted on the CPU with :class:`curvopt.profiling.DispatchCounter` (plus ``Tensor.tolist`` calls,
which dispatch no op on a CPU tensor but are a host read on a GPU): a solve of ``k + 1``
iterations minus a solve of ``k``. Budgets: at most one host read per CG and per LSMR iteration,
and at most 110 dispatched ops per SHF LSMR iteration at the MNIST autoencoder's shapes (op counts
do not depend on the batch size, so a small batch keeps this fast). The code before the issue made
4 reads per CG iteration, 2 per LSMR iteration and 259 ops per LSMR iteration.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.dispatch_solvers import count, hfcg_rows, shf_rows
from curvopt.curvature.cg import cg, martens_cg
from curvopt.curvature.lsmr import lsmr


def _spd(
    dim: int = 40, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    a = (q @ q.T / dim + 0.1 * torch.eye(dim, dtype=torch.float64)).to(dtype)
    b = torch.randn(dim, generator=gen, dtype=dtype)
    diag = torch.diagonal(a).clone()
    return a, b, diag


def _per_iteration(solve, k: int) -> dict[str, int]:
    solve(k)  # warm-up
    first, second = count(lambda: solve(k)), count(lambda: solve(k + 1))
    return {key: second[key] - first[key] for key in first}


@pytest.mark.parametrize("precond", [False, True])
def test_martens_cg_reads_the_host_once_per_iteration(precond):
    a, b, diag = _spd()

    def solve(iters):
        res = martens_cg(
            lambda v: a @ v, b, x0=0.1 * b, precond=diag if precond else None, maxiter=iters, miniter=10**6
        )
        assert res.iterations == iters and res.stop_reason == "maxiter"
        return res

    assert _per_iteration(solve, 6)["host_reads"] == 1


@pytest.mark.parametrize("dot_dtype", [torch.float64, None])
@pytest.mark.parametrize("precond", [False, True])
def test_cg_reads_the_host_once_per_iteration(precond, dot_dtype):
    a, b, diag = _spd()

    def solve(iters):
        res = cg(
            lambda v: a @ v, b, precond=diag if precond else None, tol=0.0, maxiter=iters, dot_dtype=dot_dtype
        )
        assert res.iterations == iters and res.stop_reason == "maxiter"
        return res

    assert _per_iteration(solve, 4)["host_reads"] == 1


@pytest.mark.parametrize("with_x0", [False, True])
def test_lsmr_scipy_stopping_reads_the_host_once_per_iteration(with_x0):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(60, 30, generator=gen, dtype=torch.float64)
    b = torch.randn(60, generator=gen, dtype=torch.float64)
    x0 = 0.1 * torch.randn(30, generator=gen, dtype=torch.float64) if with_x0 else None

    def solve(iters):
        res = lsmr(a, b, damp=0.5, atol=0.0, btol=0.0, conlim=0.0, maxiter=iters, x0=x0)
        assert res.itn == iters and res.stop_reason == "maxiter"
        return res

    assert _per_iteration(solve, 4)["host_reads"] == 1


def test_mnist_autoencoder_solver_iterations_meet_the_budget():
    """HF-CG's CG and SHF's LSMR on the 784-1000-500-250-30 autoencoder (real solver paths)."""
    cg_iter, cg_solve = hfcg_rows(8, solve_iters=6)
    lsmr_iter, lsmr_solve = shf_rows(8, solve_iters=6, num_val=16)
    assert cg_iter["name"] == "hf_cg CG iteration" and lsmr_iter["name"] == "shf LSMR iteration"
    assert cg_iter["host_reads"] <= 1, cg_iter
    assert lsmr_iter["host_reads"] <= 1, lsmr_iter
    assert lsmr_iter["ops"] <= 110, lsmr_iter
    assert cg_iter["ops"] <= 110, cg_iter  # 162 before issue 41
    assert lsmr_iter["views"] == 0 and cg_iter["views"] == 0  # per-layer views built once per solve
    # a whole solve: at most a few reads on top of one per iteration
    assert cg_solve["host_reads"] <= cg_solve["iterations"] + 4, cg_solve
    assert lsmr_solve["host_reads"] <= lsmr_solve["iterations"] + 8, lsmr_solve
    for row in (cg_iter, cg_solve, lsmr_iter, lsmr_solve):
        assert set(row) == {"name", "n", "ops", "views", "kernels", "host_reads", "iterations", "flops"}
        assert row["n"] == 8 and row["flops"] > 0


@pytest.mark.parametrize("method", ["shf", "hf_cg"])
def test_sync_timers_synchronises_each_phase_timer_on_cuda_only(method, monkeypatch):
    """``sync_timers``: off or on a CPU nothing synchronises; on CUDA every phase timer does."""
    from curvopt.api import DataBundle
    from curvopt.models.mlp import autoencoder
    from curvopt.objective import Objective
    from curvopt.optim.hf_cg import HFCG
    from curvopt.optim.shf import SHF

    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 12, generator=gen, dtype=torch.float64)

    def build(sync: bool):
        torch.manual_seed(0)
        if method == "shf":
            obj = Objective(autoencoder([12, 8, 3]).double(), "squared_error")
            return SHF(
                obj,
                DataBundle(train=(x, x), val=(x[:10], x[:10])),
                batch_size=20,
                maxiter=6,
                miniter=2,
                sync_timers=sync,
            )
        obj = Objective(
            autoencoder([12, 8, 3], code_activation=None, output_activation=None).double(), "sigmoid_bce"
        )
        return HFCG(obj, DataBundle(train=(x, x)), numchunks=2, cg_maxiter=6, sync_timers=sync)

    ref = build(False)
    out_ref = ref.step((x[:20], x[:20]))
    on = build(True)
    assert on._sync_device is None  # a CPU device: the flag changes nothing
    out_on = on.step((x[:20], x[:20]))
    assert calls == []
    drop = ("time",)
    assert {k: v for k, v in out_on.items() if not k.endswith(drop)} == {
        k: v for k, v in out_ref.items() if not k.endswith(drop)
    }
    on._sync_device = torch.device("cuda")  # as on a GPU: every timer synchronises
    out = on.step((x[:20], x[:20]))
    timers = [k for k in out if k.endswith("_time")]
    assert "precond_time" in timers and ("lsmr_time" in timers or "cg_time" in timers)
    assert len(calls) >= 2 * len(timers) - 2 and set(calls) == {torch.device("cuda")}
