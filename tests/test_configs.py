"""Every experiment config composes and instantiates; every optimizer takes one step."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, compose

from curvopt.errors import DataNotFoundError
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


def test_command_line_wins_over_per_optimizer_settings():
    """conf/per_optimizer/<experiment>/<optimizer>.yaml is composed by Hydra after the experiment,
    and the command line is applied after both: an explicit value wins, the rest still applies."""
    plain = compose(["experiment=fosi_lm", "optimizer=fosi_adam"])
    assert (plain.optimizer.k, plain.optimizer.hvp_mode, plain.optimizer.ese_period) == (
        5,
        "reverse_over_reverse",
        100,
    )  # conf/per_optimizer/fosi_lm/fosi_adam.yaml
    cli = compose(
        [
            "experiment=fosi_lm",
            "optimizer=fosi_adam",
            "optimizer.k=7",
            "optimizer.hvp_mode=forward_over_reverse",
        ]
    )
    assert (cli.optimizer.k, cli.optimizer.hvp_mode, cli.optimizer.ese_period) == (
        7,
        "forward_over_reverse",
        100,
    )
    # a quick experiment's settings reach its paper profile through the per-optimizer file's defaults
    paper = compose(["experiment=fosi_lm_paper", "optimizer=fosi_adam"])
    assert (paper.optimizer.k, paper.optimizer.ese_period, paper.optimizer.hvp_mode) == (
        10,
        800,
        "reverse_over_reverse",
    )
    # an optimizer without a file for this experiment gets the experiment alone
    assert compose(["experiment=fosi_lm", "optimizer=sgd"]).optimizer == compose(["optimizer=sgd"]).optimizer


def _experiment_parents(name: str) -> list[str]:
    import yaml

    cfg = yaml.safe_load((CONF_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
    return [d for d in cfg.get("defaults", []) if isinstance(d, str) and not d.startswith(("/", "_self_"))]


def test_per_optimizer_files_follow_the_experiments():
    """Every conf/per_optimizer/<experiment>/<optimizer>.yaml names a real experiment and optimizer;
    an experiment inherits its parents' per-optimizer settings only through a file of its own that
    lists the parent's file in its defaults (Hydra picks the file by the two choices), so a missing
    one would silently drop them: each such file exists and lists exactly its parents' files."""
    import yaml

    root = CONF_DIR / "per_optimizer"
    files = {(p.parent.name, p.stem) for p in root.glob("*/*.yaml")}
    assert files, "no per-optimizer files"
    for experiment, optimizer in files:
        assert experiment in EXPERIMENTS, f"per_optimizer/{experiment}: no such experiment"
        assert optimizer in OPTIMIZERS, f"per_optimizer/{experiment}/{optimizer}.yaml: no such optimizer"
    for experiment in EXPERIMENTS:
        for parent in _experiment_parents(experiment):
            for optimizer in OPTIMIZERS:
                if (parent, optimizer) not in files:
                    continue
                path = root / experiment / f"{optimizer}.yaml"
                assert path.exists(), (
                    f"{path.relative_to(CONF_DIR)} missing: {experiment} would lose {parent}'s"
                )
                defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
                assert f"/per_optimizer/{parent}/{optimizer}" in defaults, path


def test_cfg_job_prints_what_runs(tmp_path):
    """``src/train.py ... --cfg job`` prints the composed config with the per-optimizer settings
    (Martens' HF-CG head and 500 iterations on the SHF paper profile), not a config that changes later."""
    import subprocess
    import sys

    import yaml

    from experiments.runs import REPO_ROOT

    cmd = [
        sys.executable,
        "src/train.py",
        "experiment=shf_fig2_usps_paper",
        "optimizer=hf_cg",
        "--cfg",
        "job",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["trainer"]["max_steps"] == 500 and printed["model"]["loss"] == "sigmoid_bce"
    assert printed["optimizer"]["numchunks"] == 4 and "optimizer_variants" not in printed


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.max_stepz=5", "max_stepz"),
        ("trainer.max_steps=ten", "max_steps"),
        ("trainer.num_threads=1.5", "num_threads"),
        ("paths.data_dirr=/tmp", "data_dirr"),
        ("logger.projekt=x", "projekt"),
    ],
)
def test_schema_rejects_unknown_keys_and_wrong_types_at_compose_time(override, needle):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    with pytest.raises((HydraException, OmegaConfBaseException), match=needle):
        compose(["logger=wandb", override])


def test_plus_added_unknown_key_is_refused_before_anything_runs(tmp_path):
    """``+trainer.max_stepz=5`` (Hydra's own hint after a typo) passes composition, so the run
    checks every trainer/paths/logger key against the schemas before it loads anything."""
    from curvopt.errors import ConfigError
    from curvopt.training.build import run_from_config

    cfg = compose(["+trainer.max_stepz=5", "logger=none", f"paths.results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"trainer\.max_stepz \(did you mean trainer\.max_steps\?\)"):
        run_from_config(cfg)
    assert not any(tmp_path.iterdir())


def test_bad_config_key_exits_with_bad_input_code(tmp_path):
    """A compose-time failure (unknown key, wrong type, unknown group option) is bad input: exit 2,
    like a bad value caught before training, and nothing is written."""
    import subprocess
    import sys

    from experiments.runs import REPO_ROOT

    for override in ("+trainer.max_stepz=5", "optimizer=adamz"):
        cmd = [sys.executable, "src/train.py", override, f"paths.results_dir={tmp_path}", "logger=none"]
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (override, done.returncode, done.stderr[-1500:])
        assert ("max_stepz" if "max" in override else "adamz") in done.stdout + done.stderr
    assert not any(tmp_path.iterdir())


def test_legacy_optimizer_variants_block_is_refused(tmp_path):
    from curvopt.errors import ConfigError
    from curvopt.training.build import run_from_config

    cfg = compose(
        ["+optimizer_variants.adam.optimizer.lr=0.5", "logger=none", f"paths.results_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match="conf/per_optimizer"):
        run_from_config(cfg)


def test_train_entrypoint_keeps_command_line_values(tmp_path):
    """End to end through src/train.py (Hydra app): the saved config has the command line's value."""
    import subprocess
    import sys

    from experiments.runs import REPO_ROOT

    cmd = [
        sys.executable,
        "src/train.py",
        "experiment=fosi_lm",
        "optimizer=fosi_adam",
        "optimizer.alpha=0.5",  # conf/per_optimizer/fosi_lm/fosi_adam.yaml sets alpha: 0.01
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
    assert "alpha: 0.5" in saved and "alpha: 0.01" not in saved and "optimizer_variants" not in saved


def test_trainer_defaults_have_one_source():
    """conf/trainer/default.yaml, the schema and the loop's LoopConfig agree on every default."""
    import dataclasses

    from omegaconf import OmegaConf

    from curvopt.training.loop import LoopConfig
    from curvopt.training.schema import TrainerSchema, trainer_default

    yaml_cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "trainer" / "default.yaml"))
    yaml_cfg.pop("defaults")
    schema = dataclasses.asdict(TrainerSchema())
    assert yaml_cfg == schema, {
        k: (yaml_cfg.get(k), schema.get(k))
        for k in set(yaml_cfg) | set(schema)
        if yaml_cfg.get(k) != schema.get(k)
    }
    loop = LoopConfig()
    for f in dataclasses.fields(LoopConfig):
        assert f.name in schema, f"LoopConfig.{f.name} is not a trainer setting"
        assert getattr(loop, f.name) == schema[f.name], f.name
    assert LoopConfig.from_trainer({}) == loop
    # the list default is handed out fresh, so one run's config cannot change the next one's
    assert trainer_default("eval_splits") is not trainer_default("eval_splits")
