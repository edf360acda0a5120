"""Figure 4's memory measurement (experiments.alice_llm.memory): one process per configuration,
several at once with --jobs, each record written as it is measured and kept on the next call."""

from __future__ import annotations

import json

import pytest

from experiments.alice_llm import memory


def test_jobs_measure_each_configuration_in_its_own_process(tmp_path, capsys):
    memory.main(["--profile", "quick", "--sizes", "tiny", "--methods", "adam", "--steps", "1",
                 "--jobs", "2", "--results", str(tmp_path)])  # fmt: skip
    out = tmp_path / "alice_memory"
    records = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(records) == ["quick_tiny_adam.json", "quick_tiny_adam_layerwise.json"]
    for rec in records.values():
        assert rec["peak_bytes"] > 0 and rec["memory_kind"] == "cpu_profiler_tensor_peak"
        assert rec["concurrent_jobs"] == 2 and rec["steps"] == 1
    assert records["quick_tiny_adam_layerwise.json"]["layerwise"] is True
    capsys.readouterr()
    memory.main(["--profile", "quick", "--sizes", "tiny", "--methods", "adam", "--results", str(tmp_path)])
    assert capsys.readouterr().out.count("[kept]") == 2  # measured records are never redone


@pytest.mark.parametrize("argv, match", [(["--methods", "adamm"], "unknown method adamm"),
                                         (["--jobs", "0"], "--jobs must be >= 1")])  # fmt: skip
def test_bad_arguments_stop_before_any_measurement(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        memory.main(["--profile", "quick", "--sizes", "tiny", "--results", str(tmp_path), *argv])
    assert not list((tmp_path / "alice_memory").glob("*.json"))
