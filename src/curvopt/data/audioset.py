"""AudioSet log-mel examples for FOSI's AC task (MobileNetV1, multi-label, 527 classes).

The user provides the audio (the authors used the Kaggle sets ``zfturbo/audioset`` and
``zfturbo/audioset-valid``), laid out as::

    <data_dir>/audioset/class_labels_indices.csv   # index,mid,display_name (527 rows)
    <data_dir>/audioset/train.csv                  # YTID,...,positive_labels ("/m/a,/m/b")
    <data_dir>/audioset/train_wav/<YTID>.wav
    <data_dir>/audioset/valid.csv
    <data_dir>/audioset/valid_wav/<YTID>.wav

Each file becomes ≈10 examples by the VGGish recipe (docs/fosi_tasks.md, "Data and weights"):
mono, resample to 16 kHz, STFT with a 25 ms periodic-Hann window, 10 ms hop and a 512-point FFT,
64 HTK-mel bands over 125–7500 Hz, ``log(mel + 0.01)``, cut into non-overlapping 96-frame (0.96 s)
patches. Every patch inherits its file's multi-hot label.

Encoding (``encoding``):

* ``viridis_jpeg`` (default, the authors'): ``plt.imsave`` of the 96×64 patch — min/max
  normalised per patch, viridis colour map, JPEG at PIL's default quality 75 — read back as
  ``ToTensor`` would, giving uint8 ``(3, 96, 64)`` (the model scales to [0, 1]);
* ``viridis``: the same without the lossy JPEG round trip;
* ``logmel``: the raw log-mel patch, float ``(1, 96, 64)`` (a cleaner input; pair it with the
  model's ``input_layout='natural'`` and ``in_channels=1``).

Differences from the authors: resampling uses ``scipy.signal.resample_poly`` instead of
``resampy``; unreadable files are skipped and counted (as the authors' ``try/except`` did).
Processed arrays are cached as ``.npz`` in ``cache_dir`` (default ``~/.cache/curvopt/audioset``),
keyed by the settings, so the slow pass runs once.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
from math import gcd
from pathlib import Path

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import missing_data_message
from curvopt.errors import DataNotFoundError

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
STFT_WINDOW_S = 0.025
STFT_HOP_S = 0.010
NUM_BANDS = 64
MEL_MIN_HZ = 125.0
MEL_MAX_HZ = 7500.0
LOG_OFFSET = 0.01
NUM_FRAMES = 96  # 0.96 s examples, no overlap
ENCODINGS = ("viridis_jpeg", "viridis", "logmel")
HOW_TO_GET = (
    "AudioSet audio cannot be downloaded by this project. Get the Kaggle datasets 'zfturbo/audioset' "
    "(train_wav/, train.csv, class_labels_indices.csv) and 'zfturbo/audioset-valid' (valid_wav/, "
    "valid.csv) and place them as <data_dir>/audioset/{train_wav,valid_wav,train.csv,valid.csv,"
    "class_labels_indices.csv}; any folder of <YTID>.wav files with such CSVs works."
)


# -- VGGish log-mel features (numpy) -------------------------------------------------------------
def frame(data: np.ndarray, window: int, hop: int) -> np.ndarray:
    """Successive frames without padding (incomplete ones dropped).

    Args:
        data: Array whose first axis is time.
        window: Frame length, in samples (rows).
        hop: Step between frame starts.

    Returns:
        ``(num_frames, window, ...)``.
    """
    n = 1 + (data.shape[0] - window) // hop if data.shape[0] >= window else 0
    if n <= 0:
        return np.zeros((0, window) + data.shape[1:], dtype=data.dtype)
    idx = np.arange(window)[None, :] + hop * np.arange(n)[:, None]
    return data[idx]


def periodic_hann(length: int) -> np.ndarray:
    """Periodic Hann window (as VGGish uses).

    Args:
        length: Window length.

    Returns:
        ``0.5 − 0.5 cos(2πk/length)`` for ``k = 0 … length−1``.
    """
    return 0.5 - 0.5 * np.cos(2 * np.pi / length * np.arange(length))


def hertz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """HTK mel scale, ``1127 ln(1 + f/700)``.

    Args:
        hz: Frequencies in Hz.

    Returns:
        The mel values (float64).
    """
    return 1127.0 * np.log(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_matrix(
    num_mel_bins: int = NUM_BANDS,
    num_spectrogram_bins: int = 257,
    sample_rate: int = SAMPLE_RATE,
    lower_hz: float = MEL_MIN_HZ,
    upper_hz: float = MEL_MAX_HZ,
) -> np.ndarray:
    """HTK-style triangular mel weights, DC bin zeroed.

    Args:
        num_mel_bins: Number of mel bands.
        num_spectrogram_bins: Number of FFT magnitude bins (``fft/2 + 1``).
        sample_rate: Sample rate in Hz.
        lower_hz: Lower edge of the lowest band, in Hz.
        upper_hz: Upper edge of the highest band, in Hz.

    Returns:
        The ``(num_spectrogram_bins, num_mel_bins)`` weight matrix.

    Raises:
        ValueError: Unless ``0 ≤ lower_hz < upper_hz ≤ sample_rate/2``.
    """
    nyquist = sample_rate / 2.0
    if not 0.0 <= lower_hz < upper_hz <= nyquist:
        raise ValueError(f"need 0 <= lower_hz < upper_hz <= Nyquist ({nyquist}), got {lower_hz}, {upper_hz}")
    bins_mel = hertz_to_mel(np.linspace(0.0, nyquist, num_spectrogram_bins))
    edges = np.linspace(hertz_to_mel(lower_hz), hertz_to_mel(upper_hz), num_mel_bins + 2)
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    up = (bins_mel[:, None] - lower[None, :]) / (center - lower)[None, :]
    down = (upper[None, :] - bins_mel[:, None]) / (upper - center)[None, :]
    weights = np.maximum(0.0, np.minimum(up, down))
    weights[0, :] = 0.0
    return weights


def log_mel(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Log-mel spectrogram ``log(mel + 0.01)`` of a mono waveform (25 ms window, 10 ms hop).

    Args:
        samples: Mono waveform.
        sample_rate: Its sample rate in Hz.

    Returns:
        ``(num_frames, 64)`` float64.
    """
    win = int(round(sample_rate * STFT_WINDOW_S))
    hop = int(round(sample_rate * STFT_HOP_S))
    fft = 2 ** int(np.ceil(np.log2(win)))
    frames = frame(samples.astype(np.float64), win, hop) * periodic_hann(win)
    spec = np.abs(np.fft.rfft(frames, fft))
    mel = spec @ mel_matrix(NUM_BANDS, spec.shape[1], sample_rate)
    return np.log(mel + LOG_OFFSET)


def waveform_to_examples(data: np.ndarray, sample_rate: int) -> np.ndarray:
    """Non-overlapping 0.96 s log-mel patches of a waveform (channels averaged, resampled to 16 kHz).

    Args:
        data: Waveform in [−1, 1], mono ``(N,)`` or ``(N, channels)``.
        sample_rate: Its sample rate in Hz.

    Returns:
        ``(num_examples, 96, 64)``.
    """
    if data.ndim > 1:
        data = data.mean(axis=1)
    if sample_rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        g = gcd(int(sample_rate), SAMPLE_RATE)
        data = resample_poly(data, SAMPLE_RATE // g, int(sample_rate) // g)
    features = log_mel(data, SAMPLE_RATE)
    return frame(features, NUM_FRAMES, NUM_FRAMES)  # 0.96 s windows at 100 frames/s, no overlap


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a WAV file, scaled to [−1, 1] (int16 / 32768, as the authors).

    Args:
        path: The ``.wav`` file.

    Returns:
        ``(waveform, sample_rate)``.
    """
    from scipy.io import wavfile

    sr, data = wavfile.read(str(path))
    if data.dtype == np.int16:
        data = data / 32768.0
    elif data.dtype == np.int32:
        data = data / 2147483648.0
    elif data.dtype == np.uint8:
        data = (data.astype(np.float64) - 128.0) / 128.0
    else:
        data = data.astype(np.float64)
    return data, int(sr)


# -- encodings ---------------------------------------------------------------------------------------
def encode_patch(patch: np.ndarray, encoding: str = "viridis_jpeg", jpeg_quality: int = 75) -> np.ndarray:
    """Turn one 96×64 log-mel patch into the model input (module docstring, "Encoding").

    Args:
        patch: The ``(96, 64)`` log-mel patch.
        encoding: ``"viridis_jpeg"``, ``"viridis"`` or ``"logmel"``.
        jpeg_quality: JPEG quality of ``"viridis_jpeg"`` (PIL's default 75).

    Returns:
        uint8 ``(3, 96, 64)`` for the viridis encodings, float32 ``(1, 96, 64)`` for ``"logmel"``.

    Raises:
        ValueError: On an unknown encoding.
    """
    if encoding == "logmel":
        return patch.astype(np.float32)[None]
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    from matplotlib import colormaps

    lo, hi = float(patch.min()), float(patch.max())
    norm = (patch - lo) / (hi - lo) if hi > lo else np.zeros_like(patch)
    rgb = colormaps["viridis"](norm, bytes=True)[..., :3]  # (96, 64, 3) uint8, as plt.imsave
    if encoding == "viridis_jpeg":
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="JPEG", quality=jpeg_quality)
        buf.seek(0)
        with Image.open(buf) as img:
            rgb = np.asarray(img.convert("RGB"))
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


# -- labels --------------------------------------------------------------------------------------------
def read_class_index(path: Path) -> dict[str, int]:
    """Read ``class_labels_indices.csv``.

    Args:
        path: The CSV (columns ``index``, ``mid``, ``display_name``).

    Returns:
        Label id (``mid``) → class index.
    """
    with open(path, newline="") as fh:
        return {row["mid"]: int(row["index"]) for row in csv.DictReader(fh)}


def read_file_labels(path: Path, class_index: dict[str, int]) -> dict[str, list[int]]:
    """Read the positive labels of every file.

    Args:
        path: A CSV with ``YTID`` and ``positive_labels`` (comma-separated ``mid`` s) columns.
        class_index: ``mid`` → class index (:func:`read_class_index`).

    Returns:
        ``YTID → [class indices]``.

    Raises:
        ValueError: If a label is not in the class index.
    """
    out = {}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh, skipinitialspace=True)
        for row in reader:
            mids = [m.strip() for m in row["positive_labels"].strip('"').split(",") if m.strip()]
            unknown = [m for m in mids if m not in class_index]
            if unknown:
                raise ValueError(f"{path}: labels {unknown} of {row['YTID']} are not in the class index")
            out[row["YTID"].strip()] = [class_index[m] for m in mids]
    return out


def hit_rate(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The authors' multi-label "accuracy" (hit rate).

    Args:
        logits: ``(N, C)`` scores.
        targets: ``(N, C)`` multi-hot labels.

    Returns:
        The fraction of examples whose top-scoring class is one of their positive labels.
    """
    top = logits.argmax(dim=-1)
    return float(targets.gather(1, top[:, None]).squeeze(1).gt(0.5).float().mean())


# -- dataset -------------------------------------------------------------------------------------------
def build_split(
    wav_dir: Path,
    labels: dict[str, list[int]],
    num_classes: int,
    encoding: str,
    jpeg_quality: int,
    max_files: int | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Examples and multi-hot labels of every ``<YTID>.wav`` in ``wav_dir`` that has a label.

    Unreadable files are skipped and counted.

    Args:
        wav_dir: Folder of ``<YTID>.wav`` files.
        labels: ``YTID → [class indices]``.
        num_classes: Number of classes C.
        encoding: Patch encoding (:func:`encode_patch`).
        jpeg_quality: JPEG quality of ``"viridis_jpeg"``.
        max_files: Use only the first files in name order (``None``: all).

    Returns:
        ``(x, y, stats)``: stacked encoded patches, uint8 ``(N, C)`` multi-hot labels, and
        ``files`` / ``failed_files`` / ``examples`` counts.

    Raises:
        DataNotFoundError: If no usable labelled file is found.
    """
    files = sorted(p for p in wav_dir.glob("*.wav") if p.stem in labels)
    if max_files is not None:
        files = files[:max_files]
    xs, ys, failed = [], [], 0
    for path in files:
        try:
            data, sr = read_wav(path)
            patches = waveform_to_examples(data, sr)
        except Exception as err:  # corrupt or unsupported file: skip, as the authors did
            log.warning("skipping %s: %s", path.name, err)
            failed += 1
            continue
        target = np.zeros(num_classes, dtype=np.uint8)
        target[labels[path.stem]] = 1
        for patch in patches:
            xs.append(encode_patch(patch, encoding, jpeg_quality))
            ys.append(target)
    if not xs:
        raise DataNotFoundError(f"{wav_dir}: no usable labelled .wav files ({failed} failed). {HOW_TO_GET}")
    stats = {"files": len(files) - failed, "failed_files": failed, "examples": len(xs)}
    return np.stack(xs), np.stack(ys), stats


def load_audioset(
    data_dir: str,
    root: str = "audioset",
    train_wav: str = "train_wav",
    train_csv: str = "train.csv",
    val_wav: str = "valid_wav",
    val_csv: str = "valid.csv",
    labels_csv: str = "class_labels_indices.csv",
    encoding: str = "viridis_jpeg",
    jpeg_quality: int = 75,
    max_files: int | None = None,
    cache_dir: str | None = "~/.cache/curvopt/audioset",
    name: str = "audioset",
) -> DataBundle:
    """AudioSet train and validation examples (layout and recipe in the module docstring).

    Args:
        data_dir: Data directory.
        root: Folder under ``data_dir`` holding the files.
        train_wav: Folder of training ``.wav`` files.
        train_csv: Training labels CSV.
        val_wav: Folder of validation ``.wav`` files.
        val_csv: Validation labels CSV.
        labels_csv: The class index CSV.
        encoding: Patch encoding (:func:`encode_patch`).
        jpeg_quality: JPEG quality of ``"viridis_jpeg"``.
        max_files: Use only this many files per split (``None``: all).
        cache_dir: Where processed arrays are cached as ``.npz`` (keyed by the settings);
            ``None``: no cache.
        name: ``meta["name"]`` of the bundle.

    Returns:
        The bundle (no ``test`` split); targets are float multi-hot ``(N, num_classes)``.

    Raises:
        DataNotFoundError: If a required file or folder is missing.
    """
    base = Path(data_dir) / root
    needed = [labels_csv, train_csv, val_csv, train_wav + "/", val_wav + "/"]
    missing = [n for n in needed if not (base / n.rstrip("/")).exists()]
    if missing:
        raise DataNotFoundError(missing_data_message("AudioSet", base, missing, HOW_TO_GET))
    class_index = read_class_index(base / labels_csv)
    num_classes = len(class_index)
    settings = {
        "base": str(base.resolve()),
        "encoding": encoding,
        "jpeg_quality": jpeg_quality,
        "max_files": max_files,
        "version": 1,
    }
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(os.path.expanduser(cache_dir)) if cache_dir else None
    splits, meta_stats = {}, {}
    for split, wav, csv_name in (("train", train_wav, train_csv), ("val", val_wav, val_csv)):
        cached = cache / f"audioset_{split}_{key}.npz" if cache is not None else None
        if cached is not None and cached.is_file():
            with np.load(cached) as z:
                x, y, stats = z["x"], z["y"], json.loads(str(z["stats"]))
        else:
            labels = read_file_labels(base / csv_name, class_index)
            x, y, stats = build_split(base / wav, labels, num_classes, encoding, jpeg_quality, max_files)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                np.savez(cached, x=x, y=y, stats=json.dumps(stats))
        splits[split] = (torch.from_numpy(x), torch.from_numpy(y.astype(np.float32)))
        meta_stats[split] = stats
    return DataBundle(
        train=splits["train"],
        val=splits["val"],
        test=None,
        meta={
            "name": name,
            "synthetic": False,
            "source": str(base),
            "num_classes": num_classes,
            "encoding": encoding,
            "stats": meta_stats,
        },
    )
