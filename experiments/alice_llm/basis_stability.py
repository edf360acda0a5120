"""Figure 6: stability of Alice's leading basis across refreshes, with and without tracking.

At every refresh of ``U`` (t = K, 2K, …) we compare, for eigenvector index i ∈ {1, 2, 4, 8} (by
descending eigenvalue), the column before and after: ``|cos(U_old[:, i], U_new[:, i])|`` (absolute
value: eigenvectors have no sign). The paper's setup is underspecified (docs/decisions.md
RACS-25); we use the Fig. 5a runs — no switching (``U`` = top-r eigenvectors of the reconstructed
``Q``), no compensation — with tracking (β3 = 0.999) and without (β3 = 0), on one middle-layer MLP
matrix (``down_proj`` of layer L/2).

The runs go through the normal entry point (records under ``results/alice_c4_basis``); the
cosines are captured by optimizer step hooks and written to
``results/alice_basis/<profile>_<variant>.csv``. At the quick profile the refresh interval is 20
(10 refreshes in 200 updates) instead of 50.

    python -m experiments.alice_llm.basis_stability --profile quick
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[2]
INDICES = (1, 2, 4, 8)
VARIANTS = {
    "tracking (beta3=0.999)": ["optimizer.betas=[0.9,0.9,0.999]"],
    "no tracking (beta3=0)": ["optimizer.betas=[0.9,0.9,0.0]"],
}


def target_param_name(model: torch.nn.Module) -> str:
    names = [n for n, _ in model.named_parameters() if n.endswith("mlp.down_proj.weight")]
    if not names:
        raise ValueError("no mlp.down_proj weight in this model")
    return names[len(names) // 2]


def attach_recorder(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, name: str, rows: list, variant: str
):
    """Step hooks that compare U before/after each refresh of ``param``'s state."""
    box: dict[str, torch.Tensor | None] = {"U": None}

    def pre(opt, args, kwargs):
        state = opt.state.get(param, {})
        box["U"] = state["U"].detach().clone().float() if "U" in state else None

    def post(opt, args, kwargs):
        state = opt.state.get(param, {})
        old, new = box["U"], state.get("U")
        if old is None or new is None or float(old.abs().sum()) == 0.0:
            return
        new = new.detach().float()
        if torch.equal(old, new):
            return  # not a refresh step
        for i in INDICES:
            if i <= new.shape[1]:
                a, b = old[:, i - 1], new[:, i - 1]
                cos = float((a @ b).abs() / (a.norm() * b.norm()).clamp_min(1e-30))
                rows.append(
                    {
                        "variant": variant,
                        "step": int(state["step"]),
                        "index": i,
                        "abs_cos": cos,
                        "param": name,
                    }
                )

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)


def run_variant(profile: str, variant: str, overrides: list[str], results: Path, rows: list) -> None:
    import curvopt.training.build as build
    from experiments.runs import compose_config

    original = build.build_algorithm

    def build_with_hooks(opt_cfg, objective, data, **kw):
        algorithm = original(opt_cfg, objective, data, **kw)
        model = objective.model
        name = target_param_name(model)
        param = dict(model.named_parameters())[name]
        attach_recorder(algorithm.optimizer, param, name, rows, variant)
        return algorithm

    exp = "alice_c4_ablation" if profile == "quick" else "alice_c4_130m_ablation_paper"
    tag = "basis_" + ("track" if "0.999" in overrides[0] else "notrack")
    cfg_overrides = [
        f"experiment={exp}",
        "optimizer=alice",
        "optimizer.switch=none",
        "optimizer.compensation=none",
        "optimizer.lm_head_in_method=true",
        *overrides,
        "experiment_name=alice_c4_basis",
        f"run_id=alice_{profile}_s0_{tag}",
        f"tag={tag}",
        f"paths.results_dir={results.resolve()}",
        "trainer.checkpoint_every=0",
        "trainer.keep_checkpoint=false",
    ]
    if profile == "quick":
        cfg_overrides.append("optimizer.update_interval=20")
    cfg = compose_config(cfg_overrides)
    build.build_algorithm = build_with_hooks
    try:
        build.run_from_config(cfg)
    finally:
        build.build_algorithm = original


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Figure 6 basis-stability runs")
    parser.add_argument("--profile", default=os.environ.get("SCALE", "quick"), choices=["quick", "paper"])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. logger=none)")
    args = parser.parse_intermixed_args(argv)
    out_dir = args.results / "alice_basis"
    out_dir.mkdir(parents=True, exist_ok=True)
    for variant, overrides in VARIANTS.items():
        slug = "track" if "0.999" in overrides[0] else "notrack"
        path = out_dir / f"{args.profile}_{slug}.csv"
        if path.exists():
            print(f"[kept] {path}")
            continue
        rows: list[dict] = []
        run_variant(args.profile, variant, [*overrides, *args.overrides], args.results, rows)
        pd.DataFrame(rows).to_csv(path, index=False)
        print(f"[ran] {path}: {len(rows)} cosines")


if __name__ == "__main__":
    main()
