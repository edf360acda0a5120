"""Which runs make up each table and figure of the RACS/Alice LLM experiments.

A run is (experiment, optimizer config, last-layer choice, seed, profile). The experiment holds
the model size: ``alice_c4`` is the quick profile (a small LLaMA on the C4 sample, CPU) and
``alice_c4_<size>`` (config ``alice_c4_<size>_paper``) the paper's sizes. Runs carry
``tag=<method key>`` so the figures find them in the records without parsing run ids.

"Head" is who trains the last layer (``lm_head``): ``method`` = the candidate optimizer (the
paper's main criterion, "Ppl."), ``adam`` = full-rank Adam ("Ppl.*", "+lm head").
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAPER_SIZES = ("60m", "130m", "350m", "1b")
QUICK_SIZE = "tiny"

# optimizer-config key that puts lm_head in the method's group (true) or Adam's (false)
# (curvopt.optim.grouping, conf/optimizer/{galore,fira,alice,alice0}.yaml).
HEAD_KEY = "optimizer.lm_head_in_method"


@dataclass(frozen=True)
class Method:
    key: str  # tag in the records and row id in tables
    optimizer: str  # conf/optimizer/<name>.yaml
    head: str  # "method" | "adam"
    label: str
    overrides: tuple[str, ...] = field(default_factory=tuple)
    low_rank: bool = False  # has a head choice (GaLore-style grouping)

    @property
    def suffix(self) -> str | None:
        return "head_adam" if self.low_rank and self.head == "adam" else None

    def run_overrides(self) -> list[str]:
        out = [f"tag={self.key}", *self.overrides]
        if self.low_rank:
            out.append(f"{HEAD_KEY}={'true' if self.head == 'method' else 'false'}")
        return out


def _pair(name: str, label: str) -> list[Method]:
    return [
        Method(name, name, "method", label, low_rank=True),
        Method(f"{name}+head", name, "adam", f"{label} (+lm head)", low_rank=True),
    ]


TABLE2_METHODS: list[Method] = [
    Method("adam", "adam", "adam", "Adam"),
    *_pair("galore", "GaLore"),
    *_pair("fira", "Fira"),
    Method("racs", "racs", "adam", "RACS"),
    *_pair("alice0", "Alice-0"),
    *_pair("alice", "Alice"),
]

# Figure 5 / Table 5 (paper §7.2, §F.7; docs/decisions.md RACS-24): Alice components on the
# candidate-trained last layer.
# The override keys are the Alice config's flags (curvopt.optim.alice).
ABLATION_METHODS: list[Method] = [
    Method(
        "alice_no_track_switch_comp",
        "alice",
        "method",
        "no tracking, switch, compensation",
        ("optimizer.betas=[0.9,0.9,0.0]", "optimizer.switch=none", "optimizer.compensation=none"),
        low_rank=True,
    ),
    Method(
        "alice_track",
        "alice",
        "method",
        "tracking",
        ("optimizer.switch=none", "optimizer.compensation=none"),
        low_rank=True,
    ),
    Method(
        "alice_track_switch",
        "alice",
        "method",
        "tracking + switch",
        ("optimizer.compensation=none",),
        low_rank=True,
    ),
    Method("alice", "alice", "method", "tracking + switch + compensation (Alice)", low_rank=True),
    Method(
        "alice_switch_gaussian",
        "alice",
        "method",
        "switch: Gaussian",
        ("optimizer.switch=gaussian", "optimizer.compensation=none"),
        low_rank=True,
    ),
    Method(
        "alice_switch_gaussian_mix",
        "alice",
        "method",
        "switch: Gaussian mix",
        ("optimizer.switch=gaussian_mix", "optimizer.compensation=none"),
        low_rank=True,
    ),
    Method(
        "alice_switch_full_basis",
        "alice",
        "method",
        "switch: full basis",
        ("optimizer.switch=full_basis", "optimizer.compensation=none"),
        low_rank=True,
    ),
    Method(
        "alice_comp_fira",
        "alice",
        "method",
        "compensation: Fira",
        ("optimizer.compensation=fira",),
        low_rank=True,
    ),
    Method(
        "alice_comp_fira_plus",
        "alice",
        "method",
        "compensation: Fira+",
        ("optimizer.compensation=fira_plus",),
        low_rank=True,
    ),
    Method("racs", "racs", "adam", "RACS"),
    Method("racs_no_ema", "racs", "adam", "RACS without EMA (beta=0)", ("optimizer.beta=0.0",)),
]

FIG5_PANELS: dict[str, list[str]] = {
    "a_tracking": ["alice_no_track_switch_comp", "alice_track", "alice_track_switch"],
    "b_switching": [
        "alice_track_switch",
        "alice_switch_gaussian",
        "alice_switch_gaussian_mix",
        "alice_switch_full_basis",
    ],
    "c_compensation": ["alice_track_switch", "alice_comp_fira", "alice_comp_fira_plus", "alice"],
    "d_last_layer": ["alice", "alice+head", "galore", "galore+head", "fira", "fira+head"],
    "e_racs_ema": ["racs", "racs_no_ema"],
}
TABLE5_ROWS = ["alice_no_track_switch_comp", "alice_track", "alice_track_switch", "alice"]


def experiment_for(size: str) -> str:
    """Records folder of a model size (``tiny`` = the quick profile)."""
    return "alice_c4" if size == QUICK_SIZE else f"alice_c4_{size}"


def ablation_experiment_for(size: str) -> str:
    return "alice_c4_ablation" if size == QUICK_SIZE else f"alice_c4_{size}_ablation"


def sizes_for(profile: str, sizes: list[str] | None = None) -> list[str]:
    if profile == "quick":
        return [QUICK_SIZE]
    return list(sizes or PAPER_SIZES)


def method_by_key(key: str) -> Method:
    for m in (*TABLE2_METHODS, *ABLATION_METHODS):
        if m.key == key:
            return m
    raise KeyError(key)
