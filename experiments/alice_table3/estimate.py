"""Table 3 of the RACS/Alice paper: estimated optimizer memory of the GaLore LLaMA sizes, from the
configs alone (docs/alice.md, "Table 3 (estimated memory)").

The per-matrix state layouts of our optimizers come from the library
(:func:`curvopt.optim.grouping.method_state_numel`); the paper's own formulas and the LLaMA shapes are
this experiment's.
"""

from __future__ import annotations

from curvopt.models.llama import llama_size, matrix_shapes, other_param_numel
from curvopt.optim.grouping import method_state_numel

PAPER_RANKS = {"60m": 128, "130m": 256, "350m": 256, "1b": 512}
TABLE3_METHODS = ("adam", "galore", "fira", "apollo_mini", "apollo_svd", "racs", "alice0", "alice")


def paper_state_units(method: str, shape: tuple[int, int], rank: int) -> int:
    """Per-matrix state count in BF16 elements, the formula that reproduces the paper's Table 3.

    m = smaller, n = larger side, r = min(rank, m): Adam 2mn; GaLore/Fira/APOLLO-svd 2nr + mr;
    Alice-0 2nr + mr + n; Alice additionally 2r² for Q̃; RACS m + n + 1; APOLLO-Mini 2n + 2
    (docs/alice.md, "Table 3 (estimated memory)").

    Args:
        method: The method name.
        shape: The weight's shape.
        rank: The method's rank.

    Returns:
        The number of state elements.

    Raises:
        ValueError: If the method has no formula.
    """
    m, n = sorted(shape)
    r = min(rank, m)
    if method in ("adam", "adamw"):
        return 2 * m * n
    if method in ("galore", "fira", "apollo_svd"):
        return 2 * n * r + m * r
    if method == "alice0":
        return 2 * n * r + m * r + n
    if method == "alice":
        return 2 * n * r + m * r + n + 2 * r * r
    if method == "racs":
        return m + n + 1
    if method == "apollo_mini":
        return 2 * n + 2
    raise ValueError(f"no paper formula for {method!r}")


def estimate_memory(
    size: str,
    method: str,
    lm_head_adam: bool,
    rank: int | None = None,
    param_bytes: int = 2,
    accounting: str = "state",
) -> dict[str, float]:
    """Estimated optimizer memory of a GaLore LLaMA size, from the config alone (Table 3).

    Bytes of weights + Adam states of the Adam group + the method's states of the method group
    (docs/alice.md, "Table 3 (estimated memory)").

    Args:
        size: A LLaMA size name (``"60m"``, ``"130m"``, ``"350m"``, ``"1b"``, ...).
        method: The method; ``"adam"``/``"adamw"`` put everything on Adam.
        lm_head_adam: Keep the last layer on Adam.
        rank: The method's rank (default: the paper's rank for the size, else 128).
        param_bytes: Bytes per parameter and per non-fp32 state element (2: BF16).
        accounting: ``"state"`` sums our optimizers' own state shapes
            (:func:`method_state_numel`, fp32 tensors at 4 bytes); ``"paper"`` uses
            :func:`paper_state_units`.

    Returns:
        Bytes by component (``weights``, ``adam_states``, ``method_states``), ``total`` and
        ``total_gib`` (the paper's "G").
    """
    spec = llama_size(size)
    rank = rank if rank is not None else PAPER_RANKS.get(size.lower(), 128)
    mats = matrix_shapes(spec, lm_head=True)
    blocks = [s for name, s in mats if not name.startswith("lm_head")]
    head = next(s for name, s in mats if name.startswith("lm_head"))
    other = sum(other_param_numel(spec).values())
    weights = other + sum(a * b for a, b in blocks) + head[0] * head[1]
    adam_numel = other + (head[0] * head[1] if (lm_head_adam or method in ("adam", "adamw")) else 0)
    method_mats = list(blocks) + ([] if (lm_head_adam or method in ("adam", "adamw")) else [head])
    if method in ("adam", "adamw"):
        adam_numel = weights
        method_mats = []

    def state_bytes(shape: tuple[int, int]) -> int:
        if accounting == "paper":
            return param_bytes * paper_state_units(method, shape, rank)
        layout = method_state_numel(method, shape, rank)
        return sum(n * (4 if fp32 else param_bytes) for n, fp32 in layout.values())

    out = {
        "weights": weights * param_bytes,
        "adam_states": 2 * adam_numel * param_bytes,
        "method_states": sum(state_bytes(s) for s in method_mats),
    }
    out["total"] = out["weights"] + out["adam_states"] + out["method_states"]
    out["total_gib"] = out["total"] / 2**30
    return out
