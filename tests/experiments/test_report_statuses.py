"""Report statuses a reader can trust: a record cut short is "in progress", a quick pass whose
paper-scale twin misses is not "qualitatively reproduced", every benchmark row names its device,
and the SHF Table 2 file keeps every dataset's rows. Each test fails on the behaviour before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from experiments.report import core
from experiments.report.build import DEFAULT_TOLERANCES, build_report
from experiments.report.papers import ITEMS


def _item(paper: str, title: str, result: core.ItemResult) -> core.Item:
    return core.Item(paper, title.split(":")[0].lower(), title, "make x", lambda ctx: result)


def test_a_record_cut_short_is_in_progress_never_different(tmp_path: Path) -> None:
    ctx = core.Context(results=tmp_path, tolerances={})
    partial = core.ItemResult(
        core.DIFFERENT, provenance="profile paper", complete=False, incomplete="45 of 144 cells"
    )
    res = core.evaluate(_item("fgn", "Figure 2: x", partial), ctx)
    assert res.status == core.IN_PROGRESS
    assert "45 of 144 cells" in res.notes[0]
    assert core.IN_PROGRESS in core.STATUSES and core.IN_PROGRESS in core.BADGES


def test_fgn_fig2_partial_timing_record_is_in_progress(tmp_path: Path) -> None:
    """The H200 record of Figure 2a: 4 methods x 12 C x 3 repeats asked, the session ended after a few."""
    folder = tmp_path / "fgn_fig2" / "paper"
    folder.mkdir(parents=True)
    classes = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    methods = ["adam", "sgn", "fgn_generic", "fgn_affine"]
    config = {"timing": {"classes": classes, "methods": methods, "repeats": 3}}
    (folder / "config.json").write_text(json.dumps(config))
    rows = [
        {"method": m, "C": c, "ms_mean": {"adam": 1.0, "sgn": 3.0, "fgn_generic": 2.0, "fgn_affine": 2.0}[m],
         "status": "ok", "device": "NVIDIA H200", "repeat": 0}
        for c in (2, 4) for m in methods
    ] + [{"method": "adam", "C": 4096, "ms_mean": 1.0, "status": "ok", "device": "NVIDIA H200", "repeat": 0}]  # fmt: skip
    (folder / "timing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    item = [i for i in ITEMS if i.paper == "fgn" and i.key == "fig2"]
    (evaluated,) = build_report(tmp_path, DEFAULT_TOLERANCES, items=item)
    res = evaluated[1]
    assert res.status == core.IN_PROGRESS, res.notes
    assert "9 of 144" in " ".join(res.notes)
    # the whole grid recorded: judged as before (here Adam < FGN < SGN holds at the largest C)
    rows = [
        {"method": m, "C": c, "ms_mean": {"adam": 1.0, "sgn": 3.0, "fgn_generic": 2.0, "fgn_affine": 2.0}[m],
         "status": "ok", "device": "NVIDIA H200", "repeat": r}
        for c in classes for m in methods for r in range(3)
    ]  # fmt: skip
    (folder / "timing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (evaluated,) = build_report(tmp_path, DEFAULT_TOLERANCES, items=item)
    assert evaluated[1].status != core.IN_PROGRESS and evaluated[1].complete


def test_a_quick_pass_whose_paper_twin_is_different_is_not_qualitatively_reproduced() -> None:
    quick = core.ItemResult(core.QUALITATIVE, provenance="profile quick; device cpu; seeds 0 (1 run)")
    usps = core.ItemResult(core.DIFFERENT, provenance="profile paper; device cpu; seeds 0,1 (2 runs)")
    other = core.ItemResult(core.QUALITATIVE, provenance="profile quick; device cpu")
    evaluated = [
        (_item("shf", "Figure 3 (MNIST): batch size", quick), quick),
        (_item("shf", "Figure 3 (USPS): batch size", usps), usps),
        (_item("shf", "Figure 2 (MNIST): error", other), other),
    ]
    core.apply_twin_rule(evaluated)
    assert quick.status == core.NOT_PAPER_SCALE
    assert "Figure 3 (USPS)" in quick.notes[0] and "different" in quick.notes[0]
    assert usps.status == core.DIFFERENT and other.status == core.QUALITATIVE  # other claims untouched
    # a paper-scale twin that holds leaves the quick pass alone
    again = core.ItemResult(core.QUALITATIVE, provenance="profile quick")
    ok = core.ItemResult(core.QUALITATIVE, provenance="profile paper")
    core.apply_twin_rule(
        [(_item("shf", "Figure 3 (MNIST): b", again), again), (_item("shf", "Figure 3 (USPS): b", ok), ok)]
    )
    assert again.status == core.QUALITATIVE


def test_committed_report_counts_shf_figure3_mnist_as_not_reproduced() -> None:
    md = (Path(__file__).resolve().parents[2] / "results" / "REPORT.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| shf | Figure 3 (MNIST)"))
    assert "qualitatively reproduced" not in row
    row = next(line for line in md.splitlines() if line.startswith("| fgn | Figure 2 |"))
    assert "in progress" in row


def test_every_benchmark_row_names_its_device(tmp_path: Path) -> None:
    (tmp_path / "tables").mkdir()
    pd.DataFrame(
        [
            {"paper": "FGN", "task": "head", "optimizer": "FGN", "device": "CPU", "step / Adam": 2.0, "state / Adam": 1.0},
            {"paper": "FGN", "task": "head", "optimizer": "FGN", "device": "NVIDIA H200", "step / Adam": 1.5, "state / Adam": 1.0},
        ]
    ).to_csv(tmp_path / "tables" / "bench_cross_paper.csv", index=False)  # fmt: skip
    _, _, frame = core.bench_section(tmp_path)
    assert "device" in frame and list(frame["device"]) == ["CPU", "NVIDIA H200"]
    md = core.write_markdown([], {}, tmp_path / "REPORT.md", "# r")
    assert "| paper | task | optimizer | device |" in md.read_text()


def test_shf_table2_file_keeps_every_dataset(tmp_path: Path, monkeypatch) -> None:
    """`figures table2 --datasets curves` used to rewrite the file with the CURVES rows only."""
    from experiments.shf import figures

    monkeypatch.setattr(
        sys,
        "argv",
        ["figures", "table2", "--profile", "paper", "--datasets", "curves", "--results-dir", str(tmp_path)],
    )
    figures.main()
    table = pd.read_csv(tmp_path / "tables" / "shf_table2_paper.csv")
    assert set(table["dataset"]) == {"mnist", "curves", "usps"}
    assert list(table["dataset"])[0] == "curves"  # the dataset asked for first


def test_committed_shf_table2_paper_has_its_usps_rows() -> None:
    table = pd.read_csv(Path(__file__).resolve().parents[2] / "results" / "tables" / "shf_table2_paper.csv")
    assert {"usps", "curves", "mnist"} <= set(table["dataset"])
    assert (table[table["dataset"] == "usps"]["seeds"] == 5).all()
