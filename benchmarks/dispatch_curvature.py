"""Dispatched ops, views, kernels and host reads of one FGN / SGN / K-FAC / FOSI step (issue 41).

    python -m benchmarks.dispatch_curvature            # prints the rows as JSON
    python -m benchmarks.dispatch_curvature --out F    # and writes them to F

Each row counts one *plain* step of a representative CPU problem with
:class:`~curvopt.profiling.DispatchCounter` (the counts do not depend on the device): FGN and SGN on
a linear softmax head at C = 1024 (and FGN's generic path on a small MLP), K-FAC on a small MLP
between two inversions, FOSI-HB and FOSI-Adam on a small MLP between two ESEs. Warm-up steps
(the first, which builds state; the ESE or inversion steps) run before the counted step.

``host_reads`` adds the ``Tensor.tolist()`` calls made during the step to the counter's host reads:
``tolist`` of a CPU tensor dispatches no op, so the counter cannot see it, yet on a GPU it is a
device-to-host copy the host waits for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from curvopt.objective import Objective
from curvopt.profiling import DispatchCounter

__all__ = ["count_step", "curvature_rows"]


@contextlib.contextmanager
def _count_tolist() -> Iterator[list[int]]:
    """Count ``Tensor.tolist()`` calls inside the block (a host read the counter cannot see)."""
    calls = [0]
    original = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        calls[0] += 1
        return original(self)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def count_step(name: str, setup: str, step: Callable[[], Any]) -> dict[str, Any]:
    """Count one call of ``step`` (already warmed up) and return a benchmark row.

    Args:
        name: The row's name.
        setup: A short description of the problem (shapes).
        step: The step to count, without arguments.

    Returns:
        ``{"name", "setup", "ops", "views", "kernels", "allocations", "host_reads"}``.
    """
    with _count_tolist() as tolist_calls, DispatchCounter() as counter:
        step()
    row = {"name": name, "setup": setup, **counter.summary()}
    row["host_reads"] = counter.host_reads + tolist_calls[0]
    return row


def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def _fgn_affine_row() -> dict[str, Any]:
    from curvopt.optim.fgn import FGN

    b, d, c = 64, 256, 1024
    torch.manual_seed(0)
    model = nn.Linear(d, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = FGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0)
    alg.step((x, y))
    return count_step(
        "FGN (closed form)", f"linear head D={d}, C={c}, batch {b}, 5 CG its", lambda: alg.step((x, y))
    )


def _fgn_generic_row() -> dict[str, Any]:
    from curvopt.optim.fgn import FGN

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = FGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0)
    alg.step((x, y))
    return count_step(
        "FGN (generic)", f"MLP {d}-{h}-{c} (tanh), batch {b}, 5 CG its", lambda: alg.step((x, y))
    )


def _sgn_row() -> dict[str, Any]:
    from curvopt.optim.sgn import SGN

    b, d, c = 64, 256, 1024
    torch.manual_seed(0)
    model = nn.Linear(d, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = SGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0)
    alg.step((x, y))
    return count_step("SGN", f"linear head D={d}, C={c}, batch {b}, 5 CG its", lambda: alg.step((x, y)))


def _kfac_row() -> dict[str, Any]:
    from curvopt.optim.kfac import KFAC

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    alg = KFAC(Objective(model, "cross_entropy"))  # adaptive lr and momentum, inversions every 5
    alg.step((x, y))  # step 0: first inversion
    alg.step((x, y))  # step 1: velocity exists
    return count_step(
        "K-FAC",
        f"MLP {d}-{h}-{c} (tanh), batch {b}, adaptive lr/momentum, step 2 (between inversions)",
        lambda: alg.step((x, y)),
    )


def _fosi_row(base: str) -> dict[str, Any]:
    from curvopt.optim.fosi import fosi_adam, fosi_heavy_ball

    b, d, h, c = 64, 32, 64, 10
    torch.manual_seed(0)
    model = _mlp(d, h, c)
    x, y = torch.randn(b, d), torch.randint(0, c, (b,))
    loss_fn = nn.functional.cross_entropy
    build = fosi_heavy_ball if base == "heavy_ball" else fosi_adam
    lr = 0.01 if base == "heavy_ball" else 1e-3
    opt = build(model.parameters(), loss_fn, (x, y), lr=lr, model=model, k=10, ese_period=100)
    opt.ese_warmup = 1  # ESE before step 1

    def grads() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()

    for _ in range(3):  # step 0: base only; step 1: ESE + update; step 2: plain
        grads()
        opt.step()
    grads()
    name = "FOSI-HB" if base == "heavy_ball" else "FOSI-Adam"
    return count_step(
        name, f"MLP {d}-{h}-{c} (tanh), k=10, optimizer step between ESEs (gradients given)", opt.step
    )


def curvature_rows() -> list[dict[str, Any]]:
    """One row per FGN / SGN / K-FAC / FOSI-HB / FOSI-Adam step (see the module docstring).

    Returns:
        Rows with keys ``name``, ``setup``, ``ops``, ``views``, ``kernels``, ``allocations`` and
        ``host_reads``.
    """
    return [
        _fgn_affine_row(),
        _fgn_generic_row(),
        _sgn_row(),
        _kfac_row(),
        _fosi_row("heavy_ball"),
        _fosi_row("adam"),
    ]


def main() -> None:
    """Print the rows (and write them with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = curvature_rows()
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
