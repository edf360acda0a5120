"""Run records name no absolute folder of the machine that wrote them, and still resume."""

from __future__ import annotations

import yaml

from curvopt.training.build import run_from_config
from curvopt.training.records import REPO_ROOT, portable_config_yaml, portable_paths
from curvopt.training.rundir import CommandLine
from tests.conftest import TINY_RUN, compose

GROUPS = ("dataset", "model", "optimizer", "trainer", "logger", "paths", "experiment")
ROOTS = [("/data/shared", "$CURVOPT_DATA_DIR"), ("/home/me/curvopt", ""), ("/tmp", "$TMPDIR")]


def test_portable_paths_replaces_whole_folders_only():
    assert portable_paths("/home/me/curvopt/results/x", ROOTS) == "results/x"
    assert portable_paths("root: /home/me/curvopt\n", ROOTS) == "root: .\n"
    assert portable_paths("Searched: /data/shared/mnist - /data/shared", ROOTS) == (
        "Searched: $CURVOPT_DATA_DIR/mnist - $CURVOPT_DATA_DIR"
    )
    assert portable_paths('"File \\"/home/me/curvopt/src/a.py\\""', ROOTS) == '"File \\"src/a.py\\""'
    # a folder that only starts like a root is left alone
    assert (
        portable_paths("/home/me/curvopt2/x /data/shared_old", ROOTS)
        == "/home/me/curvopt2/x /data/shared_old"
    )


def test_config_yaml_changes_only_its_folder_keys():
    text = yaml.safe_dump(
        {
            "paths": {"root_dir": ".", "data_dir": "/d/x", "results_dir": f"{REPO_ROOT}/results"},
            "dataset": {"data_dir": "/d/x", "name": "mnist"},
            "model": {"weights": "/d/x/w.pt"},  # a literal path the run reads: kept as given
        },
        sort_keys=False,
    )
    out = yaml.safe_load(portable_config_yaml(text, "/d/x"))
    assert out["paths"] == {"root_dir": ".", "data_dir": "$CURVOPT_DATA_DIR", "results_dir": "results"}
    assert out["dataset"] == {"data_dir": "$CURVOPT_DATA_DIR", "name": "mnist"}
    assert out["model"] == {"weights": "/d/x/w.pt"}


def test_a_run_writes_portable_records_and_resumes_from_them(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("CURVOPT_DATA_DIR", str(data))
    first = [
        *TINY_RUN,
        "experiment_name=t",
        f"paths.results_dir={tmp_path / 'res'}",
        f"paths.data_dir={data}",
        "optimizer=adam",
        "run_id=p",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=3",
        "seed=0",
    ]
    run_from_config(compose(first), CommandLine.parse(first, GROUPS))
    run_dir = tmp_path / "res" / "t" / "p"
    for name in ("config.yaml", "overrides.yaml", "summary.json"):
        text = (run_dir / name).read_text()
        assert str(tmp_path) not in text, name
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["paths"]["data_dir"] == "$CURVOPT_DATA_DIR"
    # killed after its checkpoint: the resume reads the portable config.yaml and continues
    (run_dir / "summary.json").unlink()
    again = [*first, "trainer.resume=true"]
    summary = run_from_config(compose(again), CommandLine.parse(again, GROUPS))
    assert summary["status"] == "completed" and summary["steps"] == 6
