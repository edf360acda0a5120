"""Every experiment config composes and instantiates; every optimizer takes one step."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, compose

from curvopt.data.common import DataNotFoundError
from curvopt.objective import Objective
from curvopt.training.build import build_algorithm, build_data, build_model, call_target

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
OPTIMIZERS = sorted(p.stem for p in (CONF_DIR / "optimizer").glob("*.yaml"))

# Optimizers that only apply to a particular kind of task run their smoke step there.
SMOKE_TASK: dict[str, list[str]] = {
    "classifier": ["dataset=synthetic_classification", "model=tiny_mlp"],
    "autoencoder": ["dataset=synthetic_images", "model=tiny_autoencoder"],
}
TASK_OF = {"shf_lsmr": "autoencoder", "hf_cg": "autoencoder"}
# the paper's rank (128) exceeds the tiny models' weights, which Alice refuses
SMOKE_EXTRA = {m: ["optimizer.rank=4", "optimizer.leading=2"] for m in ("alice", "alice0")}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_instantiates(experiment, tmp_path):
    cfg = compose([f"experiment={experiment}", "logger=none", f"paths.results_dir={tmp_path}"])
    assert cfg.experiment_name and cfg.profile in ("quick", "paper")
    # paper-size LLaMA models (up to 1B) are built on the meta device: shapes and counts, no memory
    big = cfg.profile == "paper" and str(cfg.model.get("_target_", "")).endswith("llama_lm")
    device = torch.device("meta" if big else "cpu")
    with torch.device("meta") if big else contextlib.nullcontext():
        model, loss = build_model(cfg, torch.float32, device)
    assert loss in ("squared_error", "cross_entropy", "sigmoid_bce")
    assert sum(p.numel() for p in model.parameters()) > 0
    spec = dict(cfg.dataset)
    assert "_target_" in spec and "name" in spec
    # instantiate the optimizer on a tiny stand-in batch of the right kind (data loading of
    # real datasets is covered by the loaders' own tests and the smoke runs)
    try:
        data = build_data(cfg, torch.float32, torch.device("cpu")) if cfg.profile == "quick" else None
    except DataNotFoundError as err:
        pytest.skip(f"data not available here: {str(err).splitlines()[0]}")
    if data is not None:
        algorithm = build_algorithm(cfg.optimizer, Objective(model, loss), data)
        assert hasattr(algorithm, "step")


def test_unknown_choice_lists_valid_options():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as err:
        compose(["optimizer=not_an_optimizer"])
    assert "adam" in str(err.value)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_step_smoke(optimizer, tmp_path):
    task = TASK_OF.get(optimizer, "classifier")
    cfg = compose(
        [
            *SMOKE_TASK[task],
            f"optimizer={optimizer}",
            *SMOKE_EXTRA.get(optimizer, []),
            "logger=none",
            f"paths.results_dir={tmp_path}",
        ]
    )
    data = build_data(cfg, torch.float32, torch.device("cpu"))
    model, loss = build_model(cfg, torch.float32, torch.device("cpu"))
    objective = Objective(model, loss)
    algorithm = build_algorithm(cfg.optimizer, objective, data)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data.train
    bs = algorithm.next_batch_size() or 64
    scalars = algorithm.step((x[:bs], y[:bs]))
    assert isinstance(scalars, dict)
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert changed, f"{optimizer} did not change any parameter in one step"


def test_model_builders_are_importable():
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        import yaml

        spec = yaml.safe_load(Path(path).read_text())
        assert "_target_" in spec and "loss" in spec, path.name
        if "llama" in path.stem and "tiny" not in path.stem:
            continue  # large LLaMA configs are built in their own (slow) tests
        spec.pop("loss")
        model = call_target({k: v for k, v in spec.items() if not isinstance(v, str) or "${" not in v})
        assert isinstance(model, torch.nn.Module), path.name


def test_command_line_wins_over_experiment_variant():
    """An experiment's optimizer_variants must not silently undo an explicit command-line value."""
    from curvopt.training.build import apply_optimizer_variant, cli_value_overrides

    argv = [
        "experiment=fosi_lm",
        "optimizer=fosi_adam",
        "optimizer.k=7",
        "optimizer.hvp_mode=forward_over_reverse",
    ]
    cfg = compose(argv)
    plain = apply_optimizer_variant(cfg)
    assert (plain.optimizer.k, plain.optimizer.hvp_mode) == (
        5,
        "reverse_over_reverse",
    )  # the variant's values
    pairs = cli_value_overrides(argv, ["experiment", "optimizer", "model", "dataset", "trainer"])
    assert pairs == [("optimizer.k", 7), ("optimizer.hvp_mode", "forward_over_reverse")]
    merged = apply_optimizer_variant(cfg, pairs)
    assert (merged.optimizer.k, merged.optimizer.hvp_mode) == (7, "forward_over_reverse")
    assert merged.optimizer.ese_period == 100  # the rest of the variant still applies
    assert apply_optimizer_variant(merged) is merged  # a second merge changes nothing


def test_train_entrypoint_keeps_command_line_values(tmp_path):
    """End to end through src/train.py (Hydra app): the saved config has the command line's value."""
    import subprocess
    import sys

    from curvopt.runs import REPO_ROOT

    cmd = [
        sys.executable,
        "src/train.py",
        "experiment=fosi_lm",
        "optimizer=fosi_adam",
        "optimizer.alpha=0.5",  # the variant sets alpha: 0.01
        "trainer.max_steps=1",
        "trainer.eval_every=1",
        "logger=none",
        f"paths.results_dir={tmp_path}",
        "run_id=cli",
        f"hydra.run.dir={tmp_path}/hydra",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode == 2 and "tiny_shakespeare" in done.stderr:
        pytest.skip("Tiny Shakespeare is not in the data directory")
    assert done.returncode == 0, done.stderr[-2000:]
    saved = next(tmp_path.rglob("cli/config.yaml")).read_text()
    assert "alpha: 0.5" in saved and "alpha: 0.01" in saved.split("optimizer_variants")[1]
