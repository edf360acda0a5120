"""Corrupt and missing data files are named (with what to do), never a raw traceback; without a
network the loaders ask the hub once (or not at all under HF_HUB_OFFLINE) instead of retrying
for a minute."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from pathlib import Path

import pytest

from curvopt.data import common
from curvopt.data.c4 import load_c4, load_tokenizer
from curvopt.data.common import hub_reachable
from curvopt.data.mnist import load_mnist
from curvopt.errors import CorruptDataError, DataNotFoundError


def _copy_mnist(src: Path, dst: Path) -> Path:
    target = dst / "mnist"
    target.mkdir(parents=True)
    for f in (src / "mnist").glob("*.gz"):
        (target / f.name).write_bytes(f.read_bytes())
    return target


def test_a_byte_flipped_inside_an_mnist_gzip_stream_is_named(tmp_path, shared_data_dir):
    target = _copy_mnist(shared_data_dir, tmp_path)
    path = target / "t10k-labels-idx1-ubyte.gz"
    original = path.read_bytes()
    for offset in range(10, len(original)):  # the first flip that breaks the deflate stream itself
        raw = bytearray(original)
        raw[offset] ^= 0xFF
        try:
            gzip.decompress(bytes(raw))
        except zlib.error:  # used to escape as a raw traceback (only CRC errors were caught)
            break
        except (OSError, EOFError):
            continue
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptDataError, match=rf"{path}: cannot decompress .*re-download it"):
        load_mnist(str(tmp_path), allow_download=False)


@pytest.fixture
def c4_copy(tmp_path, shared_data_dir):
    src = shared_data_dir
    if not (src / "c4" / "train.jsonl.gz").exists() or not (src / "tokenizers" / "t5-base").is_dir():
        pytest.skip(f"no C4 sample / t5-base tokenizer under {src}")
    (tmp_path / "c4").mkdir()
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        (tmp_path / "c4" / name).write_bytes((src / "c4" / name).read_bytes())
    tok = tmp_path / "tokenizers" / "t5-base"
    tok.mkdir(parents=True)
    for f in (src / "tokenizers" / "t5-base").iterdir():
        (tok / f.name).write_bytes(f.read_bytes())
    return tmp_path


def test_a_truncated_c4_file_is_named(c4_copy):
    path = c4_copy / "c4" / "train.jsonl.gz"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptDataError, match=rf"C4: cannot read {path} \(EOFError"):
        load_c4(str(c4_copy), max_length=16, num_train_docs=10, num_val_docs=5)


def test_a_broken_json_line_in_c4_is_named(c4_copy):
    path = c4_copy / "c4" / "validation.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines[3] = lines[3][: len(lines[3]) // 2]  # a line cut in the middle, inside a valid gzip
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    json.loads(lines[0])  # the others are fine
    with pytest.raises(CorruptDataError, match=rf"C4: cannot read {path}"):
        load_c4(str(c4_copy), max_length=16, num_train_docs=10, num_val_docs=20)


def test_a_truncated_tokenizer_is_named(c4_copy):
    folder = c4_copy / "tokenizers" / "t5-base"
    path = folder / "tokenizer.json"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(
        CorruptDataError, match=rf"{folder}: the tokenizer cannot be loaded .*JSONDecodeError"
    ):
        load_tokenizer(c4_copy, "t5-base")


def test_an_empty_tokenizer_directory_is_named(tmp_path):
    folder = tmp_path / "tokenizers" / "t5-base"
    folder.mkdir(parents=True)
    with pytest.raises(DataNotFoundError, match=rf"{folder} holds no tokenizer files \(found: nothing"):
        load_tokenizer(tmp_path, "t5-base")


# -- 12: offline ------------------------------------------------------------------------------------
@pytest.fixture
def online_env(monkeypatch):
    """As if HF_HUB_OFFLINE were not set (conftest sets it), with a fresh hub answer."""
    for var in common.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(common, "_HUB", {})


def test_hub_offline_means_no_network_at_all(monkeypatch, online_env):
    import urllib.request

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("asked the network"))
    assert hub_reachable() is False


def test_an_unreachable_hub_is_asked_once_and_loaders_stop_at_once(tmp_path, monkeypatch, online_env):
    import urllib.error
    import urllib.request

    import datasets

    calls = []

    def unreachable(request, timeout):
        calls.append((request.full_url, timeout))
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("a hub download was tried"))
    t0 = time.perf_counter()
    for _ in range(2):
        with pytest.raises(DataNotFoundError, match="MNIST: data files not found") as err:
            load_mnist(str(tmp_path))  # allow_download=True by default
        assert "not reachable" in str(err.value)
    assert time.perf_counter() - t0 < 10
    assert len(calls) == 1 and calls[0][1] <= 5  # one short question per process
    assert common.hub_offline_requested()  # and the libraries are told


def test_a_reachable_hub_is_remembered(monkeypatch, online_env):
    import urllib.request

    calls = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: calls.append(1))
    assert hub_reachable() and hub_reachable() and calls == [1]
