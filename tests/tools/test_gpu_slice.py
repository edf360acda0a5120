"""tools/gpu/ (python -m tools.gpu) and tools/gpu_slice.sh, the GPU work in one-device-call slices (docs/cluster.md,
section 5): the whole path on the CPU with a fake $OUT (run, SIGTERM, pack, unpack, a tampered file
refused), the deadline, the carry folder's size check, the queue, the ledger, and the tracked tree's
size (the device call carries it)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_slice.sh"
TREE_LIMIT_BYTES = 44_000_000  # the device call carries the tree: 64 MiB with data, wheels, checkpoints

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash, POSIX signals")


@pytest.fixture(scope="module")
def gs():
    """The slice tool's modules (tools/gpu/), one per step: gs.slices, gs.carry, gs.run, gs.pack,
    gs.unpack, gs.ledger; gs.common, gs.cli."""
    from tools import gpu
    from tools.gpu import cli  # noqa: F401 - imports every module of the slice's path

    return gpu


def _git_sizes() -> dict[str, int]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    files = [p for p in out.stdout.decode().split("\0") if p]
    return {p: os.lstat(ROOT / p).st_size for p in files if os.path.lexists(ROOT / p)}


def test_tracked_tree_stays_under_44_mb():
    sizes = _git_sizes()
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    assert total < TREE_LIMIT_BYTES, (
        f"tracked files: {total / 1e6:.1f} MB > {TREE_LIMIT_BYTES / 1e6:.0f} MB; every GPU device call "
        f"carries them (64 MiB with the data and checkpoints). Largest: {biggest}"
    )


def test_queue_parses_and_every_slice_has_minutes_and_exact_runs(gs):
    slices = gs.slices.load_queue()
    assert [s.id for s in slices if s.auto] == [
        "smoke-probe", "smoke-llama", "bench-lean", "llm-sizes", "llm-1b", "mnist-hfcg-s0", "mnist-shf-s0",
        "bench", "mnist-paper", "mnist-shf-seeds",
    ]  # fmt: skip
    for s in slices:
        assert 0 < s.gpu_minutes <= 13, s.id  # a session has 15 device minutes, a start costs 1-2
        assert s.runs and s.title, s.id
        assert s.work_s + s.grace_s < 600, s.id  # one command runs at most 10 minutes
        assert set(s.wheels) <= set(gs.run.MODULES), s.id
        for run in s.runs:
            if run.kind == "module":
                assert importlib.util.find_spec(run.spec["module"]) is not None, run.id
                continue
            assert (ROOT / "conf" / "optimizer" / f"{run.spec['optimizer']}.yaml").exists(), run.id
            if run.config_name:
                assert (ROOT / "conf" / "experiment" / f"{run.config_name}.yaml").exists(), run.id
    by_id = {s.id: s for s in slices}
    probe = [r for r in by_id["smoke-probe"].runs if r.kind == "train"]
    assert {(r.spec["optimizer"], r.spec["tf32"]) for r in probe} == {
        (o, t) for o in ("shf_lsmr", "hf_cg") for t in (True, False)
    }
    assert all(r.rel_dir().startswith("results/gpu_probe/shf_fig2_mnist/") for r in probe)
    mnist = [(r.spec["optimizer"], r.spec["seed"]) for r in by_id["mnist-paper"].runs]
    assert mnist == [("hf_cg", s) for s in range(1, 5)]
    # seed 0 of each method alone, one call each (completed records; no checkpoint kept between leases)
    for sid, optimizer in (("mnist-hfcg-s0", "hf_cg"), ("mnist-shf-s0", "shf_lsmr")):
        (run,) = by_id[sid].runs
        assert (run.spec["optimizer"], run.spec["seed"], by_id[sid].phases[0].parallel) == (optimizer, 0, 1)
    # two at a time: $OUT takes back two MNIST checkpoints, and six shared the GPU at 1.4x one's rate
    assert by_id["mnist-paper"].phases[0].parallel == by_id["mnist-shf-seeds"].phases[0].parallel == 2
    # the lean steps beside the paths they replace, with their synchronising calls counted
    lean = {r.id: r.spec for r in by_id["bench-lean"].runs}
    assert {"racs", "racs_loop", "alice", "alice_loop", "adamw_fused", "galore"} <= set(
        lean["bench-optim-lean"]["args"]
    )
    assert "trainer.deterministic=false" in lean["probe-hfcg-nondeterministic"]["overrides"]
    # Figure 4's memory (batch 1 x 256) at the four sizes
    llm = {r.id: r.spec for r in by_id["llm-sizes"].runs}
    assert llm["fig4-memory"]["args"][:8] == [
        "--profile",
        "paper",
        "--sizes",
        "60m",
        "130m",
        "350m",
        "1b",
        "--jobs",
    ]
    # the C4 loader streams through HF datasets, which the device image lacks
    assert {"datasets", "dill", "multiprocess"} <= set(by_id["smoke-llama"].wheels)
    # the paper drivers' run ids and folders, so the figures read these runs
    assert by_id["mnist-hfcg-s0"].runs[0].rel_dir() == "results/shf_fig2_mnist/hf_cg_paper_s0"
    assert by_id["mnist-paper"].runs[0].config_name == "shf_fig2_mnist_paper"
    assert {r.spec["optimizer"] for r in by_id["fosi-lm-paper"].runs} == {
        "heavy_ball", "fosi_heavy_ball", "adam", "fosi_adam",
    }  # fmt: skip
    assert [r.spec["seed"] for r in by_id["mnist-shf-seeds"].runs] == [1, 2, 3, 4]
    assert not by_id["cpu-test"].auto and by_id["cpu-test"].cpu


def test_ledger_picks_the_first_slice_not_done(gs, tmp_path):
    slices = gs.slices.load_queue()
    ledger = tmp_path / "ledger.md"
    assert gs.ledger.next_slice(slices, ledger).id == "smoke-probe"
    row = {
        "slice": "smoke-probe",
        "status": "partial",
        "date": "d",
        "gpu_min": "9",
        "device": "H100",
        "produced": "x",
    }
    gs.ledger.append_ledger(ledger, row)
    assert gs.ledger.next_slice(slices, ledger).id == "smoke-probe"  # partial: again
    gs.ledger.append_ledger(ledger, {**row, "status": "done"})
    assert gs.ledger.next_slice(slices, ledger).id == "smoke-llama"
    gs.ledger.append_ledger(ledger, {**row, "slice": "smoke-llama", "status": "done"})
    assert gs.ledger.next_slice(slices, ledger).id == "bench-lean"
    gs.ledger.append_ledger(ledger, {**row, "slice": "bench-lean", "status": "skip"})
    assert gs.ledger.next_slice(slices, ledger).id == "llm-sizes"
    assert [r["status"] for r in gs.ledger.read_ledger(ledger)] == ["partial", "done", "done", "skip"]
    names = [s.id for s in sorted(slices, key=lambda s: s.order) if s.auto]
    assert names.index("mnist-hfcg-s0") < names.index("bench")  # fosi-lm-paper is not picked automatically
    gs.ledger.read_ledger(ROOT / "docs" / "gpu_ledger.md")  # the committed one parses


def _wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the slice ended early ({proc.returncode}): {proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"timed out: {proc.stdout.read() if proc.stdout else ''}")


def test_cpu_slice_whole_path_fake_out_unpack_and_tampering(gs, tmp_path):
    """bash tools/gpu_slice.sh cpu-test: two tiny runs; one completes, the other is stopped (SIGTERM to
    the slice, as at its deadline) and checkpoints; $OUT holds the records, its checkpoint, logs and a
    manifest within the device's limits; unpack verifies and extracts; a changed byte is refused."""
    results, out = tmp_path / "device" / "results", tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(out),
        "GPU_SLICE_WORK_S": "90",
        "GPU_SLICE_TMP": str(tmp_path / "work"),
        "GPU_SLICE_RESULTS": str(results),
        "GPU_SLICE_CARRY": str(tmp_path / "no_carry"),
        "GPU_SLICE_LEDGER": str(tmp_path / "ledger.md"),
    }
    long_dir = results / "gpu_selftest" / "default" / "adam_quick_s0_long"
    done_sum = results / "gpu_selftest" / "default" / "adam_quick_s0_done" / "summary.json"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "cpu-test"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for(
        lambda: (
            (long_dir / "checkpoint.pt").exists()
            and done_sum.exists()
            and json.loads(done_sum.read_text()).get("status") == "completed"
        ),
        90,
        proc,
    )
    proc.send_signal(signal.SIGTERM)  # what the deadline does to the runs
    text, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, text

    files = sorted(p.name for p in out.iterdir())
    assert {"manifest.json", "slice.log", "results.tar.gz", "logs.tar.gz", "checkpoints.tar"} <= set(files), (
        files
    )
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert all((out / f).stat().st_size <= 16 * 2**20 for f in files)
    man = json.loads((out / "manifest.json").read_text())
    assert man["slice"] == "cpu-test" and man["status"] == "partial"
    assert man["device"]["torch"] and "device_name" in man["device"]
    runs = {r["id"]: r for r in man["runs"]}
    assert runs["tiny-done"]["status"] == "completed" and runs["tiny-done"]["steps"] == 5
    long = runs["tiny-long"]
    assert long["status"] == "interrupted" and long["stop_reason"] == "sigterm" and long["sigterm"]
    assert long["checkpoint_step"] == long["steps"] > 0  # the trainer checkpointed on SIGTERM
    assert long["facts"]["float32_matmul_precision"] == "high" and long["facts"]["tf32_setting"] == "on"
    assert long["concurrent_with"] == ["tiny-done"]
    records = man["archives"]["results"]["members"]
    assert not any(n.endswith(".pt") for n in records)
    assert "results/gpu_selftest/default/adam_quick_s0_long/gpu_slice.json" in records
    assert any(n.startswith("results/gpu_slices/cpu-test/") and n.endswith(".md") for n in records)
    ckpts = man["archives"]["checkpoints"]["members"]
    assert "results/gpu_selftest/default/adam_quick_s0_long/checkpoint.pt.gz" in ckpts
    assert not any("adam_quick_s0_done" in n for n in ckpts)  # finished runs need none
    side = json.loads((long_dir / "gpu_slice.json").read_text())["segments"][-1]
    assert side["dtype"] == "float32" and side["torch"] and "device_name" in side

    # unpack into a copy of the repository's layout
    repo = tmp_path / "repo"
    ledger = tmp_path / "repo_ledger.md"
    assert gs.cli.main(["--ledger", str(ledger), "unpack", str(out), "--root", str(repo), "--no-after"]) == 0
    got = repo / "results" / "gpu_selftest" / "default" / "adam_quick_s0_long"
    assert (got / "summary.json").read_bytes() == (long_dir / "summary.json").read_bytes()
    assert (got / "checkpoint.pt").read_bytes() == (long_dir / "checkpoint.pt").read_bytes()
    assert gs.ledger.read_ledger(ledger)[-1]["status"] == "partial"
    assert (repo / "outputs" / "gpu_slices" / "cpu-test").is_dir()

    # a damaged transfer: one byte of the records archive changed
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in files:
        (bad / f).write_bytes((out / f).read_bytes())
    data = bytearray((bad / "results.tar.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "results.tar.gz").write_bytes(bytes(data))
    fresh = tmp_path / "fresh"
    assert gs.cli.main(["--ledger", str(ledger), "unpack", str(bad), "--root", str(fresh), "--no-after"]) == 2
    assert not fresh.exists()
    # a changed member whose archive checksum was recomputed: the member's sha256 catches it
    buf = io.BytesIO()
    with tarfile.open(out / "results.tar.gz") as src, tarfile.open(fileobj=buf, mode="w:gz") as dst:
        for m in src:
            content = src.extractfile(m).read()
            if m.name.endswith("adam_quick_s0_long/summary.json"):
                content = content.replace(b'"interrupted"', b'"completed"  ')
                m.size = len(content)
            dst.addfile(m, io.BytesIO(content))
    (bad / "results.tar.gz").write_bytes(buf.getvalue())
    man["files"]["results.tar.gz"] = {
        "sha256": gs.common.sha256_file(bad / "results.tar.gz"),
        "bytes": len(buf.getvalue()),
    }
    (bad / "manifest.json").write_text(json.dumps(man))
    assert gs.cli.main(["--ledger", str(ledger), "unpack", str(bad), "--root", str(fresh), "--no-after"]) == 2
    assert not fresh.exists() and len(gs.ledger.read_ledger(ledger)) == 1


def test_deadline_sigterms_the_runs_then_kills_what_ignores_it(gs, tmp_path, monkeypatch):
    (tmp_path / "sleeper.py").write_text(
        "import signal, sys, time\n"
        "if sys.argv[1] == 'stubborn':\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(60)\n"
    )
    queue = tmp_path / "queue.yaml"
    queue.write_text(
        "slices:\n"
        "  - {id: dl, order: 1, cpu: true, gpu_minutes: 1, title: t, work_s: 1, grace_s: 1, min_left_s: 0,\n"
        "     phases: [{name: p, parallel: 2, runs: [{id: polite, module: sleeper, args: [polite]},\n"
        "                                             {id: stubborn, module: sleeper, args: [stubborn]}]},\n"
        "              {name: later, runs: [{id: never, module: sleeper, args: [polite]}]}]}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "out"
    t0 = time.time()
    code = gs.cli.main(
        ["--queue", str(queue), "--ledger", str(tmp_path / "l.md"), "run", "dl", "--out", str(out),
         "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results"), "--carry", str(tmp_path / "c")]
    )  # fmt: skip
    assert code == 0 and time.time() - t0 < 30
    runs = {r["id"]: r for r in json.loads((out / "manifest.json").read_text())["runs"]}
    assert (
        runs["polite"]["sigterm"] and not runs["polite"]["sigkill"] and runs["polite"]["status"] == "stopped"
    )
    assert runs["stubborn"]["sigkill"]
    assert runs["never"]["action"] == "not-started"
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"


def test_carry_takes_only_the_slice_and_refuses_over_the_limit(gs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gs.carry, "CACHE", tmp_path / "cache")
    data = tmp_path / "data"
    (data / "mnist").mkdir(parents=True)
    import gzip

    (data / "mnist" / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(10000)))
    (data / "tiny_shakespeare").mkdir()
    (data / "tiny_shakespeare" / "input.txt").write_text("to be or not to be\n" * 20000)
    (data / "other").mkdir()
    (data / "other" / "big.bin").write_bytes(os.urandom(2**20))
    wheels = tmp_path / "wh"
    wheels.mkdir()
    (wheels / "hydra_core-1.3.8-py3-none-any.whl").write_bytes(b"w" * 1000)
    (wheels / "omegaconf-2.3.1-py3-none-any.whl").write_bytes(b"w" * 1000)
    results = tmp_path / "results"
    run_dir = results / "shf_fig2_mnist" / "hf_cg_paper_s0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted", "steps": 3}))
    (run_dir / "checkpoint.pt").write_bytes(os.urandom(2**20))
    queue = tmp_path / "queue.yaml"
    queue.write_text(
        "slices:\n"
        "  - {id: c, order: 1, gpu_minutes: 5, title: t, wheels: [hydra-core], data: [mnist, tiny_shakespeare],\n"
        "     phases: [{name: p, runs: [{id: r0, experiment: shf_fig2_mnist, profile: paper, optimizer: hf_cg,\n"
        "                                seed: 0, checkpoint: true}]}]}\n"
    )
    tree = sum(gs.carry.tree_bytes(ROOT).values()) / 2**20

    def carry(limit: float, *extra: str) -> int:
        try:
            return gs.cli.main(
                ["--queue", str(queue), "carry", "c", "--dest", str(tmp_path / "carry"), "--results", str(results),
                 "--data-dir", str(data), "--wheels-from", str(wheels), "--no-fetch", "--limit-mib", str(limit), *extra]
            )  # fmt: skip
        except SystemExit as stop:
            print(stop.code)
            return 2

    assert carry(tree + 3) == 0  # room for the checkpoint (1 MiB, gzip cannot shrink random bytes)
    printed = capsys.readouterr().out
    assert "bash tools/gpu_slice.sh c" in printed and "carry:" in printed
    c = tmp_path / "carry"
    plan = json.loads((c / "plan.json").read_text())
    assert [p.name for p in (c / "wheels").iterdir()] == ["hydra_core-1.3.8-py3-none-any.whl"]
    assert (c / "data" / "mnist" / "t10k-labels-idx1-ubyte.xz").exists()  # raw bytes, xz
    assert (c / "data" / "tiny_shakespeare" / "input.txt.xz").exists()
    assert not (c / "data" / "other").exists()
    assert [k["run"] for k in plan["checkpoints"]] == ["r0"] and not plan["left_behind"]
    gs.run.unpack_data(c / "data", gs.common.Log())
    assert (c / "data" / "mnist" / "t10k-labels-idx1-ubyte").read_bytes() == bytes(10000)

    assert carry(tree + 0.5) == 2  # the checkpoint does not fit: refused
    assert "--leave-behind" in capsys.readouterr().out and not c.exists()
    assert carry(tree + 0.5, "--restart-unfit") == 0
    assert json.loads((c / "plan.json").read_text())["restart"] == ["r0"]
    assert carry(tree - 1) == 2  # the tree alone is over


def test_archives_over_15_mib_are_split_and_joined_again(gs, tmp_path, monkeypatch):
    monkeypatch.setattr(gs.pack, "PART_BYTES", 4000)
    src = tmp_path / "results" / "exp" / "run" / "metrics.jsonl"
    src.parent.mkdir(parents=True)
    src.write_bytes(os.urandom(10_000))
    out, stage = tmp_path / "out", tmp_path / "stage"
    out.mkdir()
    stage.mkdir()
    members = gs.pack._tar(
        [(src, "results/exp/run/metrics.jsonl")], tmp_path / "results.tar.gz", compress=True
    )
    parts = gs.pack._split(tmp_path / "results.tar.gz", out)
    assert [p.name for p in parts] == [f"results.tar.gz.part0{i}" for i in range(3)]
    man = {
        "files": {p.name: {"sha256": gs.common.sha256_file(p), "bytes": p.stat().st_size} for p in parts},
        "archives": {"results": {"members": members, "parts": [p.name for p in parts]}},
    }
    (out / "manifest.json").write_text(json.dumps(man))
    gs.unpack.verify_and_stage(out, stage)
    assert (stage / "results" / "results" / "exp" / "run" / "metrics.jsonl").read_bytes() == src.read_bytes()
    (out / "results.tar.gz.part01").unlink()
    with pytest.raises(gs.common.Refused, match="missing"):
        gs.unpack.verify_and_stage(out, tmp_path)


def test_every_train_run_of_the_queue_composes_to_its_folder(gs):
    """The exact overrides the runner passes compose (schema-checked) to the experiment folder and
    run id that the paper drivers (experiments.runs) and figures use."""
    from hydra import compose, initialize_config_dir

    from curvopt.training.schema import register_schemas
    from experiments.runs import run_id_for

    register_schemas()
    seen = set()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        _compose_all(
            gs, seen, lambda overrides: compose(config_name="config", overrides=overrides), run_id_for
        )
    assert len(seen) >= 8


def _compose_all(gs, seen, compose_config, run_id_for) -> None:
    for s in gs.slices.load_queue():
        for r in s.runs:
            spec = r.spec
            if r.kind != "train":
                continue
            key = (r.config_name, spec["optimizer"], tuple(spec.get("overrides", [])), spec.get("checkpoint"))
            if key in seen:  # seeds and TF32 change no composition: once each
                continue
            seen.add(key)
            cfg = compose_config(
                [
                    *([f"experiment={r.config_name}"] if r.config_name else []),
                    f"optimizer={spec['optimizer']}",
                    f"seed={spec.get('seed', 0)}",
                    f"run_id={r.run_id}",
                    "logger=none",
                    *(
                        [f"trainer.checkpoint_every_s={s.checkpoint_every_s:g}"]
                        if spec.get("checkpoint")
                        else []
                    ),
                    *spec.get("overrides", []),
                ]
            )
            assert cfg.experiment_name == spec["experiment"], r.id
            profile = spec.get("profile", "quick")
            assert r.run_id == run_id_for(spec["optimizer"], profile, spec.get("seed", 0), spec.get("suffix"))
            assert cfg.profile == profile, r.id
            assert cfg.trainer.device == ("cpu" if s.cpu else "cuda"), r.id


# Each step of the slice's path imports alone (issue 45): only the modules below it, neither torch nor
# PyYAML at import time (the device machine has the carried wheels and the repository, nothing more).
ALONE = {
    "common": set(),
    "slices": {"common"},
    "ledger": {"common", "slices"},
    "carry": {"common", "slices", "ledger"},
    "facts": set(),
    "report": {"common", "slices"},
    "pack": {"common"},
    "run": {"common", "slices", "ledger", "facts", "report", "pack"},
    "unpack": {"common", "slices", "ledger"},
}


@pytest.mark.parametrize("name", sorted(ALONE))
def test_each_step_of_the_path_imports_alone(name):
    code = (
        f"import json, sys, tools.gpu.{name}; "
        "print(json.dumps([sorted(m[len('tools.gpu.'):] for m in sys.modules if m.startswith('tools.gpu.')), "
        "sorted(m for m in ('torch', 'yaml') if m in sys.modules)]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules, heavy = json.loads(done.stdout)
    assert set(modules) == ALONE[name] | {name}
    assert heavy == []
