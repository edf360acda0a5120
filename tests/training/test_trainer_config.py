"""The trainer settings have one source (curvopt.training.schema.TrainerConfig: Hydra schema,
defaults, docs and checks), a run config is checked once (RunSettings), and the config enters the
build once and leaves once (tools/cfg_walk.py). Fast: no data is loaded except by the last test's
tiny synthetic run."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from curvopt.errors import ConfigError
from curvopt.training.schema import DTYPES, RunSettings, TrainerConfig
from tests.conftest import TINY_RUN, compose


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_steps": -5}, "trainer.max_steps=-5: must be >= 0"),
        ({"batch_size": 0}, "trainer.batch_size=0: must be positive"),
        ({"eval_every": 0}, "trainer.eval_every=0: must be positive"),
        ({"eval_batch_size": -1}, "trainer.eval_batch_size=-1: must be positive"),
        ({"log_every": 0}, "trainer.log_every=0: must be positive"),
        ({"checkpoint_every": -1}, "trainer.checkpoint_every=-1: must be >= 0"),
        ({"patience_evals": 0}, "trainer.patience_evals=0: must be positive (or null: off)"),
        ({"max_epochs": 0}, "trainer.max_epochs=0.0: must be a positive number (or null: off)"),
        ({"max_algo_time_s": float("nan")}, "trainer.max_algo_time_s=nan: must be a positive number"),
        ({"checkpoint_every_s": -5}, "trainer.checkpoint_every_s=-5.0: must be a non-negative number"),
        ({"progress_log_every_s": -1}, "trainer.progress_log_every_s=-1.0: must be a non-negative number"),
        ({"progress_log_every_s": None}, "trainer.progress_log_every_s=None: must be a non-negative"),
        ({"sampling": "random"}, "trainer.sampling='random': choose one of epoch, independent, static"),
        ({"monitor_mode": "avg"}, "trainer.monitor_mode='avg': choose min or max"),
        ({"eval_splits": ["train", "dev"]}, "trainer.eval_splits has ['dev']: the splits are train"),
        ({"eval_splits": "train"}, "trainer.eval_splits='train': expected a list such as [train, val"),
        ({"dtype": "float16"}, "trainer.dtype='float16' is not supported; choose one of float32, float64"),
        ({"device": "gpu"}, "trainer.device='gpu': choose auto, cpu, cuda or cuda:<index>"),
        ({"micro_batch_size": 0}, "trainer.micro_batch_size=0: must be a positive whole number, or null"),
        ({"num_threads": 1.0}, "trainer.num_threads=1.0: must be a positive whole number, or null"),
        ({"clock": "gpu"}, "trainer.clock must be 'wall' or 'process', got 'gpu'"),
        ({"clock": "process", "device": "cuda:1"}, "trainer.clock=process counts CPU seconds only"),
        # a plain mapping (a saved config) is not typed by Hydra: the types are checked here
        (
            {"max_steps": "ten"},
            "trainer.max_steps='ten': expected a whole number, e.g. trainer.max_steps=100",
        ),
        ({"max_steps": None}, "trainer.max_steps=None: expected a whole number"),
        ({"max_epochs": "two"}, "trainer.max_epochs='two': expected a number (or null)"),
        ({"resume": "yes"}, "trainer.resume='yes': expected true or false"),
        ({"deterministic": 1}, "trainer.deterministic=1: expected true or false"),
    ],
)
def test_every_trainer_value_is_checked_when_the_object_is_built(values, message):
    with pytest.raises(ConfigError) as caught:
        TrainerConfig.from_config(values)
    assert str(caught.value).startswith(message)
    with pytest.raises(ConfigError):  # the constructor is the same path
        TrainerConfig(**values)


def test_values_are_normalised_and_keys_an_older_config_lacks_take_defaults():
    cfg = TrainerConfig.from_config(
        {"max_steps": 12.0, "max_epochs": 3, "checkpoint_every_s": 0, "eval_splits": ("val",), "gone": 1}
    )
    assert cfg.max_steps == 12 and isinstance(cfg.max_steps, int)
    assert cfg.max_epochs == 3.0 and isinstance(cfg.max_epochs, float) and cfg.checkpoint_every_s == 0.0
    assert cfg.eval_splits == ["val"] and cfg.batch_size == TrainerConfig().batch_size
    assert TrainerConfig.from_config(None) == TrainerConfig()
    # a DictConfig (interpolations resolved) and its plain values give the same object
    node = OmegaConf.create({"batch_size": "${max_steps}", "max_steps": 64})
    assert TrainerConfig.from_config(node) == TrainerConfig(batch_size=64, max_steps=64)
    assert set(DTYPES) >= {TrainerConfig().dtype}


def test_run_settings_check_the_whole_config_once(tmp_path):
    cfg = compose([*TINY_RUN, "optimizer=adam", "seed=3", f"paths.results_dir={tmp_path}", "run_id=x"])
    settings = RunSettings.from_config(cfg)
    assert settings.trainer == TrainerConfig.from_config(cfg.trainer)
    assert (settings.seed, settings.run_id, settings.optimizer_name) == (3, "x", "adam")
    assert settings.results_dir == tmp_path and settings.config == OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(ConfigError, match="trainer.batch_size=0: must be positive"):
        RunSettings.from_config(compose([*TINY_RUN, "trainer.batch_size=0"]))


def test_a_saved_config_from_an_older_version_is_accepted_when_resumed():
    """Configs saved before per_optimizer/ carry a merged optimizer_variants block (and may lack
    newer keys): a resumed run continues with them; a freshly composed config may not have one."""
    saved = OmegaConf.to_container(compose([*TINY_RUN, "optimizer=adam"]), resolve=True)
    saved["optimizer_variants"] = {"adam": {"optimizer": {"lr": 0.5}}}
    del saved["trainer"]["clock"], saved["trainer"]["restart"]
    old = OmegaConf.create(saved)
    settings = RunSettings.from_config(old, composed=False)
    assert settings.trainer.clock == "wall" and settings.trainer.restart is False
    with pytest.raises(ConfigError, match="optimizer_variants is no longer read"):
        RunSettings.from_config(old)


def test_distribute_refuses_an_own_algorithm_under_torchrun():
    import torch

    from curvopt.objective import Objective
    from curvopt.training.algorithm import TorchOptimizerAlgorithm
    from curvopt.training.distributed import SINGLE, DistInfo, distribute

    model = torch.nn.Linear(2, 1)
    wrapped = TorchOptimizerAlgorithm(Objective(model, "squared_error"), torch.optim.SGD(model.parameters()))
    distribute(wrapped, model, SINGLE, torch.device("cpu"), "torch.optim.SGD")  # one process: nothing
    assert wrapped.train_model is model
    with pytest.raises(NotImplementedError, match="my.factory returns its own Algorithm"):
        distribute(object(), model, DistInfo(rank=0, world_size=2), torch.device("cpu"), "my.factory")


def test_the_config_enters_the_build_once_and_leaves_once():
    """tools/cfg_walk.py on a tiny run: TrainerConfig (trainer_config.py, built by RunSettings in
    schema.py) reads and checks the trainer node, RunSettings the rest, the build reads the checked
    values, the loop reads TrainerConfig; no file is visited twice."""
    from tools.cfg_walk import measure

    result = measure([*TINY_RUN, "optimizer=adam", "trainer.max_steps=2", "trainer.eval_every=1"])
    assert result["summary"]["status"] == "completed"
    files = [stay["file"] for stay in result["walk"]]
    assert files == [
        "src/curvopt/training/trainer_config.py",
        "src/curvopt/training/schema.py",
        "src/curvopt/training/build.py",
        "src/curvopt/training/loop.py",
    ], result["walk"]
    assert result["returns"] == 0
    # the hooks are gone again
    assert "__getattribute__" not in vars(TrainerConfig)
    assert dataclasses.is_dataclass(TrainerConfig)
