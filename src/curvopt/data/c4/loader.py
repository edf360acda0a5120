"""The dataset target ``load_c4`` (``conf/dataset/c4.yaml``): C4 as a :class:`~curvopt.api.DataBundle`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from curvopt.api import DataBundle
from curvopt.data.c4.sequences import IGNORE_INDEX, VocabMap, next_token_labels, tokenize_split
from curvopt.data.c4.sources import document_dataset, iter_texts, missing_message
from curvopt.data.c4.stream import C4TrainStream
from curvopt.data.c4.tokenizer import load_tokenizer, special_ids
from curvopt.errors import DataNotFoundError

log = logging.getLogger(__name__)


def load_c4(
    data_dir: str,
    max_length: int = 256,
    packing: bool = False,
    tokenizer: str = "t5-base",
    source: str = "auto",
    streaming: bool = False,
    num_train_docs: int | None = None,
    num_val_docs: int | None = None,
    val_tokens: int | None = None,
    shuffle_seed: int | None = 42,
    shuffle_buffer: int = 10_000,
    vocab_limit: int | None = None,
    max_positions: int | None = None,
    resume_mode: str = "skip",
    prefetch: int = 2048,
) -> DataBundle:
    """C4 as a :class:`DataBundle`: train in memory or as a stream, validation in memory.

    Args:
        data_dir: Data directory.
        max_length: Sequence length T (GaLore: 256).
        packing: Pack documents into full windows instead of one padded document per sequence.
        tokenizer: Tokenizer name or path (:func:`load_tokenizer`).
        source: ``"auto"``, ``"local"`` or ``"hub"`` (:func:`document_dataset`).
        streaming: Serve the training data as a :class:`C4TrainStream` (paper scale) instead of
            in memory.
        num_train_docs: Training documents kept in memory (required for an in-memory hub
            split).
        num_val_docs: Validation document cap.
        val_tokens: Evaluation token budget (paper: 10M non-pad tokens); with neither this nor
            ``num_val_docs``, all local validation documents are used (the hub split needs a
            budget).
        shuffle_seed: Document shuffle seed (GaLore: 42).
        shuffle_buffer: Streaming shuffle buffer size.
        vocab_limit: Compact vocabulary size (quick profile only; :class:`VocabMap`).
        max_positions: The model's position count; caps ``max_length`` — a longer configured
            length is truncated to it with a warning, never a crash in the model.
        resume_mode: Stream resume mode (:class:`C4TrainStream`).
        prefetch: Sequences the stream's producer queues ahead.

    Returns:
        The bundle: ``train`` in memory or ``train_stream``, ``val`` in memory, no ``test``;
        ``meta`` records sources, token counts and the vocabulary map.

    Raises:
        ValueError: If ``max_length < 2`` or a hub split lacks a size.
        DataNotFoundError: If data or tokenizer are unavailable, or a split is empty.
        CorruptDataError: If local files are unreadable.
    """
    max_length = _sequence_length(max_length, max_positions)
    tok = load_tokenizer(data_dir, tokenizer)
    pad, eos, unk = special_ids(tok)
    docs = _Documents.locate(data_dir, source, shuffle_seed, shuffle_buffer)
    if not streaming and num_train_docs is None and docs.train_info["source"] == "hub":
        raise ValueError("in-memory C4 from the hub needs num_train_docs (or streaming=true)")
    if val_tokens is None and num_val_docs is None and docs.val_info["source"] == "hub":
        raise ValueError("C4 validation from the hub needs val_tokens (paper: 10_000_000) or num_val_docs")
    meta: dict[str, Any] = {
        "name": "c4",
        "synthetic": False,
        "source": docs.train_info["source"],
        "train_files": docs.train_info["files"],
        "val_files": docs.val_info["files"],
        "tokenizer": tokenizer,
        "max_length": max_length,
        "packing": packing,
        "pad_id": pad,
        "eos_id": eos,
        "ignore_index": IGNORE_INDEX,
        "streaming": streaming,
    }
    train_ids = train_mask = None
    if not streaming or vocab_limit is not None:  # the vocabulary is counted on in-memory documents
        train_ids, train_mask = _tokenize_train(docs, tok, max_length, packing, num_train_docs, meta)
    vocab_map = _compact_vocabulary(train_ids, train_mask, vocab_limit, len(tok), (pad, eos, unk), meta)
    val = _validation_split(docs, tok, max_length, num_val_docs, val_tokens, vocab_map, unk, meta)
    if streaming:
        stream = C4TrainStream(
            docs.factory("train"),
            tok,
            max_length,
            packing,
            data_dir,
            vocab_map=vocab_map,
            prefetch=prefetch,
            resume_mode=resume_mode,
            docs_per_epoch=meta.get("train_docs") if docs.train_info["source"] == "local" else None,
            local_files=docs.local_files("train"),
        )
        log.info(
            "C4: streaming training data (%s), %d validation sequences",
            docs.train_info["source"],
            val[0].shape[0],
        )
        return DataBundle(train=None, val=val, test=None, meta=meta, train_stream=stream)
    assert train_ids is not None and train_mask is not None
    train = _in_memory_train(train_ids, train_mask, vocab_map, meta)
    log.info(
        "C4: %d training and %d validation sequences of %d tokens (%s)",
        train[0].shape[0],
        val[0].shape[0],
        max_length,
        docs.train_info["source"],
    )
    return DataBundle(train=train, val=val, test=None, meta=meta)


# -- the phases of load_c4 ---------------------------------------------------------------------------
def _sequence_length(max_length: int, max_positions: int | None) -> int:
    """T, capped at the model's positions: a longer configured length must not crash the model."""
    if max_positions is not None and max_length > max_positions:
        log.warning(
            "C4 max_length %d exceeds the model's %d positions; truncating sequences to %d",
            max_length,
            max_positions,
            max_positions,
        )
        max_length = int(max_positions)
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one input and one target), got {max_length}")
    return max_length


@dataclass
class _Documents:
    """Both splits' document sources: how to open a split's stream, and where it comes from.

    Opening is cheap (the datasets stream lazily), so each consumer opens its own stream from
    :meth:`factory`: the in-memory tokenisation, the validation split and the training stream
    (which reopens it for every epoch and rank).
    """

    data_dir: str
    source: str
    shuffle_seed: int | None
    shuffle_buffer: int
    train_info: dict[str, Any]
    val_info: dict[str, Any]

    @classmethod
    def locate(cls, data_dir: str, source: str, shuffle_seed: int | None, shuffle_buffer: int) -> _Documents:
        """Resolve both splits' sources (local files or the hub) before any tokenisation."""
        _, train_info = document_dataset(data_dir, "train", source, shuffle_seed, shuffle_buffer)
        _, val_info = document_dataset(data_dir, "validation", source, shuffle_seed, shuffle_buffer)
        return cls(data_dir, source, shuffle_seed, shuffle_buffer, train_info, val_info)

    def factory(self, split: str) -> Callable[[int, int, int], Any]:
        """``(epoch, rank, world_size) -> document stream`` of a split (shuffled, then sharded)."""

        def make(epoch: int = 0, rank: int = 0, world_size: int = 1) -> Any:
            return document_dataset(
                self.data_dir,
                split,
                self.source,
                self.shuffle_seed,
                self.shuffle_buffer,
                epoch,
                rank,
                world_size,
            )[0]

        return make

    def local_files(self, split: str) -> list[str] | None:
        """The local files behind a split, for error messages; ``None`` for the hub."""
        info = self.train_info if split == "train" else self.val_info
        return list(info["files"]) if info["source"] == "local" else None

    def texts(self, split: str) -> Iterator[str]:
        """The texts of one pass (epoch 0, a single rank) over a split."""
        return iter_texts(self.factory(split)(), self.data_dir, self.local_files(split))


def _tokenize_train(
    docs: _Documents,
    tok: Any,
    max_length: int,
    packing: bool,
    num_train_docs: int | None,
    meta: dict[str, Any],
) -> tuple[Tensor, Tensor]:
    """The in-memory training split (GaLore's padding, or packing); records ``train_docs``."""
    train_ids, train_mask, used = tokenize_split(
        tok, docs.texts("train"), max_length, packing, max_docs=num_train_docs
    )
    if train_ids.shape[0] == 0:
        raise DataNotFoundError(missing_message(docs.data_dir, "the C4 training split is empty"))
    meta["train_docs"] = used
    return train_ids, train_mask


def _compact_vocabulary(
    train_ids: Tensor | None,
    train_mask: Tensor | None,
    vocab_limit: int | None,
    source_size: int,
    specials: tuple[int, int, int],
    meta: dict[str, Any],
) -> VocabMap | None:
    """The quick profile's :class:`VocabMap`, counted on the non-pad training tokens; records ``vocab_size``."""
    vocab_map = None
    vocab_size = source_size
    if vocab_limit is not None:
        assert train_ids is not None and train_mask is not None
        pad, eos, unk = specials
        vocab_map = VocabMap.from_counts(
            train_ids[train_mask.bool()], vocab_limit, source_size, [pad, eos, unk], unk
        )
        vocab_size = vocab_map.size
        meta["vocab_map"] = {"limit": vocab_limit, "kept": vocab_map.size}
    meta["vocab_size"] = vocab_size
    return vocab_map


def _inputs_and_targets(ids: Tensor, mask: Tensor, vocab_map: VocabMap | None) -> tuple[Tensor, Tensor]:
    """``(x, y)``: ids in the (compact) vocabulary and their next-token targets, −100 on padding."""
    if vocab_map is not None:
        ids = vocab_map(ids)
    return ids, next_token_labels(ids, mask)


def _validation_split(
    docs: _Documents,
    tok: Any,
    max_length: int,
    num_val_docs: int | None,
    val_tokens: int | None,
    vocab_map: VocabMap | None,
    unk: int,
    meta: dict[str, Any],
) -> tuple[Tensor, Tensor]:
    """Validation in memory, always one padded document per sequence (GaLore's evaluation).

    Records the documents and non-pad tokens used and, with a compact vocabulary, the fraction
    of validation tokens it maps to ``<unk>`` (against the tokenizer's own ``<unk>`` rate).
    """
    val_ids, val_mask, val_docs = tokenize_split(
        tok, docs.texts("validation"), max_length, packing=False, max_docs=num_val_docs, max_tokens=val_tokens
    )
    if val_ids.shape[0] == 0:
        raise DataNotFoundError(missing_message(docs.data_dir, "the C4 validation split is empty"))
    meta.update(val_docs=val_docs, val_tokens=int(val_mask.sum()))
    val = _inputs_and_targets(val_ids, val_mask, vocab_map)
    if vocab_map is not None:
        mask = val_mask.bool()
        meta["vocab_map"]["val_unk_fraction"] = float((val[0][mask] == vocab_map.unk_new).double().mean())
        orig_unk = float((val_ids[mask] == unk).double().mean())
        meta["vocab_map"]["val_unk_fraction_before"] = orig_unk
    return val


def _in_memory_train(
    train_ids: Tensor, train_mask: Tensor, vocab_map: VocabMap | None, meta: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """The in-memory training pair; records its non-pad tokens (and ``<unk>`` rate)."""
    train = _inputs_and_targets(train_ids, train_mask, vocab_map)
    meta["train_tokens"] = int(train_mask.sum())
    if vocab_map is not None:
        meta["vocab_map"]["train_unk_fraction"] = float(
            (train[0][train_mask.bool()] == vocab_map.unk_new).double().mean()
        )
    return train
