"""Shared fixtures: the data directory, tiny synthetic problems, Hydra composition."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"


def data_dir() -> Path:
    env = os.environ.get("CURVOPT_DATA_DIR")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data"


# Tests never touch the network: the hub would only time out here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if "CURVOPT_DATA_DIR" not in os.environ and data_dir().is_dir():
    os.environ["CURVOPT_DATA_DIR"] = str(data_dir())


@pytest.fixture
def shared_data_dir() -> Path:
    path = data_dir()
    if not path.is_dir():
        pytest.skip(f"no data directory at {path} (set CURVOPT_DATA_DIR)")
    return path


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# A tiny run (synthetic clusters, small MLP, no tracker) for tests of the loop and its records
TINY_RUN = [
    "dataset=synthetic_classification",
    "model=tiny_mlp",
    "logger=none",
    "trainer.progress=false",
    "trainer.batch_size=32",
    "trainer.eval_every=5",
    "trainer.deterministic=false",
]


def compose(overrides: list[str]):
    """Compose conf/config.yaml with overrides (no CLI, no working-dir change)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from curvopt.training.schema import register_schemas

    register_schemas()  # the trainer/paths/logger schemas (the entrypoint registers them on import)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
