"""The FOSI paper's L-BFGS baseline read as ``jaxopt.LBFGS`` runs it, one ``update`` per mini-batch.

A reading of decisions FOSI-X, next to the default (``torch.optim.LBFGS`` with ``max_iter=1``,
``conf/optimizer/lbfgs.yaml``). Two things differ from torch's and matter with mini-batches:

* **curvature pairs from one batch**: each step evaluates the batch's loss and gradient g at θ,
  searches along d = −H·g on that batch, and stores s = θ_new − θ and y = g(θ_new) − g(θ), both
  gradients of the same batch (torch pairs the gradients of two consecutive batches). As in
  jaxopt, ρ = 1/(sᵀy) is stored whatever its sign (0 when sᵀy = 0), and H₀ = γI with
  γ = sᵀy/yᵀy of the newest pair;
* **what a failed line search does** (``on_failure``): jaxopt's zoom line search takes a step that
  met the sufficient-decrease condition if it found one, else its last trial step ("unsafe step";
  ``last``) unless the loss there is not finite (then no step). ``best`` takes the trial point
  with the lowest loss, or no step, like torch.

The line search is Nocedal & Wright's strong-Wolfe search (Algorithms 3.5 and 3.6: bracketing by
doubling up to ``max_stepsize``, then zoom with cubic interpolation, bisection as the safeguard),
with jaxopt's defaults: at most ``maxls = 15`` evaluations, c₁ = 1e-4, c₂ = 0.9, and a first trial
of min(1.5 × the previous step size, 1). jaxopt's exact interpolation rules (and its
approximate-Wolfe switch near a minimum) are not reproduced.

It subclasses ``torch.optim.LBFGS`` only so that the training loop hands it the closure; the step
is this module's own. Written here rather than taken from a library: no PyTorch package runs
jaxopt's per-batch update, and only the behaviours above are under test.

Example:
    >>> import torch
    >>> x = torch.nn.Parameter(torch.tensor([3.0, -2.0], dtype=torch.float64))
    >>> opt = JaxoptLBFGS([x], history_size=5)
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = (torch.tensor([1.0, 10.0], dtype=torch.float64) * x * x).sum()
    ...     loss.backward()
    ...     return loss
    >>> for _ in range(10):
    ...     _ = opt.step(closure)
    >>> bool(x.detach().abs().max() < 1e-6)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

FAILURE_MODES = ("last", "best")
LINE_SEARCHES = ("zoom", "backtracking")
# the options kept as attributes: torch.optim.Optimizer.__getstate__ keeps only defaults, state and
# param_groups, so JaxoptLBFGS.__getstate__ adds these (a deepcopy or pickle kept none of them before)
OPTIONS = (
    "maxls",
    "c1",
    "c2",
    "increase_factor",
    "max_stepsize",
    "on_failure",
    "linesearch",
    "decrease_factor",
)
LR_REFUSED = (
    "JaxoptLBFGS: lr={} is not used: the line search chooses each step size (jaxopt.LBFGS has no "
    "learning rate); leave lr unset (or 1.0), and bound the step with max_stepsize"
)


class JaxoptLBFGS(torch.optim.LBFGS):
    """L-BFGS with one jaxopt-style update per call of :meth:`step` (module docstring).

    Args:
        params: Parameters (one group).
        history_size: Number of (s, y) pairs kept (L).
        maxls: Function evaluations the line search may make per step.
        c1: Sufficient-decrease constant.
        c2: Curvature constant (strong Wolfe).
        increase_factor: The first trial step is ``increase_factor`` × the previous step size.
        max_stepsize: Largest step size tried.
        on_failure: ``last`` (jaxopt: the last trial step when no step met sufficient decrease)
            or ``best`` (the lowest-loss trial point, or no step).
        linesearch: ``zoom`` (jaxopt's later default) or ``backtracking`` (its earlier L-BFGS:
            shrink by ``decrease_factor`` from 1.5 × the previous step, uncapped unless
            ``max_stepsize`` is finite).
        decrease_factor: The backtracking search's shrink factor.
        lr: Accepted only as 1.0 (torch.optim's name, so that a config naming it is read): the
            line search chooses each step size. Any other value is refused, here and at
            :meth:`step` when a scheduler or a hand edit changed the group's ``lr``.

    Raises:
        ValueError: A non-positive size or count, constants outside 0 < c1 < c2 < 1, an unknown
            ``on_failure``, or an ``lr`` other than 1.0.

    A deep copy or a pickle carries the options (:data:`OPTIONS`) and the curvature pairs, and
    continues as the original would.

    Example:
        The closure evaluates one batch; each ``step`` is one update on it (here a quadratic):

        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([3.0, -2.0]))
        >>> opt = JaxoptLBFGS([w], history_size=5)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = (w**2).sum()
        ...     loss.backward()
        ...     return loss.detach()
        >>> for _ in range(5):
        ...     _ = opt.step(closure)
        >>> float((w.detach() ** 2).sum()) < 1e-8
        True
    """

    def __init__(
        self,
        params: Any,
        history_size: int = 10,
        maxls: int = 15,
        c1: float = 1e-4,
        c2: float = 0.9,
        increase_factor: float = 1.5,
        max_stepsize: float = 1.0,
        on_failure: str = "last",
        linesearch: str = "zoom",
        decrease_factor: float = 0.8,
        lr: float | Tensor = 1.0,
    ) -> None:
        _check_lr(lr)
        if history_size < 1 or maxls < 1:
            raise ValueError(f"history_size and maxls must be >= 1, got {history_size}, {maxls}")
        if not 0.0 < c1 < c2 < 1.0:
            raise ValueError(f"need 0 < c1 < c2 < 1, got c1={c1}, c2={c2}")
        if not (increase_factor > 0.0 and max_stepsize > 0.0):
            raise ValueError("increase_factor and max_stepsize must be positive")
        if on_failure not in FAILURE_MODES:
            raise ValueError(f"on_failure must be one of {FAILURE_MODES}, got {on_failure!r}")
        if linesearch not in LINE_SEARCHES:
            raise ValueError(f"linesearch must be one of {LINE_SEARCHES}, got {linesearch!r}")
        if not 0.0 < decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must lie in (0, 1), got {decrease_factor}")
        super().__init__(params, lr=1.0, max_iter=1, history_size=history_size)
        self.maxls, self.c1, self.c2 = int(maxls), float(c1), float(c2)
        self.increase_factor, self.max_stepsize = float(increase_factor), float(max_stepsize)
        self.on_failure = on_failure
        self.linesearch, self.decrease_factor = linesearch, float(decrease_factor)

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's state (defaults, state, param_groups) and this class's options."""
        state = super().__getstate__()
        state.update({k: getattr(self, k) for k in OPTIONS})
        return state

    # -- flat views ---------------------------------------------------------------------------------
    def _params_list(self) -> list[Tensor]:
        return self.param_groups[0]["params"]

    def _flat_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params_list()])

    def _set_flat(self, flat: Tensor) -> None:
        offset = 0
        for p in self._params_list():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    def _flat_grad(self) -> Tensor:
        return torch.cat(
            [
                (p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1))
                for p in self._params_list()
            ]
        )

    def _evaluate(self, closure: Callable[[], Tensor], x: Tensor) -> tuple[float, Tensor]:
        self._set_flat(x)
        with torch.enable_grad():
            loss = closure()
        return float(loss), self._flat_grad().clone()

    # -- the two-loop recursion ---------------------------------------------------------------------
    def _direction(self, g: Tensor, state: dict[str, Any]) -> Tensor:
        s_hist, y_hist, rho_hist = state["s"], state["y"], state["rho"]
        q = g.clone()
        alphas = []
        for s, y, rho in zip(reversed(s_hist), reversed(y_hist), reversed(rho_hist)):
            a = rho * float(s @ q)
            alphas.append(a)
            q.add_(y, alpha=-a)
        if s_hist:
            yy = float(y_hist[-1] @ y_hist[-1])
            gamma = float(s_hist[-1] @ y_hist[-1]) / yy if yy > 0.0 else 1.0
            q.mul_(gamma)
        for s, y, rho, a in zip(s_hist, y_hist, rho_hist, reversed(alphas)):
            b = rho * float(y @ q)
            q.add_(s, alpha=a - b)
        return q.neg_()

    # -- the line search ----------------------------------------------------------------------------
    def _line_search(
        self, phi: Callable[[float], tuple[float, float, Tensor]], f0: float, d0: float, t_init: float
    ) -> tuple[float, float, Tensor | None, bool]:
        """Strong-Wolfe search along the direction: ``(t, f(t), grad(t), met)``.

        ``phi(t)`` returns the loss, the directional derivative and the gradient at θ + t·d;
        ``d0 < 0`` is the slope at 0. When no point meets both conditions within ``maxls``
        evaluations, the step follows ``on_failure``; ``grad`` is ``None`` for t = 0.
        """
        tried: list[tuple[float, float, float, Tensor]] = []

        def ev(t: float) -> tuple[float, float, Tensor]:
            f, dphi, g = phi(t)
            tried.append((t, f, dphi, g))
            return f, dphi, g

        def zoom(lo: tuple[float, float, float], hi: tuple[float, float, float]) -> bool:
            while len(tried) < self.maxls:
                (t_lo, f_lo, d_lo), (t_hi, f_hi, d_hi) = lo, hi
                t = _cubic_min(t_lo, f_lo, d_lo, t_hi, f_hi, d_hi)
                a, b = min(t_lo, t_hi), max(t_lo, t_hi)
                if not (math.isfinite(t) and a + 0.1 * (b - a) <= t <= b - 0.1 * (b - a)):
                    t = 0.5 * (a + b)
                f, dphi, _ = ev(t)
                if not math.isfinite(f) or f > f0 + self.c1 * t * d0 or f >= f_lo:
                    hi = (t, f, dphi)
                else:
                    if abs(dphi) <= -self.c2 * d0:
                        return True
                    if dphi * (t_hi - t_lo) >= 0:
                        hi = lo
                    lo = (t, f, dphi)
            return False

        prev = (0.0, f0, d0)
        t = t_init
        met = False
        while len(tried) < self.maxls:
            f, dphi, _ = ev(t)
            if not math.isfinite(f) or f > f0 + self.c1 * t * d0 or (len(tried) > 1 and f >= prev[1]):
                met = zoom(prev, (t, f, dphi))
                break
            if abs(dphi) <= -self.c2 * d0:
                met = True
                break
            if dphi >= 0:
                met = zoom((t, f, dphi), prev)
                break
            if t >= self.max_stepsize:  # no interval below the largest step: take it (jaxopt)
                met = True
                break
            prev = (t, f, dphi)
            t = min(2.0 * t, self.max_stepsize)
        if met:  # the last point evaluated is the one that met both conditions
            t, f, _, g = tried[-1]
            return t, f, g, True
        if self.on_failure == "last":
            safe = [x for x in tried if math.isfinite(x[1]) and x[1] <= f0 + self.c1 * x[0] * d0]
            if safe:  # jaxopt's safe step: the largest step with sufficient decrease
                t, f, _, g = max(safe, key=lambda x: x[0])
                return t, f, g, False
            if tried and math.isfinite(tried[-1][1]):  # jaxopt's unsafe step
                t, f, _, g = tried[-1]
                return t, f, g, False
            return 0.0, f0, None, False
        lower = [x for x in tried if math.isfinite(x[1]) and x[1] < f0]
        if not lower:
            return 0.0, f0, None, False
        t, f, _, g = min(lower, key=lambda x: x[1])
        return t, f, g, False

    def _backtracking(
        self, phi: Callable[[float], tuple[float, float, Tensor]], f0: float, d0: float, t_init: float
    ) -> tuple[float, float, Tensor | None, bool]:
        """jaxopt's earlier L-BFGS search: t_init, then × ``decrease_factor`` until the strong
        Wolfe conditions hold, at most ``maxls`` evaluations; no cap on t_init (the previous step
        × ``increase_factor``). On failure: the last trial point (``last``) or the best (``best``)."""
        tried: list[tuple[float, float, Tensor]] = []
        t = t_init
        for _ in range(self.maxls):
            f, dphi, g = phi(t)
            tried.append((t, f, g))
            if math.isfinite(f) and f <= f0 + self.c1 * t * d0 and abs(dphi) <= self.c2 * abs(d0):
                return t, f, g, True
            t *= self.decrease_factor
        if self.on_failure == "last" and math.isfinite(tried[-1][1]):
            t, f, g = tried[-1]
            return t, f, g, False
        lower = [x for x in tried if math.isfinite(x[1]) and x[1] < f0]
        if not lower:
            return 0.0, f0, None, False
        t, f, g = min(lower, key=lambda x: x[1])
        return t, f, g, False

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        """One L-BFGS update on the closure's batch.

        Args:
            closure: Re-evaluates the loss on the current batch and fills ``.grad``.

        Returns:
            The loss at the parameters the step started from.
        """
        _check_lr(self.param_groups[0]["lr"])  # an lr scheduler would otherwise be ignored silently
        state = self.state[self._params_list()[0]]  # where torch.optim.LBFGS keeps its state
        state.setdefault("s", [])
        state.setdefault("y", [])
        state.setdefault("rho", [])
        state.setdefault("stepsize", 1.0)
        x0 = self._flat_params()
        with torch.enable_grad():
            loss = closure()
        f0, g0 = float(loss), self._flat_grad().clone()
        d = self._direction(g0, state)
        slope = float(g0 @ d)

        def phi(t: float) -> tuple[float, float, Tensor]:
            f, g = self._evaluate(closure, x0 + t * d)
            return f, float(g @ d), g

        t_init = min(state["stepsize"] * self.increase_factor, self.max_stepsize)
        # with sᵀy < 0 in the history, d may not descend (slope >= 0): jaxopt searches anyway, and
        # the curvature condition can then never hold, so the step is a safe or an unsafe one
        search = self._line_search if self.linesearch == "zoom" else self._backtracking
        t, _, g_new, met = search(phi, f0, slope, t_init)
        self._set_flat(x0 + t * d)
        state["met"] = met
        state["t"], state["d"] = t, d  # the step taken, where torch's LBFGS keeps it (logged)
        state["stepsize"] = t if t > 0 else state["stepsize"]
        if g_new is not None and t > 0:
            s, y = t * d, g_new - g0
            sy = float(s @ y)
            state["s"].append(s)
            state["y"].append(y)
            state["rho"].append(0.0 if sy == 0.0 else 1.0 / sy)
            if len(state["s"]) > self.param_groups[0]["history_size"]:
                for key in ("s", "y", "rho"):
                    state[key].pop(0)
        return loss


def _check_lr(lr: float | Tensor) -> None:
    """Refuse an lr other than 1.0 (a number or a one-element tensor), by name."""
    try:
        value = float(lr)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(LR_REFUSED.format(repr(lr))) from None
    if value != 1.0:
        raise ValueError(LR_REFUSED.format(repr(lr)))


def _cubic_min(t0: float, f0: float, d0: float, t1: float, f1: float, d1: float) -> float:
    """Minimiser of the cubic through (t0, f0, f0') and (t1, f1, f1') (N&W eq. 3.59); NaN if none."""
    if not all(math.isfinite(v) for v in (t0, f0, d0, t1, f1, d1)) or t0 == t1:
        return math.nan
    e1 = d0 + d1 - 3.0 * (f0 - f1) / (t0 - t1)
    disc = e1 * e1 - d0 * d1
    if disc < 0:
        return math.nan
    e2 = math.copysign(math.sqrt(disc), t1 - t0)
    denom = d1 - d0 + 2.0 * e2
    if denom == 0:
        return math.nan
    return t1 - (t1 - t0) * (d1 + e2 - e1) / denom


def reading_overrides(history: int, on_failure: str, linesearch: str = "zoom") -> list[str]:
    """Hydra overrides that turn ``optimizer=lbfgs`` into this reading.

    Args:
        history: L.
        on_failure: ``last`` or ``best``.
        linesearch: ``zoom`` (step sizes up to 1) or ``backtracking`` (uncapped).

    Returns:
        The overrides (torch-only keys removed, the target and the options set).
    """
    removed = ("lr", "max_iter", "max_eval", "line_search_fn", "tolerance_grad", "tolerance_change")
    return [
        "optimizer=lbfgs",
        f"optimizer._target_={__name__}.JaxoptLBFGS",
        *(f"~optimizer.{k}" for k in removed),
        f"optimizer.history_size={history}",
        f"+optimizer.on_failure={on_failure}",
        f"+optimizer.linesearch={linesearch}",
        *(["+optimizer.max_stepsize=inf"] if linesearch == "backtracking" else []),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the reading on a FOSI task, in this process (``experiments`` must be importable, so it
    runs as ``python -m`` from the checkout, not through ``src/train.py``).

        python -m experiments.fosi_tasks.lbfgs_jaxopt --task ae --profile paper --history 10 \\
            --results-dir results/fosi_audit -- trainer.max_steps=880 trainer.eval_every=176

    Args:
        argv: Arguments (default: ``sys.argv[1:]``); Hydra overrides after ``--``.

    Returns:
        The run's exit code.
    """
    import argparse

    from curvopt.errors import exit_code
    from curvopt.training.build import run_from_config
    from experiments.runs import compose_config

    parser = argparse.ArgumentParser(prog="python -m experiments.fosi_tasks.lbfgs_jaxopt")
    parser.add_argument("--task", default="ae", choices=["lr", "ae", "lm", "tl", "ac"])
    parser.add_argument("--profile", default="quick", choices=["quick", "paper"])
    parser.add_argument("--history", type=int, default=10)
    parser.add_argument("--on-failure", default="last", choices=FAILURE_MODES)
    parser.add_argument("--linesearch", default="zoom", choices=LINE_SEARCHES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", default="results/fosi_audit")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args(argv)
    experiment = f"fosi_{args.task}" + ("_paper" if args.profile == "paper" else "")
    search = "" if args.linesearch == "zoom" else f"_{args.linesearch}"
    run_id = f"lbfgs_jaxopt_{args.on_failure}{search}_{args.profile}_s{args.seed}_L{args.history}"
    cfg = compose_config(
        [
            f"experiment={experiment}",
            *reading_overrides(args.history, args.on_failure, args.linesearch),
            f"seed={args.seed}",
            f"run_id={run_id}",
            f"paths.results_dir={args.results_dir}",
            "logger=none",
            "trainer.clock=process",
            "trainer.num_threads=1",
            *args.overrides,
        ]
    )
    return exit_code(run_from_config(cfg))


if __name__ == "__main__":
    import sys

    sys.exit(main())
