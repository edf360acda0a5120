"""Loop overhead (data sampling + logging, evaluation excluded) as a fraction of the algorithm's
step time, for Adam on the MNIST autoencoder (784-1000-500-250-30). Target: < 5 %.

    python -m benchmarks.bench_loop_overhead --steps 300 --batch-size 256

Runs the real entrypoint code path (run_from_config) with wandb off and tqdm on/off, and
writes results/benchmarks/loop_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from curvopt.training.build import run_from_config
from curvopt.training.schema import register_schemas

ROOT = Path(__file__).resolve().parents[1]


def measure(steps: int, batch_size: int, progress: bool, logger: str) -> dict:
    register_schemas()
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            [
                "experiment=mnist_autoencoder",
                "optimizer=adam",
                f"logger={logger}",
                f"paths.results_dir={tmp}",
                f"paths.output_dir={tmp}",
                f"trainer.max_steps={steps}",
                f"trainer.batch_size={batch_size}",
                f"trainer.eval_every={steps}",
                f"trainer.progress={str(progress).lower()}",
                "trainer.eval_splits=[val]",
                "dataset.num_val=1000",
            ],
        )
        s = run_from_config(cfg)
    return {
        "progress_bar": progress,
        "logger": logger,
        "steps": s["steps"],
        "algo_time_s": s["algo_time_s"],
        "overhead_s": s["loop_overhead_s"],
        "overhead_fraction": s["loop_overhead_fraction"],
        "step_ms": 1000 * s["algo_time_s"] / s["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    rows = [
        measure(args.steps, args.batch_size, p, lg)
        for p, lg in ((False, "none"), (True, "none"), (True, "wandb"))
    ]
    print(f"{'tqdm':>5} {'logger':>6} {'step ms':>8} {'overhead':>9}")
    for r in rows:
        print(
            f"{r['progress_bar']!s:>5} {r['logger']:>6} {r['step_ms']:8.2f} {100 * r['overhead_fraction']:8.2f}%"
        )
    out = ROOT / "results" / "benchmarks" / "loop_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
