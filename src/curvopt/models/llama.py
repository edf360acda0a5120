"""GaLore's LLaMA sizes as ``transformers.LlamaConfig`` presets (no hand-written transformer).

The RACS/Alice paper trains "the LLaMA configs of GaLore" (docs/alice.md). Its Table 10 prints a
wrong 1.3B row (4096/5461/24 heads/32 layers); we use GaLore's ``configs/llama_1b.json``
(2048/5461/32 heads/24 layers), which is what reproduces the paper's own parameter count
(1273M optimized by Alice + 65M by Adam) and its Table 3 (docs/decisions.md, RACS-1).

All presets share GaLore's settings: vocab 32000, SiLU, RMSNorm eps 1e-6, untied embedding and
``lm_head``, ``max_position_embeddings`` 1024, init std 0.02 (``causal_lm.llama_config``).

``build_llama(size)`` returns the bare ``LlamaForCausalLM`` (for memory accounting, benchmarks and
optimizer grouping); ``llama_lm(size)`` wraps it in :class:`~curvopt.models.causal_lm.CausalLM`,
the shifted-logits module the training loop scores (``conf/model/llama_*.yaml``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LlamaSize:
    """The four numbers that distinguish GaLore's LLaMA configs (vocab is shared).

    Attributes:
        hidden_size: Model width h.
        intermediate_size: MLP width I.
        num_hidden_layers: Number of decoder layers L.
        num_attention_heads: Number of attention heads.
        vocab_size: Vocabulary size V.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int = 32000

    def param_count(self) -> int:
        """Parameters of the untied LLaMA: ``2Vh + L(4h² + 3hI + 2h) + h``.

        Returns:
            The parameter count.
        """
        h, i, n_layers, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        return 2 * v * h + n_layers * (4 * h * h + 3 * h * i + 2 * h) + h


# GaLore configs/llama_*.json (GaLore's repository); "tiny" is a CPU test size of the same shape family.
LLAMA_SIZES: dict[str, LlamaSize] = {
    "tiny": LlamaSize(64, 172, 2, 4, vocab_size=256),
    "9m": LlamaSize(128, 352, 4, 4),
    "20m": LlamaSize(256, 688, 4, 4),
    "35m": LlamaSize(384, 1024, 6, 8),
    "60m": LlamaSize(512, 1376, 8, 8),
    "130m": LlamaSize(768, 2048, 12, 12),
    "350m": LlamaSize(1024, 2736, 24, 16),
    "1b": LlamaSize(2048, 5461, 24, 32),
}


def llama_size(size: str) -> LlamaSize:
    """Look up a preset.

    Args:
        size: A key of :data:`LLAMA_SIZES` (case-insensitive, optional ``llama_`` prefix;
            ``"1.3b"`` means ``"1b"``).

    Returns:
        The :class:`LlamaSize`.

    Raises:
        ValueError: On an unknown size.
    """
    key = size.lower().replace("llama_", "")
    if key == "1.3b":
        key = "1b"
    if key not in LLAMA_SIZES:
        raise ValueError(f"unknown LLaMA size {size!r}; choose one of {sorted(LLAMA_SIZES)}")
    return LLAMA_SIZES[key]


def llama_fields(size: str | None = None, **fields: Any) -> dict[str, Any]:
    """The ``LlamaConfig`` fields of a preset, with explicit ``fields`` winning.

    Args:
        size: A preset name, or ``None`` (then all four shape fields must be given).
        **fields: Explicit fields (``None`` values are ignored).

    Returns:
        The fields.

    Raises:
        ValueError: If shape fields are missing.
    """
    base = asdict(llama_size(size)) if size is not None else {}
    base.update({k: v for k, v in fields.items() if v is not None})
    missing = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"} - set(base)
    if missing:
        raise ValueError(f"give a size preset or all of {sorted(missing)}")
    return base


def llama_config(size: str | None = None, **fields: Any) -> Any:
    """``transformers.LlamaConfig`` for a preset (``size``) or explicit fields (GaLore defaults).

    Args:
        size: As in :func:`llama_fields`.
        **fields: As in :func:`llama_fields`.

    Returns:
        The config (:func:`curvopt.models.causal_lm.llama_config`).
    """
    from curvopt.models.causal_lm import llama_config as _galore_config

    return _galore_config(**llama_fields(size, **fields))


def build_llama(
    size: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    **fields: Any,
) -> nn.Module:
    """``LlamaForCausalLM`` of a GaLore size (or explicit fields), HF's normal(0, 0.02) init.

    Args:
        size: As in :func:`llama_fields`.
        dtype: Parameter dtype (a ``torch.dtype`` or its name), or ``None`` (float32).
        device: Device; ``"meta"`` builds the module without memory (shapes and parameter counts
            of the 1B model on a laptop).
        attn_implementation: HF attention implementation, or ``None`` for HF's default.
        **fields: As in :func:`llama_fields`.

    Returns:
        The ``LlamaForCausalLM``.
    """
    from transformers import LlamaForCausalLM

    cfg = llama_config(size, **fields)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
        if device is not None:
            model = model.to(device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def llama_lm(size: str | None = None, upcast_logits: bool = True, **fields: Any) -> nn.Module:
    """The loop's model: :class:`CausalLM` around ``build_llama(size, **fields)``.

    Args:
        size: As in :func:`build_llama`.
        upcast_logits: As in :class:`~curvopt.models.causal_lm.CausalLM`.
        **fields: Further keyword arguments of :func:`build_llama`.

    Returns:
        The wrapped model.
    """
    from curvopt.models.causal_lm import wrap_causal_lm

    return wrap_causal_lm(build_llama(size, **fields), upcast_logits=upcast_logits)


def matrix_shapes(size: str | LlamaSize, lm_head: bool = True) -> list[tuple[str, tuple[int, int]]]:
    """Names and shapes of every 2-D block weight, computed from the config (no instantiation).

    Args:
        size: A preset name or a :class:`LlamaSize`.
        lm_head: Include ``lm_head.weight``.

    Returns:
        ``(name, (out, in))`` of q, k, v, o, gate, up, down per layer (and the ``lm_head``), as
        ``nn.Linear`` stores them.
    """
    s = llama_size(size) if isinstance(size, str) else size
    h, i = s.hidden_size, s.intermediate_size
    out: list[tuple[str, tuple[int, int]]] = []
    for layer in range(s.num_hidden_layers):
        pre = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((f"{pre}.self_attn.{name}.weight", (h, h)))
        out.append((f"{pre}.mlp.gate_proj.weight", (i, h)))
        out.append((f"{pre}.mlp.up_proj.weight", (i, h)))
        out.append((f"{pre}.mlp.down_proj.weight", (h, i)))
    if lm_head:
        out.append(("lm_head.weight", (s.vocab_size, h)))
    return out


def other_param_numel(size: str | LlamaSize) -> dict[str, int]:
    """Element counts of the non-block parameters: embedding and all RMSNorm weights.

    Args:
        size: A preset name or a :class:`LlamaSize`.

    Returns:
        ``{"embedding": V·h, "norms": (2L + 1)·h}``.
    """
    s = llama_size(size) if isinstance(size, str) else size
    return {
        "embedding": s.vocab_size * s.hidden_size,
        "norms": (2 * s.num_hidden_layers + 1) * s.hidden_size,
    }
