"""FOSI DNN-task data pipelines: CIFAR-10 packed form and split, Tiny Shakespeare splits and
sequences, the AudioSet VGGish pipeline on synthetic wav files."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from curvopt.data import audioset, cifar10, shakespeare
from curvopt.errors import DataNotFoundError


# -- CIFAR-10 ----------------------------------------------------------------------------------------------
def _write_packed(folder: Path, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    folder.mkdir(parents=True)
    xs = []
    for name in cifar10.TRAIN_BATCHES + cifar10.TEST_BATCHES:
        x = rng.integers(0, 256, (10000, 32, 32, 3), dtype=np.uint8)
        mosaic = x.reshape(100, 100, 32, 32, 3).transpose(0, 2, 1, 3, 4).reshape(3200, 3200, 3)
        Image.fromarray(mosaic).save(folder / f"{name}.webp", lossless=True)
        xs.append(x)
    np.save(folder / "train_labels.npy", rng.integers(0, 10, 50000, dtype=np.uint8))
    np.save(folder / "test_labels.npy", rng.integers(0, 10, 10000, dtype=np.uint8))
    return np.concatenate(xs[:5]), xs[5]


@pytest.mark.slow
def test_packed_cifar_roundtrip_and_cache(tmp_path):
    rng = np.random.default_rng(0)
    x_train, x_test = _write_packed(tmp_path / "data" / "cifar10", rng)
    x, y, source = cifar10.read_cifar10(
        tmp_path / "data", "test", cache_dir=tmp_path / "cache", allow_download=False
    )
    assert np.array_equal(x, x_test) and "webp" in source
    x2, _, source2 = cifar10.read_cifar10(tmp_path / "data", "test", cache_dir=tmp_path / "cache")
    assert source2.startswith("cache:") and np.array_equal(x2, x_test)


def test_mosaic_decoding_is_row_major_tiles(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (10000, 32, 32, 3), dtype=np.uint8)
    mosaic = np.zeros((3200, 3200, 3), dtype=np.uint8)
    for i in (0, 1, 99, 100, 5432, 9999):  # image i sits at tile row i // 100, column i % 100
        r, c = divmod(i, 100)
        mosaic[32 * r : 32 * r + 32, 32 * c : 32 * c + 32] = x[i]
    Image.fromarray(mosaic).save(tmp_path / "b.webp", lossless=True)
    decoded = cifar10.decode_mosaic(tmp_path / "b.webp")
    for i in (0, 1, 99, 100, 5432, 9999):
        assert np.array_equal(decoded[i], x[i])


def test_lippe_split_is_torch_random_split():
    from torch.utils.data import random_split

    train, val = cifar10.lippe_split(50000, (45000, 5000), 42)
    ref_train, ref_val = random_split(
        range(50000), [45000, 5000], generator=torch.Generator().manual_seed(42)
    )
    assert train.tolist()[:100] == list(ref_train.indices)[:100]
    assert val.tolist() == list(ref_val.indices)
    assert len(set(train.tolist()) | set(val.tolist())) == 50000


def test_missing_cifar_says_what_to_do(tmp_path):
    with pytest.raises(DataNotFoundError, match="cifar-10-python.tar.gz"):
        cifar10.read_cifar10(tmp_path, "train", allow_download=False)


@pytest.mark.slow
def test_real_cifar_autoencoder_layout(shared_data_dir):
    if (
        cifar10._find_packed(shared_data_dir) is None
        and cifar10._find_python_batches(shared_data_dir) is None
    ):
        pytest.skip("no CIFAR-10 in the data directory")
    data = cifar10.load_cifar10(
        str(shared_data_dir), "autoencoder", num_train=8, num_val=4, num_test=0, cache_dir=None
    )
    x, y = data.train
    assert x.shape == (8, 3, 32, 32) and x is y and data.test is None
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    # first validation image of random_split(seed 42) is training image perm[45000]
    raw, labels, _ = cifar10.read_cifar10(shared_data_dir, "train", cache_dir=None)
    k = int(cifar10.lippe_split()[1][0])
    expect = torch.from_numpy(raw[k]).permute(2, 0, 1).float() / 255 * 2 - 1
    torch.testing.assert_close(data.val[0][0], expect)
    assert labels[:5].tolist() == [6, 9, 9, 4, 1]  # the official first labels


# -- Tiny Shakespeare ------------------------------------------------------------------------------------
def test_tfds_split_offsets():
    text = bytes(range(32, 127)) * 11742  # 1,115,490 bytes, close to the real size
    splits = shakespeare.tfds_splits(text)
    i = int(len(text) * 0.9)
    assert splits["train"] == text[:i]
    assert len(splits["validation"]) == int((len(text) - i) * 0.5)
    assert splits["train"] + splits["validation"] + splits["test"] == text


def test_sequences_are_shifted_next_byte_pairs():
    text = b"abcdefghijklmnopqrstuvwxyz"
    x, y = shakespeare.to_sequences(text, 5)
    assert x.shape == (5, 5)  # 25 pairs -> 5 windows
    assert bytes(x[1].tolist()) == b"fghij" and bytes(y[1].tolist()) == b"ghijk"
    assert torch.equal(x.flatten()[1:], y.flatten()[:-1])


def test_real_tiny_shakespeare(shared_data_dir):
    if not (shared_data_dir / "tiny_shakespeare" / "input.txt").is_file():
        pytest.skip("no tiny_shakespeare in the data directory")
    data = shakespeare.load_tiny_shakespeare(str(shared_data_dir), allow_download=False)
    assert data.train[0].shape == (1003853 // 128, 128)  # 7,842 sequences
    assert data.val[0].shape == (55769 // 128, 128)  # the test split: 435 sequences
    assert int(data.train[0].max()) < 128


def test_missing_text_message(tmp_path):
    with pytest.raises(DataNotFoundError, match="input.txt"):
        shakespeare.read_text(tmp_path, allow_download=False)


# -- AudioSet --------------------------------------------------------------------------------------------
def test_mel_matrix_matches_vggish_definition():
    w = audioset.mel_matrix(64, 257, 16000, 125.0, 7500.0)
    assert w.shape == (257, 64) and np.all(w[0] == 0) and np.all(w >= 0)
    # each band peaks at (close to) 1 at its centre frequency, and bands are triangles in mel
    assert np.all(w.max(axis=0) <= 1.0) and np.all(w.max(axis=0) > 0.5)
    freqs = np.linspace(0, 8000, 257)
    assert np.all(w[(freqs < 125.0), :] == 0) and np.all(w[(freqs > 7500.0), :] == 0)


def test_log_mel_of_a_tone_peaks_at_its_band():
    sr = 16000
    t = np.arange(sr * 2) / sr
    tone = 0.5 * np.sin(2 * np.pi * 1000.0 * t)
    feats = audioset.log_mel(tone, sr)
    assert feats.shape == (1 + (len(t) - 400) // 160, 64)
    band = int(np.argmax(feats.mean(axis=0)))
    edges = np.linspace(audioset.hertz_to_mel(125.0), audioset.hertz_to_mel(7500.0), 66)
    assert abs(edges[band + 1] - audioset.hertz_to_mel(1000.0)) < 2 * (edges[1] - edges[0])


def _write_wav(path: Path, seconds: float, sr: int, freq: float, channels: int = 1) -> None:
    from scipy.io import wavfile

    t = np.arange(int(seconds * sr)) / sr
    sig = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    wavfile.write(path, sr, np.stack([sig] * channels, axis=1) if channels > 1 else sig)


def _write_audioset(root: Path) -> None:
    for split in ("train", "valid"):
        (root / f"{split}_wav").mkdir(parents=True)
    with open(root / "class_labels_indices.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["index", "mid", "display_name"])
        for i in range(5):
            w.writerow([i, f"/m/{i:03d}", f"class {i}"])
    files = {
        "train": [("aaa", "/m/001,/m/003", 22050, 2), ("bbb", "/m/000", 16000, 1)],
        "valid": [("ccc", "/m/004", 44100, 1)],
    }
    for split, entries in files.items():
        with open(root / f"{split}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["YTID", "start_seconds", "end_seconds", "positive_labels"])
            for ytid, labels, sr, ch in entries:
                w.writerow([ytid, 0, 10, labels])
                _write_wav(root / f"{split}_wav" / f"{ytid}.wav", 3.0, sr, 440.0, ch)
    (root / "train_wav" / "broken.wav").write_bytes(b"not a wav")  # unlabelled: ignored


def test_audioset_pipeline_on_synthetic_wavs(tmp_path):
    _write_audioset(tmp_path / "audioset")
    data = audioset.load_audioset(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    x, y = data.train
    per_file = math.floor((1 + (3 * 16000 - 400) // 160) / 96)  # 3 s -> 298 frames -> 3 examples
    assert x.shape == (2 * per_file, 3, 96, 64) and x.dtype == torch.uint8
    assert y.shape == (2 * per_file, 5)
    assert y[0].tolist() == [0, 1, 0, 1, 0] and y[-1].tolist() == [1, 0, 0, 0, 0]  # sorted: aaa, bbb
    assert data.val[0].shape[0] == per_file and data.meta["num_classes"] == 5
    cached = list((tmp_path / "cache").glob("*.npz"))
    assert len(cached) == 2
    again = audioset.load_audioset(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert torch.equal(again.train[0], x)


def test_audioset_encodings():
    t, f = np.meshgrid(np.linspace(0, 1, 96), np.linspace(0, 1, 64), indexing="ij")
    patch = np.log(
        0.01 + np.exp(-((f - 0.3) ** 2) / 0.02) * (1 + np.sin(6 * t))
    )  # smooth, like a spectrogram
    raw = audioset.encode_patch(patch, "logmel")
    assert raw.shape == (1, 96, 64) and raw.dtype == np.float32
    exact = audioset.encode_patch(patch, "viridis")
    from matplotlib import colormaps

    norm = (patch - patch.min()) / (patch.max() - patch.min())
    expect = colormaps["viridis"](norm, bytes=True)[..., :3].transpose(2, 0, 1)
    assert np.array_equal(exact, expect)
    lossy = audioset.encode_patch(patch, "viridis_jpeg")
    assert lossy.shape == (3, 96, 64) and np.abs(lossy.astype(int) - exact.astype(int)).mean() < 4


def test_audioset_missing_data_message(tmp_path):
    with pytest.raises(DataNotFoundError, match="zfturbo/audioset"):
        audioset.load_audioset(str(tmp_path))


def test_hit_rate():
    logits = torch.tensor([[0.1, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    targets = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 0, 1.0]])
    assert audioset.hit_rate(logits, targets) == pytest.approx(2 / 3)


def test_evaluation_reports_hit_rate_for_multi_label_targets():
    """The loop's evaluation gives the AC task's ``val/hit_rate`` (multi-hot targets, sigmoid BCE),
    and keeps treating same-size sigmoid-BCE targets as a reconstruction (E_sq, no hit rate)."""
    from curvopt.objective import Objective
    from curvopt.training.evaluation import evaluate_split

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    x = torch.randn(7, 3, 2, 2)
    y = (torch.rand(7, 5) < 0.4).float()
    with torch.no_grad():
        logits = model(x)
    expected_hits = sum(float(y[i, int(logits[i].argmax())]) for i in range(7)) / 7
    expected_loss = float(
        torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none").sum(1).mean()
    )
    m = evaluate_split(Objective(model, "sigmoid_bce"), x, y, batch_size=3)
    assert m["hit_rate"] == pytest.approx(expected_hits) and "E_sq" not in m
    assert m["loss"] == pytest.approx(expected_loss, rel=1e-6)
    # the same through a (one-rank) reduce: the extra sum travels with the others
    m2 = evaluate_split(Objective(model, "sigmoid_bce"), x, y, batch_size=3, reduce=lambda v: v)
    assert m2["hit_rate"] == pytest.approx(expected_hits)
    ae = torch.nn.Sequential(torch.nn.Linear(6, 6))
    xa = torch.rand(4, 6)
    ma = evaluate_split(Objective(ae, "sigmoid_bce"), xa, xa, batch_size=3)
    assert "hit_rate" not in ma and "E_sq" in ma
