"""Dispatched ops, views, kernels and host reads of one FGN / SGN / K-FAC / FOSI step (issue 41).

    python -m benchmarks.dispatch_curvature            # prints the rows as JSON
    python -m benchmarks.dispatch_curvature --out F    # and writes them to F

Each row counts one *plain* step of a representative CPU problem with
:class:`~curvopt.profiling.DispatchCounter` (the counts do not depend on the device): FGN and SGN on
a linear softmax head at C = 1024 (and FGN's generic path on a small MLP), K-FAC on a small MLP
between two inversions, FOSI-HB and FOSI-Adam on a small MLP between two ESEs (the bases the training
loop builds: ``make_base_optimizer``, fused Adam). Warm-up steps (the first, which builds state; the
ESE or inversion steps) run before the counted step.

FGN and SGN are built with the settings their ``"auto"`` switches take on a GPU
(``cg_early_exit=False``, ``check_finite="deferred"``, FGN's ``gram_blocks=1``), and every method
with ``host_stats`` as given (``True``, the training loop's: the logged scalars are read once at the
end of the step). Options a method does not have are left out, so the same script measures an older
version of the code: ``benchmarks/dispatch_curvature_before.json`` is the code before issue 41 with
``--defaults`` (what it ran on a GPU: CG's early exit, eager checks, ``gram_blocks=1``).

``host_reads`` adds the ``Tensor.tolist()`` calls made during the step to the counter's host reads:
``tolist`` of a CPU tensor dispatches no op, so the counter cannot see it, yet on a GPU it is a
device-to-host copy the host waits for.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from curvopt.objective import Objective
from curvopt.profiling import DispatchCounter

__all__ = ["count_step", "curvature_rows"]


def count_step(name: str, setup: str, step: Callable[[], Any]) -> dict[str, Any]:
    """Count one call of ``step`` (already warmed up) and return a benchmark row.

    Args:
        name: The row's name.
        setup: A short description of the problem (shapes).
        step: The step to count, without arguments.

    Returns:
        ``{"name", "setup", "ops", "views", "kernels", "allocations", "host_reads"}``.
    """
    with DispatchCounter() as counter:  # Tensor.tolist() calls count as host reads
        step()
    return {"name": name, "setup": setup, **counter.summary()}


def _build(cls: Any, *args: Any, **options: Any) -> Any:
    """``cls(*args, **options)`` without the options ``cls`` does not take (an older version)."""
    accepted = inspect.signature(cls).parameters
    return cls(*args, **{k: v for k, v in options.items() if k in accepted})


def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


# FGN's and SGN's "auto" settings on a GPU: gram_blocks=1 before issue 41 as well, the others new
GPU_DEFAULTS = {"gram_blocks": 1}
GPU = {**GPU_DEFAULTS, "cg_early_exit": False, "check_finite": "deferred"}
_SETTINGS: dict[str, Any] = dict(GPU)  # what the FGN/SGN rows are built with (see curvature_rows)


def _fgn_affine_row(host_stats: bool) -> dict[str, Any]:
    from curvopt.optim.fgn import FGN

    b, d, c = 64, 256, 1024
    torch.manual_seed(0)
    model = nn.Linear(d, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = _build(
        FGN, Objective(model, "cross_entropy"), lr=0.1, damping=1.0, host_stats=host_stats, **_SETTINGS
    )
    alg.step((x, y))
    return count_step(
        "FGN (closed form)", f"linear head D={d}, C={c}, batch {b}, cg_maxiter 5", lambda: alg.step((x, y))
    )


def _fgn_generic_row(host_stats: bool) -> dict[str, Any]:
    from curvopt.optim.fgn import FGN

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = _build(
        FGN, Objective(model, "cross_entropy"), lr=0.1, damping=1.0, host_stats=host_stats, **_SETTINGS
    )
    alg.step((x, y))
    return count_step(
        "FGN (generic)", f"MLP {d}-{h}-{c} (tanh), batch {b}, cg_maxiter 5", lambda: alg.step((x, y))
    )


def _sgn_row(host_stats: bool) -> dict[str, Any]:
    from curvopt.optim.sgn import SGN

    b, d, c = 64, 256, 1024
    torch.manual_seed(0)
    model = nn.Linear(d, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = _build(
        SGN, Objective(model, "cross_entropy"), lr=0.1, damping=1.0, host_stats=host_stats, **_SETTINGS
    )
    alg.step((x, y))
    return count_step("SGN", f"linear head D={d}, C={c}, batch {b}, cg_maxiter 5", lambda: alg.step((x, y)))


def _kfac_row(host_stats: bool) -> dict[str, Any]:
    from curvopt.optim.kfac import KFAC

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    # adaptive lr and momentum, inversions every 5 steps
    alg = _build(KFAC, Objective(model, "cross_entropy"), host_stats=host_stats)
    alg.step((x, y))  # step 0: first inversion
    alg.step((x, y))  # step 1: velocity exists
    return count_step(
        "K-FAC",
        f"MLP {d}-{h}-{c} (tanh), batch {b}, adaptive lr/momentum, step 2 (between inversions)",
        lambda: alg.step((x, y)),
    )


def _fosi_row(base: str) -> dict[str, Any]:
    from curvopt.optim.fosi import FOSI, make_base_optimizer

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    loss_fn = nn.functional.cross_entropy
    lr = 0.01 if base == "heavy_ball" else 1e-3
    base_opt = make_base_optimizer(base, model.parameters(), lr=lr)  # Adam: fused, as the loop builds it
    opt = FOSI(base_opt, loss_fn, (x, y), model=model, k=10, ese_period=100)
    opt.ese_warmup = 1  # ESE before step 1

    def grads() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()

    for _ in range(3):  # step 0: base only; step 1: ESE + update; step 2: plain
        grads()
        opt.step()
    grads()
    name = "FOSI-HB" if base == "heavy_ball" else "FOSI-Adam"
    kind = "SGD(momentum=0.9)" if base == "heavy_ball" else "fused Adam"
    return count_step(
        name, f"MLP {d}-{h}-{c} (tanh), {kind}, k=10, optimizer step between ESEs (gradients given)", opt.step
    )


def curvature_rows(host_stats: bool = True, gpu_settings: bool = True) -> list[dict[str, Any]]:
    """One row per FGN / SGN / K-FAC / FOSI-HB / FOSI-Adam step (see the module docstring).

    Args:
        host_stats: FGN's, SGN's and K-FAC's ``host_stats``: ``True`` (the training loop's) reads
            the logged scalars once at the end of the step; ``False`` leaves them on the device.
        gpu_settings: Build FGN and SGN with the settings their ``"auto"`` switches take on a GPU
            (:data:`GPU`); ``False``: with their constructor defaults except FGN's ``gram_blocks=1``
            (:data:`GPU_DEFAULTS`: what ran on a GPU before issue 41).

    Returns:
        Rows with keys ``name``, ``setup``, ``ops``, ``views``, ``kernels``, ``allocations`` and
        ``host_reads``.
    """
    _SETTINGS.clear()
    _SETTINGS.update(GPU if gpu_settings else GPU_DEFAULTS)
    return [
        _fgn_affine_row(host_stats),
        _fgn_generic_row(host_stats),
        _sgn_row(host_stats),
        _kfac_row(host_stats),
        _fosi_row("heavy_ball"),
        _fosi_row("adam"),
    ]


def main() -> None:
    """Print the rows (and write them with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device-stats", action="store_true", help="host_stats=False (no stats read)")
    parser.add_argument("--defaults", action="store_true", help="FGN/SGN with their constructor defaults")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = curvature_rows(host_stats=not args.device_stats, gpu_settings=not args.defaults)
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
