"""A causal language model as the loop sees any model: ``forward(x) -> outputs``.

The outputs are scored by the generic ``cross_entropy`` loss against ``y`` with
``ignore_index = -100``.

The network is ``transformers.LlamaForCausalLM`` (no hand-written transformer). The wrapper only
moves HF's internal label shift into the model: for ``input_ids`` of shape ``(B, T)`` it returns
the logits of positions ``0 … T−2`` (shape ``(B, T−1, V)``), which predict tokens ``1 … T−1``. The
data pipeline (``curvopt.data.c4``) stores ``y = labels[:, 1:]`` with padding set to −100, so

    mean_loss(model(x), y, "cross_entropy") == LlamaForCausalLM(x, labels=labels).loss

(the token-weighted mean over non-pad targets, what GaLore trains on). Computing the head on
T−1 positions instead of T also skips the one logit row HF discards.

No attention mask is passed: sequences are right-padded, so under the causal mask no real
token attends to a pad token, and the logits at pad positions are ignored by the loss. Packed
sequences (``packing=true``) attend across document boundaries, as in the usual packed
pretraining.

``upcast_logits`` returns float32 logits from a bf16/fp16 model (HF's LLaMA does the same before its
loss); the cross-entropy then runs in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class CausalLM(nn.Module):
    """``LlamaForCausalLM`` returning next-token logits aligned with shifted labels.

    Args:
        lm: The ``LlamaForCausalLM`` (anything with ``.model``, ``.lm_head`` and ``.config``).
        upcast_logits: Return float32 logits from a bf16/fp16 model.
    """

    def __init__(self, lm: nn.Module, upcast_logits: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.upcast_logits = upcast_logits

    @property
    def config(self) -> Any:
        """The wrapped model's ``LlamaConfig``."""
        return self.lm.config

    @property
    def max_positions(self) -> int:
        """The model's number of positions (``max_position_embeddings``)."""
        return int(self.lm.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return int(self.lm.config.vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits of positions ``0 … T−2`` (predicting tokens ``1 … T−1``).

        Args:
            input_ids: ``(B, T)`` token ids, ``T`` at most :attr:`max_positions`.

        Returns:
            ``(B, T−1, V)`` logits (float32 when upcast).

        Raises:
            ValueError: If ``T`` exceeds the model's positions.
        """
        if input_ids.shape[-1] > self.max_positions:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds the model's {self.max_positions} positions; "
                "set the dataset's max_length (or max_positions) no larger than the model's"
            )
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = self.lm.lm_head(hidden[:, :-1])
        if self.upcast_logits and logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return logits

    @torch.no_grad()
    def hf_loss(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """HF's own loss on unshifted labels (for tests of the alignment).

        Args:
            input_ids: ``(B, T)`` token ids.
            labels: ``(B, T)`` labels (−100 on padding), unshifted.

        Returns:
            The scalar loss.
        """
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


def llama_config(
    vocab_size: int = 32000,
    hidden_size: int = 64,
    intermediate_size: int = 172,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    max_position_embeddings: int = 1024,
    rms_norm_eps: float = 1e-6,
    initializer_range: float = 0.02,
    **extra: Any,
) -> Any:
    """A GaLore-style ``LlamaConfig``: SiLU, untied embeddings, bos 0 / eos 1 (T5 ids), no cache.

    Args:
        vocab_size: Vocabulary size.
        hidden_size: Model width.
        intermediate_size: MLP width.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Number of attention heads.
        max_position_embeddings: Number of positions.
        rms_norm_eps: RMSNorm ε.
        initializer_range: Standard deviation of HF's normal initialisation.
        **extra: Further ``LlamaConfig`` fields.

    Returns:
        The ``transformers.LlamaConfig``.
    """
    sizes = {key: value for key, value in locals().items() if key != "extra"}  # the arguments above
    from transformers import LlamaConfig

    return LlamaConfig(
        **sizes,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        use_cache=False,
        **extra,
    )


def causal_lm(upcast_logits: bool = True, attn_implementation: str | None = None, **config: Any) -> CausalLM:
    """Build ``CausalLM(LlamaForCausalLM(llama_config(**config)))``.

    Weights come from the global RNG (HF's normal(0, initializer_range) init, as GaLore).

    Args:
        upcast_logits: As in :class:`CausalLM`.
        attn_implementation: HF attention implementation (``"eager"``, ``"sdpa"``, ...);
            ``None``: HF's default.
        **config: Keyword arguments of :func:`llama_config`.

    Returns:
        The wrapped model.
    """
    from transformers import LlamaForCausalLM

    cfg = llama_config(**config)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return CausalLM(LlamaForCausalLM(cfg), upcast_logits=upcast_logits)


def wrap_causal_lm(lm: nn.Module, upcast_logits: bool = True) -> CausalLM:
    """Wrap an already built ``LlamaForCausalLM`` (e.g. from ``curvopt.models.llama``).

    Args:
        lm: The model (returned unchanged if it is already a :class:`CausalLM`).
        upcast_logits: As in :class:`CausalLM`.

    Returns:
        The :class:`CausalLM`.
    """
    return lm if isinstance(lm, CausalLM) else CausalLM(lm, upcast_logits=upcast_logits)
