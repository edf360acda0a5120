"""Documents to training sequences: GaLore's per-document padding, packing, next-token labels.

Also the compact vocabulary of the quick profile (:class:`VocabMap`) and the in-memory
tokenisation of a whole split under a document or token budget (:func:`tokenize_split`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


def encode_padded(tokenizer: Any, texts: list[str], max_length: int) -> tuple[Tensor, Tensor]:
    """GaLore's per-document encoding: truncate to ``max_length``, right-pad.

    Args:
        tokenizer: The tokenizer.
        texts: Documents.
        max_length: Sequence length T.

    Returns:
        ``(ids, attention_mask)``, both int64 ``(len(texts), T)``.
    """
    enc = tokenizer(texts, max_length=max_length, truncation=True, padding="max_length", return_tensors="pt")
    return enc["input_ids"].long(), enc["attention_mask"].long()


def encode_documents(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Tokenise whole documents (each ending in ``</s>``), for packing.

    Args:
        tokenizer: The tokenizer.
        texts: Documents.

    Returns:
        One list of token ids per document.
    """
    return tokenizer(texts, truncation=False, padding=False)["input_ids"]


def pack(tokens: list[int], max_length: int) -> tuple[Tensor, list[int]]:
    """Cut a token stream into full ``max_length`` windows.

    Args:
        tokens: The token stream.
        max_length: Window length T.

    Returns:
        ``(ids, leftover)``: int64 ``(n, T)`` windows and the tokens after the last full one.
    """
    n = len(tokens) // max_length
    ids = torch.tensor(tokens[: n * max_length], dtype=torch.long).view(n, max_length)
    return ids, tokens[n * max_length :]


def next_token_labels(ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Next-token targets ``y[:, t] = ids[:, t+1]``, −100 where the target is padding.

    Args:
        ids: ``(N, T)`` input ids.
        mask: ``(N, T)`` attention mask (0 on padding), or ``None``.

    Returns:
        ``(N, T−1)`` int64 targets.
    """
    y = ids[:, 1:].clone()
    if mask is not None:
        y[mask[:, 1:] == 0] = IGNORE_INDEX
    return y


class VocabMap:
    """Compact vocabulary for CPU-sized models (quick profile only; see the module docstring).

    Keeps ``keep`` (specials first) as ids ``0 … len(keep)−1``; every other id maps to ``unk``.

    Args:
        keep: Source ids kept, in their new order (specials first).
        source_size: The tokenizer's vocabulary size.
        unk_id: Source id of ``<unk>`` (must be kept).

    Raises:
        ValueError: If ``unk_id`` is not kept.
    """

    def __init__(self, keep: list[int], source_size: int, unk_id: int) -> None:
        table = torch.full((source_size,), -1, dtype=torch.long)
        table[torch.tensor(keep, dtype=torch.long)] = torch.arange(len(keep))
        self.unk_new = int(table[unk_id])
        if self.unk_new < 0:
            raise ValueError("the unk id must be kept")
        table[table < 0] = self.unk_new
        self.table = table
        self.keep = list(keep)

    @classmethod
    def from_counts(
        cls, ids: Tensor, limit: int, source_size: int, specials: list[int], unk_id: int
    ) -> VocabMap:
        """Keep the specials and the ``limit − len(specials)`` most frequent ids of ``ids``.

        Args:
            ids: Training token ids (non-pad).
            limit: Size of the compact vocabulary.
            source_size: The tokenizer's vocabulary size.
            specials: pad/eos/unk ids, placed first.
            unk_id: Source id of ``<unk>``.

        Returns:
            The :class:`VocabMap` (ids that never occur are not kept).
        """
        counts = torch.bincount(ids.reshape(-1), minlength=source_size).double()
        counts[torch.tensor(specials)] = -1  # specials are placed first, not by count
        order = torch.argsort(counts, descending=True, stable=True)
        rest = [int(i) for i in order[: max(0, limit - len(specials))] if counts[i] > 0]
        return cls(list(specials) + rest, source_size, unk_id)

    @property
    def size(self) -> int:
        """Size of the compact vocabulary."""
        return len(self.keep)

    def __call__(self, ids: Tensor) -> Tensor:
        """Map source ids to compact ids.

        Args:
            ids: Source token ids, any shape.

        Returns:
            Compact ids of the same shape (unkept ids become ``<unk>``).
        """
        return self.table[ids]

    def state_dict(self) -> dict[str, Any]:
        """The map's definition, for records.

        Returns:
            ``{"keep": [...], "source_size": int, "unk_new": int}``.
        """
        return {"keep": self.keep, "source_size": int(self.table.numel()), "unk_new": self.unk_new}


def tokenize_split(
    tokenizer: Any,
    texts: Iterable[str],
    max_length: int,
    packing: bool = False,
    max_docs: int | None = None,
    max_tokens: int | None = None,
    chunk_docs: int = 256,
) -> tuple[Tensor, Tensor, int]:
    """Tokenise documents until ``max_docs`` documents or ``max_tokens`` non-pad tokens.

    The token budget counts non-pad input tokens, as GaLore's evaluation does, and stops at the
    first document that reaches it.

    Args:
        tokenizer: The tokenizer.
        texts: Documents.
        max_length: Sequence length T.
        packing: Concatenate documents and cut full windows (:func:`pack`) instead of
            per-document padding.
        max_docs: Document cap (``None``: none).
        max_tokens: Non-pad token budget (``None``: none).
        chunk_docs: Documents tokenised per call.

    Returns:
        ``(ids, mask, documents used)`` with int64 ``(N, T)`` ids and mask.
    """
    ids_parts, mask_parts, carry = [], [], []
    used, tokens = 0, 0
    it = iter(texts)
    while True:
        want = chunk_docs if max_docs is None else min(chunk_docs, max_docs - used)
        if want <= 0 or (max_tokens is not None and tokens >= max_tokens):
            break
        batch = list(itertools.islice(it, want))
        if not batch:
            break
        if packing:
            for doc in encode_documents(tokenizer, batch):
                carry.extend(doc)
                used += 1
                tokens += len(doc)
                if max_tokens is not None and tokens >= max_tokens:
                    break
            ids, carry = pack(carry, max_length)
            ids_parts.append(ids)
            mask_parts.append(torch.ones_like(ids))
        else:
            ids, mask = encode_padded(tokenizer, batch, max_length)
            if max_tokens is not None:
                cum = tokens + mask.sum(1).cumsum(0)
                reached = torch.nonzero(cum >= max_tokens)
                if reached.numel():
                    stop = int(reached[0]) + 1
                    ids, mask = ids[:stop], mask[:stop]
            ids_parts.append(ids)
            mask_parts.append(mask)
            used += ids.shape[0]
            tokens += int(mask.sum())
    if not ids_parts:
        return torch.zeros(0, max_length, dtype=torch.long), torch.zeros(0, max_length, dtype=torch.long), 0
    return torch.cat(ids_parts), torch.cat(mask_parts), used
