"""C4 (English) for LLaMA pretraining with the GaLore protocol the RACS/Alice paper follows.

What GaLore's ``torchrun_main.py`` does, and what this module reproduces (docs/alice_llm.md,
"Pipeline"):

* documents from ``allenai/c4`` ``en`` (train / validation), streamed and ``shuffle(seed=42)``;
* the ``t5-base`` tokenizer, ``max_length`` 256, **one document per sequence**, truncated and
  right-padded to ``max_length`` (pad id 0; the tokenizer appends ``</s>``);
* labels = input ids with padding set to −100;
* evaluation on about 10M non-pad validation tokens.

Sources, in the order tried by ``source=auto``:

1. local JSON-lines files under ``<data_dir>/c4/``: ``{train,validation}.jsonl[.gz]`` /
   ``.json[.gz]`` or the original shard names ``[en/]c4-{split}.*.json.gz`` (read through HF
   ``datasets`` in streaming mode, so the same shuffling and sharding code serves both);
2. the hub (``allenai/c4``), when the process is online.

The tokenizer comes from ``<data_dir>/tokenizers/<name>`` when that directory exists, else from
the hub. With neither data nor network the loader stops before training with a message that says
which files to put where.

Two ways to feed the loop:

* **in memory** (quick profile): tokenised sequences become ``DataBundle.train = (x, y)``;
* **streaming** (paper scale, ``streaming=true``): ``DataBundle.train_stream`` is a
  :class:`C4TrainStream` that tokenises in a background thread, shards documents across
  data-parallel ranks (``datasets.distributed.split_dataset_by_node``) and checkpoints its
  position (documents read + tokens not yet emitted), so a resumed run sees the same sequences.

``x`` holds input ids ``(N, T)``; ``y = labels[:, 1:]`` (next-token targets, −100 on padding),
shape ``(N, T−1)``, which :class:`curvopt.models.causal_lm.CausalLM` aligns with its logits.

Flags beyond GaLore: ``packing`` (concatenate documents, each ending in ``</s>``, and cut into
full ``max_length`` windows: no padding, no truncation loss) and ``vocab_limit`` (quick profile
only: keep the ``vocab_limit − 3`` most frequent training-token ids plus pad/eos/unk and map the
rest to ``<unk>``, so a CPU model does not spend 90 % of its time in a 32k-way softmax; the
fraction of tokens mapped to ``<unk>`` is recorded in ``meta``).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from curvopt.api import DataBundle
from curvopt.data.common import hub_reachable
from curvopt.errors import CorruptDataError, DataNotFoundError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
HUB_DATASET = ("allenai/c4", "en")
HUB_TOKENIZERS = {"t5-base": "google-t5/t5-base"}
SPLIT_NAMES = {"train": "train", "val": "validation", "validation": "validation"}


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------
def is_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to a true value.

    Returns:
        ``True`` unless both are unset, empty, ``0`` or ``false``.
    """
    return any(
        os.environ.get(k, "0") not in ("", "0", "false", "False")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def local_files(data_dir: str | Path, split: str) -> list[Path]:
    """Local C4 files of a split under ``<data_dir>/c4/`` (module docstring, "Sources").

    Args:
        data_dir: Data directory.
        split: ``"train"``, ``"val"`` or ``"validation"``.

    Returns:
        The files of the first matching name pattern, sorted; empty if none.
    """
    root = Path(data_dir) / "c4"
    split = SPLIT_NAMES.get(split, split)
    for pattern in (
        f"{split}.jsonl.gz",
        f"{split}.jsonl",
        f"{split}.json.gz",
        f"{split}.json",
        f"en/c4-{split}.*.json.gz",
        f"c4-{split}.*.json.gz",
    ):
        found = sorted(root.glob(pattern))
        if found:
            return found
    return []


def _missing_message(data_dir: str | Path, what: str) -> str:
    root = Path(data_dir).resolve()
    return (
        f"C4: {what}.\n"
        f"Searched: {root / 'c4'} (data) and {root / 'tokenizers'} (tokenizer).\n"
        "Put there either\n"
        f"  - {root}/c4/train.jsonl.gz and {root}/c4/validation.jsonl.gz (JSON lines with a 'text' field,\n"
        "    e.g. shards of allenai/c4 en: c4-train.00000-of-01024.json.gz, c4-validation.00000-of-00008.json.gz\n"
        f"    in {root}/c4/en/), and\n"
        f"  - the t5-base tokenizer files (tokenizer.json, tokenizer_config.json, spiece.model,\n"
        f"    special_tokens_map.json) in {root}/tokenizers/t5-base/,\n"
        "or run online (unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) to stream allenai/c4 and fetch t5-base.\n"
        "Point the project at another data directory with `paths.data_dir=...` or CURVOPT_DATA_DIR."
    )


def load_tokenizer(data_dir: str | Path, name: str = "t5-base") -> Any:
    """``AutoTokenizer`` from ``<data_dir>/tokenizers/<name>`` (or the directory ``name``) or the hub.

    ``model_max_length`` is set huge: truncation is always explicit (``max_length``), and packing
    tokenises whole documents without the long-sequence warning.

    Args:
        data_dir: Data directory.
        name: Tokenizer name (``"t5-base"`` maps to ``google-t5/t5-base`` on the hub) or path.

    Returns:
        The tokenizer.

    Raises:
        DataNotFoundError: If there is no local tokenizer and the hub is unavailable.
        CorruptDataError: If a local tokenizer directory cannot be loaded.
    """
    from transformers import AutoTokenizer

    local = Path(data_dir) / "tokenizers" / name
    for folder in (local, Path(name)):
        if folder.is_dir():
            return _local_tokenizer(AutoTokenizer, folder, data_dir)
    if not hub_reachable():
        raise DataNotFoundError(
            _missing_message(data_dir, f"no local tokenizer '{name}' and the hub is offline")
        )
    try:
        return AutoTokenizer.from_pretrained(HUB_TOKENIZERS.get(name, name), model_max_length=int(1e9))
    except Exception as err:  # network, auth, unknown name
        raise DataNotFoundError(
            _missing_message(data_dir, f"tokenizer '{name}' unavailable ({err!r})")
        ) from None


TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model", "vocab.json")


def _local_tokenizer(auto: Any, folder: Path, data_dir: str | Path) -> Any:
    """A tokenizer from a local directory; an empty or unreadable one is named, not a traceback."""
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    if not any(name in present for name in TOKENIZER_FILES):
        raise DataNotFoundError(
            _missing_message(
                data_dir,
                f"the tokenizer directory {folder.resolve()} holds no tokenizer files "
                f"(found: {', '.join(present) or 'nothing'}; expected one of {', '.join(TOKENIZER_FILES)})",
            )
        )
    try:
        return auto.from_pretrained(str(folder), model_max_length=int(1e9))
    except Exception as err:  # truncated JSON, a broken sentencepiece model, …
        raise CorruptDataError(
            f"{folder.resolve()}: the tokenizer cannot be loaded ({type(err).__name__}: {err}); one of its "
            f"files ({', '.join(present)}) is truncated or corrupt: copy the tokenizer again "
            "(e.g. huggingface-cli download google-t5/t5-base into that directory)"
        ) from None


def corrupt_c4(files: list[str] | list[Path], err: BaseException) -> CorruptDataError:
    """The error for unreadable local C4 files, naming them and what to do.

    Args:
        files: The local files.
        err: The underlying exception.

    Returns:
        The :class:`CorruptDataError` (to be raised by the caller).
    """
    listed = ", ".join(str(Path(f).resolve()) for f in files)
    return CorruptDataError(
        f"C4: cannot read {listed} ({type(err).__name__}: {err}); the file is truncated, not gzip, or not "
        "JSON lines with a 'text' field. Copy it again, or remove it to stream allenai/c4 from the hub"
    )


def document_dataset(
    data_dir: str | Path,
    split: str,
    source: str = "auto",
    shuffle_seed: int | None = 42,
    shuffle_buffer: int = 10_000,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """A streaming HF ``IterableDataset`` of C4 documents (``{"text": ...}``) and its provenance.

    Shuffled with ``shuffle_seed + epoch`` (GaLore: seed 42, one pass) and then split across
    ranks, as GaLore does (shuffle, then ``split_dataset_by_node``).

    Args:
        data_dir: Data directory.
        split: ``"train"``, ``"val"`` or ``"validation"``.
        source: ``"auto"`` (local files, else the hub), ``"local"`` or ``"hub"``.
        shuffle_seed: Base shuffle seed (``None``: no shuffle).
        shuffle_buffer: Size of the streaming shuffle buffer.
        epoch: Pass number (added to the seed).
        rank: This process's rank.
        world_size: Number of processes.

    Returns:
        ``(dataset, info)`` with ``info = {"source": "local"|"hub", "files": [...]}``.

    Raises:
        ValueError: On an unknown ``source``.
        CorruptDataError: If local files cannot be opened.
        DataNotFoundError: If there are no local files and the hub is unavailable.
    """
    import datasets
    from datasets.distributed import split_dataset_by_node

    split = SPLIT_NAMES.get(split, split)
    if source not in ("auto", "local", "hub"):
        raise ValueError(f"source must be auto | local | hub, got {source!r}")
    files = local_files(data_dir, split) if source in ("auto", "local") else []
    if files:
        try:
            ds = datasets.load_dataset(
                "json", data_files=[str(f) for f in files], split="train", streaming=True
            ).select_columns(["text"])
        except Exception as err:  # a truncated .gz (EOFError), broken JSON, no 'text' column
            raise corrupt_c4(files, err) from None
        info = {"source": "local", "files": [str(f) for f in files]}
    elif source == "local" or not hub_reachable():
        raise DataNotFoundError(
            _missing_message(data_dir, f"no local '{split}' files and the hub is offline or unreachable")
        )
    else:
        try:
            ds = datasets.load_dataset(*HUB_DATASET, split=split, streaming=True).select_columns(["text"])
        except Exception as err:  # no network, hub down, auth
            raise DataNotFoundError(
                _missing_message(data_dir, f"streaming {HUB_DATASET[0]} failed ({err!r})")
            ) from None
        info = {"source": "hub", "files": [f"{HUB_DATASET[0]}:{HUB_DATASET[1]}:{split}"]}
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed + epoch, buffer_size=shuffle_buffer)
    if world_size > 1:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    return ds, info


def iter_texts(
    ds: Iterable[dict[str, Any]], data_dir: str | Path, local_files: list[str] | None = None
) -> Iterator[str]:
    """Texts of a document stream, with read errors turned into clear data errors.

    Args:
        ds: The document stream (``{"text": ...}`` items).
        data_dir: Data directory, for messages.
        local_files: The local files behind the stream, if any.

    Yields:
        Document texts.

    Raises:
        CorruptDataError: If reading ``local_files`` fails (truncated gzip, broken JSON).
        DataNotFoundError: On a hub/network failure.
    """
    try:
        for doc in ds:
            yield doc["text"]
    except (DataNotFoundError, CorruptDataError):
        raise
    except Exception as err:
        if local_files:
            raise corrupt_c4(local_files, err) from None
        if isinstance(err, (OSError, ConnectionError)):
            raise DataNotFoundError(_missing_message(data_dir, f"reading C4 failed ({err!r})")) from None
        raise


# --------------------------------------------------------------------------------------------
# tokenisation
# --------------------------------------------------------------------------------------------
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


def _specials(tokenizer: Any) -> tuple[int, int, int]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 1
    unk = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else 2
    return int(pad), int(eos), int(unk)


# --------------------------------------------------------------------------------------------
# in-memory splits
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# streaming training data
# --------------------------------------------------------------------------------------------
class C4TrainStream:
    """Endless training sequences from the C4 stream, one rank's share, resumable.

    The loop calls :meth:`start` with its rank once, then :meth:`next_batch` with the *local*
    batch size. A producer thread tokenises ``chunk_docs`` documents at a time (fast tokenizers
    release the GIL) and queues single sequences together with the stream position after them;
    :meth:`state_dict` is the position of the last sequence handed out, so prefetching never
    shifts a resumed run. Position = (epoch, documents read, tokens/documents read but not yet
    emitted). Resuming skips the documents read (exact; at paper scale this re-reads the
    stream) — ``resume_mode=datasets`` instead restores HF datasets' own shard state (fast,
    but the shuffle buffer is refilled, so the order after resuming differs).

    Args:
        make_dataset: ``(epoch, rank, world_size) -> document stream``.
        tokenizer: The tokenizer.
        max_length: Sequence length T.
        packing: Pack documents into full windows instead of per-document padding.
        data_dir: Data directory, for messages.
        vocab_map: Compact vocabulary applied to emitted ids (quick profile), or ``None``.
        chunk_docs: Documents tokenised per producer step.
        prefetch: Sequences queued ahead by the producer thread.
        resume_mode: ``"skip"`` (exact: re-read and skip the documents read) or ``"datasets"``.
        docs_per_epoch: Documents per pass (for :attr:`epoch`), when known.
        max_epochs: Stop (``StopIteration`` from :meth:`next_batch`) after this many passes;
            ``None``: endless.
        local_files: The local files behind the stream, for error messages.

    Raises:
        ValueError: On an unknown ``resume_mode``.
    """

    def __init__(
        self,
        make_dataset: Callable[[int, int, int], Any],
        tokenizer: Any,
        max_length: int,
        packing: bool,
        data_dir: str | Path,
        vocab_map: VocabMap | None = None,
        chunk_docs: int = 32,
        prefetch: int = 2048,
        resume_mode: str = "skip",
        docs_per_epoch: int | None = None,
        max_epochs: int | None = None,
        local_files: list[str] | None = None,
    ) -> None:
        self.make_dataset = make_dataset
        self.local_files = local_files
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.packing = packing
        self.data_dir = data_dir
        self.vocab_map = vocab_map
        self.chunk_docs = chunk_docs
        self.prefetch = prefetch
        if resume_mode not in ("skip", "datasets"):
            raise ValueError(f"resume_mode must be skip | datasets, got {resume_mode!r}")
        self.resume_mode = resume_mode
        self.docs_per_epoch = docs_per_epoch
        self.max_epochs = max_epochs
        self.rank, self.world_size = 0, 1
        self._position: dict[str, Any] = {"epoch": 0, "docs": 0, "pending": [], "ds_state": None}
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.sequences_emitted = 0

    # -- control --------------------------------------------------------------------------------
    def start(self, rank: int = 0, world_size: int = 1) -> None:
        """Set this process's rank (restarting the producer if it changes).

        Args:
            rank: This process's rank.
            world_size: Number of processes.
        """
        if (rank, world_size) != (self.rank, self.world_size):
            self.close()
        self.rank, self.world_size = rank, world_size

    @property
    def epoch(self) -> float:
        """Passes over the stream so far (fractional when ``docs_per_epoch`` is known)."""
        pos = self._position
        if self.docs_per_epoch:
            return pos["epoch"] + pos["docs"] / (self.docs_per_epoch / self.world_size)
        return float(pos["epoch"])

    def state_dict(self) -> dict[str, Any]:
        """Position after the last sequence handed out (for resume).

        Returns:
            ``epoch``, ``docs``, ``pending``, ``ds_state`` and ``sequences_emitted``.
        """
        return {**self._position, "sequences_emitted": self.sequences_emitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (the producer restarts from it).

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.close()
        self._position = {k: state[k] for k in ("epoch", "docs", "pending", "ds_state")}
        self.sequences_emitted = int(state.get("sequences_emitted", 0))

    def close(self) -> None:
        """Stop and join the producer thread (idempotent)."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:  # unblock a producer waiting on a full queue
                    while True:
                        self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.1)
        self._thread, self._queue = None, None
        self._stop = threading.Event()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown
        try:
            self.close()
        except Exception:
            pass

    # -- production -----------------------------------------------------------------------------
    def _documents(self, epoch: int, skip: int, ds_state: Any) -> tuple[Any, Iterator[str]]:
        ds = self.make_dataset(epoch, self.rank, self.world_size)
        if self.resume_mode == "datasets" and ds_state is not None:
            ds.load_state_dict(ds_state)
            skip = 0
        texts = iter_texts(ds, self.data_dir, self.local_files)
        if skip:
            for _ in itertools.islice(texts, skip):
                pass
        return ds, texts

    def _produce(self, start: dict[str, Any]) -> Iterator[tuple[Tensor, Tensor, dict[str, Any]]]:
        epoch, docs = int(start["epoch"]), int(start["docs"])
        pending = [list(p) for p in start["pending"]] if not self.packing else list(start["pending"])
        ds, texts = self._documents(epoch, docs, start.get("ds_state"))
        ds_state = start.get("ds_state")
        while True:
            # emit what is pending (after a resume, or the rest of a chunk)
            if self.packing:
                while len(pending) >= self.max_length:
                    ids = torch.tensor(pending[: self.max_length], dtype=torch.long)
                    pending = pending[self.max_length :]
                    pos = {"epoch": epoch, "docs": docs, "pending": list(pending), "ds_state": ds_state}
                    yield ids, torch.ones_like(ids), pos
            else:
                while pending:
                    doc = pending.pop(0)
                    ids = torch.full((self.max_length,), self._pad, dtype=torch.long)
                    ids[: len(doc)] = torch.tensor(doc, dtype=torch.long)
                    mask = torch.zeros(self.max_length, dtype=torch.long)
                    mask[: len(doc)] = 1
                    pos = {
                        "epoch": epoch,
                        "docs": docs,
                        "pending": [list(p) for p in pending],
                        "ds_state": ds_state,
                    }
                    yield ids, mask, pos
            batch = list(itertools.islice(texts, self.chunk_docs))
            if not batch:
                if docs == 0:
                    raise DataNotFoundError(
                        _missing_message(self.data_dir, "the C4 training stream is empty")
                    )
                epoch, docs = epoch + 1, 0
                if self.max_epochs is not None and epoch >= self.max_epochs:
                    return
                ds, texts = self._documents(epoch, 0, None)
                ds_state = None
                continue
            docs += len(batch)
            if self.resume_mode == "datasets" and hasattr(ds, "state_dict"):
                ds_state = ds.state_dict()
            if self.packing:
                for doc in encode_documents(self.tokenizer, batch):
                    pending.extend(doc)
            else:
                pending.extend(
                    self.tokenizer(batch, max_length=self.max_length, truncation=True)["input_ids"]
                )

    @property
    def _pad(self) -> int:
        return _specials(self.tokenizer)[0]

    def _run_producer(self, start: dict[str, Any], out: queue.Queue, stop: threading.Event) -> None:
        try:
            for item in self._produce(start):
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put(StopIteration())
        except BaseException as err:  # surfaced in the consumer
            out.put(err)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(
                target=self._run_producer,
                args=(dict(self._position), self._queue, self._stop),
                name=f"c4-stream-rank{self.rank}",
                daemon=True,
            )
            self._thread.start()

    def next_batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """The next ``batch_size`` sequences of this rank.

        Args:
            batch_size: Local batch size B.

        Returns:
            ``(input_ids (B, T), labels[:, 1:] (B, T−1))``.

        Raises:
            StopIteration: When ``max_epochs`` passes have been read.
        """
        self._ensure_thread()
        assert self._queue is not None
        rows, masks = [], []
        for _ in range(batch_size):
            item = self._queue.get()
            if isinstance(item, StopIteration):
                raise StopIteration("the C4 training stream ended (max_epochs reached)")
            if isinstance(item, BaseException):
                raise item
            ids, mask, pos = item
            rows.append(ids)
            masks.append(mask)
            self._position = pos
        self.sequences_emitted += batch_size
        x, m = torch.stack(rows), torch.stack(masks)
        if self.vocab_map is not None:
            x = self.vocab_map(x)
        return x, next_token_labels(x, m)


# --------------------------------------------------------------------------------------------
# the dataset target
# --------------------------------------------------------------------------------------------
def _local(info: dict[str, Any]) -> list[str] | None:
    return list(info["files"]) if info["source"] == "local" else None


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
    tok = load_tokenizer(data_dir, tokenizer)
    pad, eos, unk = _specials(tok)
    source_size = len(tok)

    def make_dataset(split: str) -> Callable[[int, int, int], Any]:
        def make(epoch: int = 0, rank: int = 0, world_size: int = 1) -> Any:
            return document_dataset(
                data_dir, split, source, shuffle_seed, shuffle_buffer, epoch, rank, world_size
            )[0]

        return make

    _, train_info = document_dataset(data_dir, "train", source, shuffle_seed, shuffle_buffer)
    _, val_info = document_dataset(data_dir, "validation", source, shuffle_seed, shuffle_buffer)
    if not streaming and num_train_docs is None and train_info["source"] == "hub":
        raise ValueError("in-memory C4 from the hub needs num_train_docs (or streaming=true)")
    if val_tokens is None and num_val_docs is None and val_info["source"] == "hub":
        raise ValueError("C4 validation from the hub needs val_tokens (paper: 10_000_000) or num_val_docs")

    meta: dict[str, Any] = {
        "name": "c4",
        "synthetic": False,
        "source": train_info["source"],
        "train_files": train_info["files"],
        "val_files": val_info["files"],
        "tokenizer": tokenizer,
        "max_length": max_length,
        "packing": packing,
        "pad_id": pad,
        "eos_id": eos,
        "ignore_index": IGNORE_INDEX,
        "streaming": streaming,
    }

    train_ids = train_mask = None
    if not streaming or vocab_limit is not None:
        texts = iter_texts(make_dataset("train")(), data_dir, _local(train_info))
        train_ids, train_mask, used = tokenize_split(tok, texts, max_length, packing, max_docs=num_train_docs)
        if train_ids.shape[0] == 0:
            raise DataNotFoundError(_missing_message(data_dir, "the C4 training split is empty"))
        meta["train_docs"] = used

    vocab_map = None
    vocab_size = source_size
    if vocab_limit is not None:
        assert train_ids is not None and train_mask is not None
        vocab_map = VocabMap.from_counts(
            train_ids[train_mask.bool()], vocab_limit, source_size, [pad, eos, unk], unk
        )
        vocab_size = vocab_map.size
        meta["vocab_map"] = {"limit": vocab_limit, "kept": vocab_map.size}
    meta["vocab_size"] = vocab_size

    def finish(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if vocab_map is not None:
            ids = vocab_map(ids)
        return ids, next_token_labels(ids, mask)

    # validation: per-document padding always (GaLore's evaluation), in memory
    val_texts = iter_texts(make_dataset("validation")(), data_dir, _local(val_info))
    val_ids, val_mask, val_docs = tokenize_split(
        tok, val_texts, max_length, packing=False, max_docs=num_val_docs, max_tokens=val_tokens
    )
    if val_ids.shape[0] == 0:
        raise DataNotFoundError(_missing_message(data_dir, "the C4 validation split is empty"))
    meta.update(val_docs=val_docs, val_tokens=int(val_mask.sum()))
    val = finish(val_ids, val_mask)
    if vocab_map is not None:
        mask = val_mask.bool()
        meta["vocab_map"]["val_unk_fraction"] = float((val[0][mask] == vocab_map.unk_new).double().mean())
        orig_unk = float((val_ids[mask] == unk).double().mean())
        meta["vocab_map"]["val_unk_fraction_before"] = orig_unk

    if streaming:
        stream = C4TrainStream(
            make_dataset("train"),
            tok,
            max_length,
            packing,
            data_dir,
            vocab_map=vocab_map,
            prefetch=prefetch,
            resume_mode=resume_mode,
            docs_per_epoch=meta.get("train_docs") if train_info["source"] == "local" else None,
            local_files=_local(train_info),
        )
        log.info(
            "C4: streaming training data (%s), %d validation sequences", train_info["source"], val[0].shape[0]
        )
        return DataBundle(train=None, val=val, test=None, meta=meta, train_stream=stream)

    assert train_ids is not None and train_mask is not None
    train = finish(train_ids, train_mask)
    meta["train_tokens"] = int(train_mask.sum())
    if vocab_map is not None:
        meta["vocab_map"]["train_unk_fraction"] = float(
            (train[0][train_mask.bool()] == vocab_map.unk_new).double().mean()
        )
    log.info(
        "C4: %d training and %d validation sequences of %d tokens (%s)",
        train[0].shape[0],
        val[0].shape[0],
        max_length,
        train_info["source"],
    )
    return DataBundle(train=train, val=val, test=None, meta=meta)
