"""Every experiment config composes and instantiates; every optimizer takes one step."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from curvopt.errors import DataNotFoundError
from curvopt.objective import Objective
from curvopt.training.build import build_algorithm, build_data, build_model, call_target
from tests.conftest import CONF_DIR, compose

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
    # a quick experiment's settings reach its paper profile: conf/config.yaml composes the quick
    # twin's file (fosi_lm_paper's per_optimizer_base) before the paper file
    paper = compose(["experiment=fosi_lm_paper", "optimizer=fosi_adam"])
    assert (paper.optimizer.k, paper.optimizer.ese_period, paper.optimizer.hvp_mode) == (
        10,
        800,
        "reverse_over_reverse",
    )
    # an optimizer without a file for this experiment gets the experiment alone
    assert compose(["experiment=fosi_lm", "optimizer=sgd"]).optimizer == compose(["optimizer=sgd"]).optimizer


def _experiment_defaults(name: str) -> list:
    import yaml

    cfg = yaml.safe_load((CONF_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
    return cfg.get("defaults", [])


def _experiment_parents(name: str) -> list[str]:
    return [d for d in _experiment_defaults(name) if isinstance(d, str) and not d.startswith(("/", "_self_"))]


def _per_optimizer_choice(name: str, key: str) -> str | None:
    """The experiment's ``per_optimizer_base`` / ``per_optimizer_as`` (conf/config.yaml): named in its
    defaults list (``optional /<key>: <experiment>``) or, failing that, inherited from a parent."""
    for entry in _experiment_defaults(name):
        if isinstance(entry, dict):
            ((group, value),) = entry.items()
            if group.split()[-1].lstrip("/") == key:
                return value
    for parent in _experiment_parents(name):
        inherited = _per_optimizer_choice(parent, key)
        if inherited is not None:
            return inherited
    return None


def _per_optimizer_files() -> dict[tuple[str, str], dict]:
    import yaml

    root = CONF_DIR / "per_optimizer"
    return {(p.parent.name, p.stem): yaml.safe_load(p.read_text()) or {} for p in root.glob("*/*.yaml")}


def test_per_optimizer_files_follow_the_experiments():
    """Every conf/per_optimizer/<experiment>/<optimizer>.yaml names a real experiment and optimizer,
    and every experiment gets its parents' per-optimizer settings: conf/config.yaml composes the file of
    the experiment's per_optimizer_base (or uses per_optimizer_as's files) when it is the parent;
    otherwise a file of its own lists the parent's in its defaults. Hydra picks the files by the
    choices alone, so a gap here would silently drop a parent's settings."""
    files = _per_optimizer_files()
    assert files, "no per-optimizer files"
    for experiment, optimizer in files:
        assert experiment in EXPERIMENTS, f"per_optimizer/{experiment}: no such experiment"
        assert optimizer in OPTIMIZERS, f"per_optimizer/{experiment}/{optimizer}.yaml: no such optimizer"
    for experiment in EXPERIMENTS:
        base = _per_optimizer_choice(experiment, "per_optimizer_base")
        same_as = _per_optimizer_choice(experiment, "per_optimizer_as")
        for name in (base, same_as):
            assert name is None or name in EXPERIMENTS, f"{experiment}: no experiment {name}"
        if same_as is not None:
            assert not any(e == experiment for e, _ in files), (
                f"{experiment} uses {same_as}'s per-optimizer files (per_optimizer_as): its own are never read"
            )
        for parent in _experiment_parents(experiment):
            if parent in (base, same_as):
                continue  # conf/config.yaml composes the parent's files
            for optimizer in OPTIMIZERS:
                if (parent, optimizer) not in files:
                    continue
                own = files.get((experiment, optimizer))
                assert own is not None, (
                    f"per_optimizer/{experiment}/{optimizer}.yaml missing: {experiment} would lose {parent}'s "
                    f"(or name it in conf/experiment/{experiment}.yaml: - optional /per_optimizer_base: {parent})"
                )
                listed = own.get("defaults", [])
                assert f"/per_optimizer/{parent}/{optimizer}" in listed, (experiment, optimizer)


def test_per_optimizer_files_only_hold_changes():
    """No per-optimizer file merely re-includes another (a *_paper file that only lists its quick twin's
    is what per_optimizer_base replaces: conf/config.yaml composes the twin's file by itself), and no file
    lists its experiment's per_optimizer_base file, which conf/config.yaml has composed already."""
    for (experiment, optimizer), cfg in sorted(_per_optimizer_files().items()):
        path = f"conf/per_optimizer/{experiment}/{optimizer}.yaml"
        assert set(cfg) - {"defaults"}, f"{path} sets nothing of its own: delete it (see conf/config.yaml)"
        base = _per_optimizer_choice(experiment, "per_optimizer_base")
        if base is not None:
            assert f"/per_optimizer/{base}/{optimizer}" not in cfg.get("defaults", []), (
                f"{path} lists per_optimizer/{base}/{optimizer}, which its per_optimizer_base composes already"
            )


def test_paper_profile_falls_back_to_its_quick_twin():
    """A *_paper experiment without a per-optimizer file of its own gets its quick twin's settings, and
    one with a file gets the twin's first, then its own (conf/config.yaml, per_optimizer_base)."""
    assert not (CONF_DIR / "per_optimizer" / "fosi_lm_paper" / "heavy_ball.yaml").exists()
    quick = compose(["experiment=fosi_lm", "optimizer=heavy_ball"]).optimizer
    paper = compose(["experiment=fosi_lm_paper", "optimizer=heavy_ball"]).optimizer
    assert (paper.lr, paper.momentum) == (quick.lr, quick.momentum) == (0.1, 0.9)
    # two levels: alice_c4_130m_paper's file (rank 256) over alice_c4_paper's (its per_optimizer_base),
    # and the ablation run at 130M uses alice_c4_130m_paper's files (per_optimizer_as)
    for experiment in ("alice_c4_130m_paper", "alice_c4_130m_ablation_paper"):
        alice = compose([f"experiment={experiment}", "optimizer=alice"]).optimizer
        assert (alice.rank, alice.leading, alice.lr) == (256, 40, 0.02), experiment
        assert compose([f"experiment={experiment}", "optimizer=adam"]).optimizer.lr == 0.001, experiment


def test_help_lists_the_groups_a_user_chooses():
    """``src/train.py --help`` lists the experiments and optimizers (generated from conf/ when it runs)
    and none of the per-optimizer files conf/config.yaml composes by itself."""
    import subprocess
    import sys

    from experiments.runs import REPO_ROOT

    done = subprocess.run(
        [sys.executable, "src/train.py", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    groups = text.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = {}
    for line in groups.replace("\n    ", " ").splitlines():
        if " (default: " in line:
            group, rest = line.split(" (default: ", 1)
            listed[group] = set(rest.split("): ", 1)[1].split(", "))
    assert list(listed)[:2] == ["experiment", "optimizer"]
    assert set(listed) == {"experiment", "optimizer", "paths", "dataset", "model", "trainer", "logger"}
    assert listed["experiment"] == set(EXPERIMENTS) and listed["optimizer"] == set(OPTIMIZERS)
    assert "schema" not in listed["trainer"]  # the typed schemas are Hydra's, not a choice
    assert "per_optimizer" not in groups  # Hydra's own list had a line per conf/per_optimizer/<experiment>/
    assert not any(f"per_optimizer/{e}" in text for e in EXPERIMENTS)


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
    # USPS's HF-CG trains SHF's network (docs/decisions.md SHF-16), stopped by SHF's patience rule
    assert printed["trainer"]["max_steps"] == 500 and printed["trainer"]["patience_evals"] == 75
    assert printed["model"]["loss"] == "squared_error" and printed["optimizer"]["weight_cost"] == 0
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


def test_trainer_settings_have_one_source():
    """One dataclass, TrainerConfig, is the trainer group's schema, defaults, docs and checks:
    conf/trainer/default.yaml repeats no value, Hydra composes the class's defaults, and the checked
    object built from the composed group is the one the loop consumes."""
    import dataclasses
    import inspect

    from omegaconf import OmegaConf

    from curvopt.training import loop, schema
    from curvopt.training.schema import TrainerConfig

    yaml_cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "trainer" / "default.yaml"))
    assert yaml_cfg == {"defaults": ["schema", "_self_"]}, "the values live in TrainerConfig only"
    composed = compose(["logger=none"]).trainer
    assert OmegaConf.to_container(composed) == dataclasses.asdict(TrainerConfig())
    assert TrainerConfig.from_config(composed) == TrainerConfig() == TrainerConfig.from_config({})
    doc = inspect.getdoc(TrainerConfig)
    for f in dataclasses.fields(TrainerConfig):
        assert f"\n    {f.name}: " in doc, f"TrainerConfig's docstring does not document {f.name}"
    assert inspect.signature(loop.Trainer).parameters["config"].annotation == "TrainerConfig"
    # no second description of the settings is left
    for gone in ("TrainerSchema", "trainer_default", "LoopConfig", "check_trainer"):
        assert not hasattr(schema, gone) and not hasattr(loop, gone), gone
    # the list default is handed out fresh, so one run's config cannot change the next one's
    assert TrainerConfig().eval_splits is not TrainerConfig().eval_splits


def test_the_config_map_is_current():
    """docs/configs.md (each paper's experiment, per-optimizer and shared config files, and how a run
    is composed) is generated from conf/ by tools/config_map.py; it must not drift."""
    from tools.config_map import OUT, build

    assert OUT.read_text() == build(), "docs/configs.md is out of date: run python tools/config_map.py"
