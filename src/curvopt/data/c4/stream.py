"""Streaming C4 training data: one rank's endless, resumable share, tokenised in a background thread."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from curvopt.data.c4.sequences import VocabMap, encode_documents, next_token_labels
from curvopt.data.c4.sources import iter_texts, missing_message
from curvopt.data.c4.tokenizer import special_ids
from curvopt.errors import DataNotFoundError


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
                    raise DataNotFoundError(missing_message(self.data_dir, "the C4 training stream is empty"))
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
        return special_ids(self.tokenizer)[0]

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
