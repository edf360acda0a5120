"""C4 pipeline: GaLore padding and labels, packing, vocab compaction, rank sharding, stream
resume, truncation to the model's positions, and the message when nothing is available."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from curvopt.data.c4 import (
    IGNORE_INDEX,
    C4TrainStream,
    VocabMap,
    document_dataset,
    iter_texts,
    load_c4,
    load_tokenizer,
    next_token_labels,
)
from curvopt.errors import DataNotFoundError
from curvopt.training.distributed import shard_slice
from curvopt.training.sampler import shard


@pytest.fixture(scope="module")
def data_root():
    from tests.conftest import data_dir

    root = data_dir()
    if not (root / "c4" / "train.jsonl.gz").exists() or not (root / "tokenizers" / "t5-base").is_dir():
        pytest.skip(f"no C4 sample / t5-base tokenizer under {root}")
    return root


@pytest.fixture(scope="module")
def tokenizer(data_root):
    return load_tokenizer(data_root)


def _texts(root, split="train", n=None, seed=42):
    ds, _ = document_dataset(root, split, "local", shuffle_seed=seed)
    out = []
    for text in iter_texts(ds, root):
        out.append(text)
        if n is not None and len(out) >= n:
            break
    return out


def test_padding_and_labels_follow_galore(data_root, tokenizer):
    data = load_c4(str(data_root), max_length=64, num_train_docs=20, num_val_docs=5)
    x, y = data.train
    assert x.shape == (20, 64) and y.shape == (20, 63) and x.dtype == torch.long
    texts = _texts(data_root, n=20)
    pad = tokenizer.pad_token_id
    for row_x, row_y, text in zip(x, y, texts):
        ids = tokenizer(text)["input_ids"]  # whole document, ends in </s>
        n = min(len(ids), 64)
        if len(ids) <= 64:
            assert row_x[:n].tolist() == ids
        else:  # truncated: the first 63 tokens, then </s> (HF truncation keeps the special token)
            assert row_x[:63].tolist() == ids[:63] and int(row_x[63]) == tokenizer.eos_token_id
        assert (row_x[n:] == pad).all()
        # next-token labels: y[t] = x[t+1] on real tokens, -100 on padding
        assert row_y[: n - 1].tolist() == row_x[1:n].tolist()
        assert (row_y[n - 1 :] == IGNORE_INDEX).all()
    assert data.meta["pad_id"] == 0 and data.meta["source"] == "local"


def test_labels_mask_padding_only():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    y = next_token_labels(ids, mask)
    assert y.tolist() == [[6, 7, -100, -100], [9, 10, 11, 12]]


def test_packing_concatenates_documents(data_root, tokenizer):
    data = load_c4(str(data_root), max_length=32, packing=True, num_train_docs=10, num_val_docs=3)
    x, y = data.train
    stream = [t for text in _texts(data_root, n=10) for t in tokenizer(text)["input_ids"]]
    assert x.shape == (len(stream) // 32, 32)
    assert x.reshape(-1).tolist() == stream[: x.numel()]
    assert (y != IGNORE_INDEX).all() and torch.equal(y, x[:, 1:])
    # validation keeps GaLore's per-document padding whatever the training packing
    last = data.val[0][:, -1]  # each row is one truncated (</s> last) or padded document
    assert bool(((last == tokenizer.eos_token_id) | (last == tokenizer.pad_token_id)).all())


def test_vocab_map_keeps_specials_and_frequent_ids():
    ids = torch.tensor([7, 7, 7, 9, 9, 4, 0, 1])
    vm = VocabMap.from_counts(ids, limit=5, source_size=12, specials=[0, 1, 2], unk_id=2)
    assert vm.keep == [0, 1, 2, 7, 9] and vm.size == 5
    assert vm(torch.tensor([0, 1, 2, 7, 9, 4, 11])).tolist() == [0, 1, 2, 3, 4, 2, 2]


def test_vocab_limit_bounds_ids(data_root):
    data = load_c4(str(data_root), max_length=32, num_train_docs=30, num_val_docs=10, vocab_limit=300)
    assert data.meta["vocab_size"] == 300
    for x, y in (data.train, data.val):
        assert int(x.max()) < 300 and int(y[y != IGNORE_INDEX].max()) < 300
    assert 0 < data.meta["vocab_map"]["val_unk_fraction"] < 1


def test_val_token_budget(data_root):
    data = load_c4(str(data_root), max_length=64, num_train_docs=5, val_tokens=1000)
    mask_tokens = int((data.val[1] != IGNORE_INDEX).sum()) + data.val[0].shape[0]  # targets + first tokens
    assert 1000 <= data.meta["val_tokens"] < 1000 + 64
    assert mask_tokens == data.meta["val_tokens"]


def test_length_is_truncated_to_model_positions(data_root):
    data = load_c4(str(data_root), max_length=512, max_positions=48, num_train_docs=4, num_val_docs=2)
    assert data.train[0].shape[1] == 48 and data.val[1].shape[1] == 47


def test_batch_sharding_is_disjoint_and_complete():
    idx = torch.randperm(37)
    for world in (1, 2, 3, 4):
        parts = [shard(idx, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), idx)
        sizes = [p.numel() for p in parts]
        assert max(sizes) - min(sizes) <= 1
    assert shard_slice(10, 1, 3) == slice(4, 7)


def _stream(root, tokenizer, packing, world=1, rank=0, chunk=4):
    def make(epoch=0, r=0, w=1):
        return document_dataset(root, "train", "local", 42, 100, epoch, r, w)[0]

    s = C4TrainStream(make, tokenizer, 24, packing, root, chunk_docs=chunk, prefetch=16, docs_per_epoch=1000)
    s.start(rank, world)
    return s


def test_stream_shards_are_disjoint(data_root, tokenizer):
    packing = False  # documents are the unit that is sharded (packed windows cross documents)
    whole = _stream(data_root, tokenizer, packing)
    a, b = _stream(data_root, tokenizer, packing, 2, 0), _stream(data_root, tokenizer, packing, 2, 1)
    xw, _ = whole.next_batch(12)
    xa, _ = a.next_batch(6)
    xb, _ = b.next_batch(6)
    for s in (whole, a, b):
        s.close()
    rows = lambda x: {tuple(r.tolist()) for r in x}  # noqa: E731
    assert rows(xa).isdisjoint(rows(xb))
    assert rows(xa) | rows(xb) == rows(xw)  # example-level split of a one-file stream: i % 2 == rank


@pytest.mark.parametrize("packing", [False, True])
def test_stream_resume_is_exact(data_root, tokenizer, packing):
    first = _stream(data_root, tokenizer, packing)
    for _ in range(3):
        first.next_batch(5)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    expected = [first.next_batch(5) for _ in range(2)]
    first.close()
    second = _stream(data_root, tokenizer, packing)
    second.load_state_dict(state)
    got = [second.next_batch(5) for _ in range(2)]
    second.close()
    for (xe, ye), (xg, yg) in zip(expected, got):
        assert torch.equal(xe, xg) and torch.equal(ye, yg)
    assert state["sequences_emitted"] == 15


def test_stream_matches_in_memory_order(data_root, tokenizer):
    mem = load_c4(str(data_root), max_length=24, num_train_docs=12, num_val_docs=2, shuffle_buffer=100)
    s = _stream(data_root, tokenizer, False)
    x, y = s.next_batch(12)
    s.close()
    assert torch.equal(x, mem.train[0]) and torch.equal(y, mem.train[1])


def test_missing_everything_says_what_to_put_where(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataNotFoundError) as err:
        load_c4(str(tmp_path))
    text = str(err.value)
    assert "tokenizers/t5-base" in text and "c4/train.jsonl.gz" in text and str(tmp_path.resolve()) in text


def test_missing_data_with_tokenizer(tmp_path, monkeypatch, data_root):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "tokenizers").symlink_to(data_root / "tokenizers")
    with pytest.raises(DataNotFoundError, match="no local 'train' files"):
        load_c4(str(tmp_path))


def test_local_shard_names_are_found(tmp_path, data_root):
    (tmp_path / "tokenizers").symlink_to(data_root / "tokenizers")
    en = tmp_path / "c4" / "en"
    en.mkdir(parents=True)
    docs = [{"text": f"document number {i} about nothing", "url": str(i)} for i in range(6)]
    for split in ("train", "validation"):
        with gzip.open(en / f"c4-{split}.00000-of-00001.json.gz", "wt") as fh:
            fh.write("".join(json.dumps(d) + "\n" for d in docs))
    data = load_c4(str(tmp_path), max_length=16, shuffle_seed=None)
    assert data.train[0].shape == (6, 16) and data.meta["train_files"][0].endswith("00001.json.gz")
