"""The one entrypoint: compose a Hydra config, run it, write the run records.

python src/train.py experiment=mnist_autoencoder optimizer=adam trainer.max_steps=200
python src/train.py -m experiment=mnist_autoencoder optimizer=adam,heavy_ball optimizer.lr=1e-3,3e-3
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `curvopt` without an install

from curvopt.data.common import CorruptDataError, DataNotFoundError  # noqa: E402
from curvopt.training.build import apply_optimizer_variant, cli_value_overrides, run_from_config  # noqa: E402

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    # an experiment's optimizer_variants must not silently undo what the command line set
    cfg = apply_optimizer_variant(cfg, cli_value_overrides(hc.overrides.task, hc.runtime.choices.keys()))
    try:
        summary = run_from_config(cfg)
    except (DataNotFoundError, CorruptDataError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None
    log.info(
        "run %s: %s after %d steps -> %s",
        summary["run_id"],
        summary["status"],
        summary["steps"],
        summary["run_dir"],
    )
    best = summary.get("best") or {}
    return best.get("value")  # Hydra sweepers (e.g. Optuna) can minimise this


if __name__ == "__main__":
    main()
