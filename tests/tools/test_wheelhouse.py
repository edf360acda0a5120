"""tools/gpu/wheelhouse.py plans the right set of wheels (dry run: no downloads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "wheelhouse.py"


@pytest.fixture(scope="module")
def wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planned(wheelhouse, tmp_path, *extra: str) -> tuple[set[str], dict]:
    manifest = wheelhouse.main(["--dry-run", "--dest", str(tmp_path / "wh"), *extra])
    return {p["name"] for p in manifest["packages"]}, manifest


def test_default_set_is_small_and_leaves_out_what_our_runs_never_import(wheelhouse, tmp_path):
    names, manifest = _planned(wheelhouse, tmp_path)
    # what our runs import and a CUDA PyTorch image lacks
    assert {
        "hydra-core",
        "omegaconf",
        "antlr4-python3-runtime",
        "galore-torch",
        "fira",
        "apollo-torch",
    } <= names
    # never torch (the node has its CUDA build), never what such an image ships
    assert not names & {"torch", "numpy", "transformers", "triton"}
    # declared by the baselines but not imported by the optimizers we run (41 + 7 MiB)
    assert not names & {"bitsandbytes", "tensorly", "wandb", "datasets"}
    assert {"bitsandbytes", "tensorly"} <= set(manifest["optional_left_out"])
    assert "bitsandbytes" not in manifest["skipped_as_present"]
    assert "--no-deps" in manifest["install"] and "--no-index" in manifest["install"]


def test_with_8bit_adds_the_declared_dependencies(wheelhouse, tmp_path):
    names, manifest = _planned(wheelhouse, tmp_path, "--with", "8bit")
    assert {"bitsandbytes", "tensorly"} <= names
    assert "bitsandbytes" not in manifest["optional_left_out"]


def test_have_skips_a_package_the_target_already_has(wheelhouse, tmp_path):
    names, _ = _planned(wheelhouse, tmp_path, "--have", "hydra-core")
    assert "hydra-core" not in names and "omegaconf" in names


def test_only_plans_just_those_packages_and_what_they_need(wheelhouse, tmp_path):
    names, _ = _planned(wheelhouse, tmp_path, "--only", "hydra-core,omegaconf")
    assert names == {"hydra-core", "omegaconf", "antlr4-python3-runtime"}  # PyYAML, packaging: present
