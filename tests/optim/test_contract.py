"""One contract, run over every case of ``tests/cases.py`` as the training loop drives it (issue 29).

Modelled on optax's ``_common_test.py``: every optimizer of :mod:`curvopt.optim` and every
:class:`~curvopt.api.Algorithm` implementation of ``src/curvopt`` goes through the same clauses,
in the loop's protocol (:func:`cases.make_algorithm`: a ``torch.optim.Optimizer`` wrapped in
:class:`~curvopt.training.algorithm.TorchOptimizerAlgorithm`, as ``build_algorithm`` does):

* ``finite_step``: it is an ``Algorithm`` (the runtime protocol, the class the case names), one
  ``step(batch)`` reports a finite ``loss`` (the mean loss before the update, on the batch or, for
  HF-CG, on the training split: the case's ``reported_loss``) and leaves finite parameters;
* ``round_trip``: a checkpoint as the loop writes one (the model's and the algorithm's
  ``state_dict`` and the global RNG, through ``torch.save``/``torch.load``) after a few steps,
  loaded into a fresh instance in the loop's resume order, continues one step exactly as the
  original: the same parameters, the same reported scalars and the same next state;
* ``progress``: on a problem the tiny net can fit (:func:`cases.learnable_problem`), the case's
  steps bring the full-batch loss below a fraction of its start.

A clause a case cannot keep is in the case's ``skips`` (by design) or ``xfails`` (strict), with its
reason. What the conformance suite (``tests/optim/test_optim_conformance.py``) checks property by property
(closures, groups, schedulers, copies, dtypes, ``weights_only`` loads, …) is not repeated here; the
state-dict round trip both need is one helper, :func:`cases.round_trip`. The coverage tests at the end
fail when an export of ``curvopt.optim`` or an ``Algorithm`` class in ``src/curvopt`` has no case.
"""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import curvopt
import curvopt.optim as optim_pkg
from curvopt.api import Algorithm, DataBundle
from curvopt.objective import Objective
from tests.cases import (
    BY_NAME,
    CASES,
    CLAUSES,
    EXPORTS,
    PROPERTIES,
    Case,
    Twin,
    assert_same,
    full_loss,
    learnable_problem,
    make_algorithm,
    make_model,
    round_trip,
)

SRC = Path(curvopt.__file__).resolve().parent
BATCH = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (the file must stay fast on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -------------------------------------------------------------------------- driving a case
def params_for(clause: str) -> list[Any]:
    """``pytest.param(name)`` for every case; a case's strict xfail for ``clause`` as a mark."""
    out = []
    for case in CASES:
        marks = []
        if clause in case.xfails:
            marks.append(pytest.mark.xfail(reason=case.xfails[clause], strict=True))
        out.append(pytest.param(case.name, marks=marks, id=case.name))
    return out


def check(name: str, clause: str) -> Case:
    case = BY_NAME[name]
    if clause in case.skips:
        pytest.skip(case.skips[clause])
    if not case.available():
        pytest.skip(f"the official {case.upstream} package is not installed")
    return case


def problem(case: Case, seed: int = 0) -> tuple[Objective, DataBundle]:
    """The tiny net (from ``seed``) on the learnable problem of the case's loss."""
    return Objective(make_model(seed=seed), case.loss_kind), learnable_problem(case.loss_kind)


def draw(alg: Any, data: DataBundle, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``t``: as many rows as ``next_batch_size()`` asks for (else 16), cycling through the data."""
    x, y = data.train
    size = alg.next_batch_size() or BATCH
    rows = (t * size + torch.arange(size)) % x.shape[0]
    return x[rows], y[rows]


def step(alg: Any, data: DataBundle, t: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = alg.step(draw(alg, data, t))
    assert isinstance(out, dict), f"step returned {type(out).__name__}, not a dict of scalars"
    return out


def reported(out: dict[str, Any]) -> dict[str, Any]:
    """The scalars a step reports, without wall-clock timings (``*_time``, ``*_time_s``; NaN made comparable)."""
    return {
        k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items() if "time" not in k
    }


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Two state dicts hold the same values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {set(a)} vs {set(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same_state(u, v, f"{path}[{i}]")
        return
    if isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
        return
    if hasattr(a, "__dict__") and not isinstance(a, type):  # an object (upstream projectors)
        assert type(a) is type(b), path
        assert_same_state(vars(a), vars(b), f"{path}.__dict__")
        return
    assert a == b, f"{path}: {a!r} vs {b!r}"


def finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


# -------------------------------------------------------------------------- the clauses
@pytest.mark.parametrize("name", params_for("finite_step"))
def test_one_step_is_finite(name):
    case = check(name, "finite_step")
    objective, data = problem(case)
    alg = make_algorithm(case, objective, data)
    assert isinstance(alg, Algorithm), (
        "the loop's protocol: step, next_batch_size, state_dict, load_state_dict"
    )
    if case.algorithm is not None:
        assert type(alg).__name__ == case.algorithm
    # the loop hands the closure to torch.optim.LBFGS only: a case that needs one must be that path
    assert case.needs_closure == isinstance(getattr(alg, "optimizer", None), torch.optim.LBFGS)
    size = alg.next_batch_size()
    assert size is None or (isinstance(size, int) and size >= 1), f"next_batch_size() = {size!r}"
    x, y = draw(alg, data, 0) if case.reported_loss == "batch" else data.train
    before = full_loss(objective.model, (x, y), case.loss_kind)
    out = step(alg, data, 0)
    assert "loss" in out, f"step reported {sorted(out)}, no loss"
    assert math.isfinite(float(out["loss"])), f"reported loss {out['loss']}"
    assert finite(objective.model)
    # the loop logs it as the training loss: the mean loss before the update (case.reported_loss)
    assert float(out["loss"]) == pytest.approx(before, rel=1e-5)


@pytest.mark.parametrize("name", params_for("round_trip"))
def test_checkpoint_round_trip_continues_exactly(name):
    """k steps, a checkpoint as the loop writes it, a fresh instance resumed from it: one more step
    (same batch, same global RNG) gives the same parameters, reported scalars and next state."""
    case = check(name, "round_trip")
    algs: list[Any] = []

    def make(seed: int, weights: dict[str, Any] | None) -> Twin:
        objective, data = problem(case, seed)
        assert weights is None  # the loop builds first, then loads the model and the state
        alg = make_algorithm(case, objective, data)
        algs.append(alg)

        def one(t: int) -> dict[str, Any]:
            return {"batch_size": alg.next_batch_size(), **reported(step(alg, data, t))}

        return Twin(objective.model, one, alg.state_dict, alg.load_state_dict)

    a, b, out_a, out_b = round_trip(
        make, case.round_trip_steps, 1, weights_only=False, loop_order=True, same_rng=True
    )
    assert_same(a.model, b.model, case.round_trip_atol)
    if case.round_trip_atol == 0.0:
        assert out_a == out_b, "the resumed step reported other scalars"
        assert_same_state(algs[0].state_dict(), algs[1].state_dict())


@pytest.mark.parametrize("name", params_for("progress"))
def test_progress_on_a_learnable_problem(name):
    case = check(name, "progress")
    spec = case.progress
    objective, data = problem(case)
    alg = make_algorithm(case, objective, data, **spec.overrides)
    start = full_loss(objective.model, data.train, case.loss_kind)
    for t in range(spec.steps):
        step(alg, data, t)
    end = full_loss(objective.model, data.train, case.loss_kind)
    assert math.isfinite(end) and end < spec.fraction * start, (
        f"{spec.steps} steps: loss {start:.4g} -> {end:.4g} (need < {spec.fraction} x start)"
    )


# -------------------------------------------------------------------------- coverage of the list
def algorithm_classes(root: Path = SRC) -> dict[str, str]:
    """Every class under ``root`` (``src/curvopt``) that implements the loop's protocol, by name → file.

    Found without importing: subclasses of ``AlgorithmBase``/``Algorithm`` (transitively), and
    classes that define ``step(self, batch)`` with ``state_dict`` and ``load_state_dict``.
    """
    classes: dict[str, tuple[str, list[str], set[str], bool]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            st = methods.get("step")
            batch_step = st is not None and len(st.args.args) >= 2 and st.args.args[1].arg == "batch"
            classes[node.name] = (str(path.relative_to(root)), bases, set(methods), batch_step)
    found = {"Algorithm", "AlgorithmBase"}
    changed = True
    while changed:
        changed = False
        for name, (_, bases, methods, batch_step) in classes.items():
            if name in found:
                continue
            protocol = batch_step and {"state_dict", "load_state_dict"} <= methods
            if protocol or any(b in found for b in bases):
                found.add(name)
                changed = True
    return {n: classes[n][0] for n in sorted(found - {"Algorithm", "AlgorithmBase"})}


def test_cases_cover_every_export_and_every_algorithm():
    """A new optimizer (an export of curvopt.optim, or an Algorithm class in src/curvopt) needs a case."""
    assert set(EXPORTS) == set(optim_pkg.__all__), "tests/cases.py: one exported case per curvopt.optim name"
    found = algorithm_classes()
    assert {"SHF", "HFCG", "FGN", "SGN", "KFAC", "FOSIAlgorithm", "TorchOptimizerAlgorithm"} <= set(found)
    covered = {c.algorithm for c in CASES}
    missing = {n: f for n, f in found.items() if n not in covered}
    assert not missing, f"Algorithm implementations without a case in tests/cases.py: {missing}"
    for case in CASES:
        assert (case.kind == "algorithm") == (case.algorithm is not None), case.name
        if case.algorithm is not None:
            assert case.algorithm in found, f"{case.name}: {case.algorithm} is no Algorithm in src/curvopt"


def test_cases_are_well_formed():
    """Unique names; every skip/xfail key is a conformance property or a contract clause, with a reason."""
    assert len({c.name for c in CASES}) == len(CASES)
    for case in CASES:
        assert case.kind in ("torch", "algorithm"), case.name
        keys = set(PROPERTIES) | set(CLAUSES) if case.exported else set(CLAUSES)
        for table in (case.skips, case.xfails):
            for key, reason in table.items():
                assert key in keys, (case.name, key)
                assert isinstance(reason, str) and len(reason) > 20, (case.name, key)
        assert not set(case.skips) & set(case.xfails), case.name
        assert case.progress.steps >= 1 and 0 < case.progress.fraction < 1, case.name
        assert case.round_trip_steps >= 1 and case.round_trip_atol >= 0, case.name


def test_the_algorithm_scan_finds_new_implementations(tmp_path):
    """The coverage test's premise: subclasses (also indirect) and duck-typed classes are found."""
    (tmp_path / "new.py").write_text(
        "from curvopt.api import AlgorithmBase\n"
        "class Direct(AlgorithmBase):\n    def step(self, batch): ...\n"
        "class Indirect(Direct): ...\n"
        "class Duck:\n"
        "    def step(self, batch): ...\n    def state_dict(self): ...\n    def load_state_dict(self, s): ...\n"
        "class TorchStyle:\n"
        "    def step(self, closure=None, *, batch=None): ...\n    def state_dict(self): ...\n"
        "    def load_state_dict(self, s): ...\n"
    )
    assert set(algorithm_classes(tmp_path)) == {"Direct", "Indirect", "Duck"}
