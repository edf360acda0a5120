"""CURVES (Hinton & Salakhutdinov 2006): the real ``digs3pts_1.mat`` if present, else a generator.

Without the file, a seeded **CURVES-like** generator stands in.

The original data set (Martens' ``digs3pts_1.mat``: ``bdata`` 20,000 × 784 training rows,
``bdatatest`` 10,000 × 784 test rows, intensities in [0, 1]) could not be obtained here
(docs/shf.md, "Reproducing Figure 2, Figure 3 and Table 2"). Its published description: 28×28
images of curves drawn
through three random points in 2-D, so the intrinsic dimensionality is 6. The exact rendering
recipe lives in the 2006 paper's supplementary material, which was not available, so the generator
below is an *approximation* of that recipe and everything produced by it is labelled
``curves_like`` / ``synthetic=True``; it must never be reported as the original data.

Generator (version ``GENERATOR_VERSION``):

* three control points ``P0, P1, P2`` uniform in ``[margin, 27 − margin]²`` (pixel-centre
  coordinates, continuous) — 6 degrees of freedom per image, like the original;
* the quadratic curve through them: ``P0`` at ``t = 0``, ``P1`` at ``t = τ``, ``P2`` at ``t = 1``
  with chord-length ``τ = |P0P1| / (|P0P1| + |P1P2|)`` (``parametrisation='chord'``; ``'uniform'``
  uses τ = ½, i.e. the quadratic Bézier whose middle control point makes it pass through P1);
* rasterised as an anti-aliased stroke: the distance ``d`` of each pixel centre to the curve
  (``segments + 1`` samples along it) gives intensity ``clip(w/2 + ½ − d, 0, 1)`` — full ink
  within half the stroke width ``w``, a one-pixel linear ramp outside.

Splits (the paper gives only the sizes; docs/decisions.md, SHF-11): train = the 20,000 ``bdata``
rows; the 10,000 ``bdatatest`` rows are split at random (``split_seed``) into 8,000 test and 2,000
validation.
The generator's 30,000 images play the roles of ``bdata`` (first 20,000) and ``bdatatest``.
Generated sets are cached as ``.npz`` under ``<data_dir>/curves_like/``, or under
``<cache_dir>/curves_like/`` when the data directory is read-only (its mode bits say so — the
shared data directory is never written to, even by root).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import missing_data_message, split_indices
from curvopt.errors import CorruptDataError, DataNotFoundError

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1
SIDE = 28
REAL_FILE = "digs3pts_1.mat"
HOW_TO_GET = (
    "download digs3pts_1.mat from James Martens' HF page (www.cs.toronto.edu/~jmartens/) into "
    "<data_dir>/curves/; without it the CURVES-like generator is used (source='auto')."
)
SOURCES = ("auto", "real", "synthetic")


# -- the generator ------------------------------------------------------------------------------------
def _curve_points(ctrl: np.ndarray, segments: int, parametrisation: str) -> np.ndarray:
    """``(n, segments+1, 2)`` points on the quadratic through the three control points (x, y)."""
    p0, p1, p2 = ctrl[:, 0], ctrl[:, 1], ctrl[:, 2]
    if parametrisation == "chord":
        a = np.linalg.norm(p1 - p0, axis=1)
        b = np.linalg.norm(p2 - p1, axis=1)
        tau = np.where(a + b > 1e-9, a / np.maximum(a + b, 1e-9), 0.5)
        tau = np.clip(tau, 0.05, 0.95)  # a point on top of an endpoint would make the quadratic explode
    elif parametrisation == "uniform":
        tau = np.full(ctrl.shape[0], 0.5)
    else:
        raise ValueError(f"parametrisation must be 'chord' or 'uniform', got {parametrisation!r}")
    t = np.linspace(0.0, 1.0, segments + 1)[None, :, None]
    tau = tau[:, None, None]
    # Lagrange basis on the nodes (0, τ, 1)
    l0 = (t - tau) * (t - 1.0) / (tau * 1.0)
    l1 = t * (t - 1.0) / (tau * (tau - 1.0))
    l2 = t * (t - tau) / (1.0 - tau)
    return l0 * p0[:, None, :] + l1 * p1[:, None, :] + l2 * p2[:, None, :]


def _render(points: np.ndarray, stroke_width: float) -> np.ndarray:
    """Anti-aliased stroke through the densely sampled curve ``points`` ``(n, m, 2)`` → ``(n, 784)``.

    The distance of each pixel centre to the curve is the minimum over the samples near it: every
    sample "splats" its distance onto the pixels of a small window around it (scatter-min), which
    is ~50× cheaper than pixel × segment distances and, with samples ≤ ¼ px apart, exact to ~0.01 px
    where the intensity is not saturated.
    """
    n, m, _ = points.shape
    reach = 0.5 * stroke_width + 0.5  # intensity is zero beyond this distance
    r = int(np.floor(reach + 0.5))  # |pixel − round(sample)| ≤ reach + ½ covers every pixel in reach
    offs = np.arange(-r, r + 1)
    ox, oy = np.meshgrid(offs, offs, indexing="ij")
    ox, oy = torch.from_numpy(ox.ravel()), torch.from_numpy(oy.ravel())  # (k,)
    pts = torch.from_numpy(points.astype(np.float32))
    base = torch.round(pts)
    px = base[..., 0:1] + ox  # (n, m, k) pixel columns
    py = base[..., 1:2] + oy  # (n, m, k) pixel rows
    dist = torch.sqrt((px - pts[..., 0:1]) ** 2 + (py - pts[..., 1:2]) ** 2)
    inside = (px >= 0) & (px < SIDE) & (py >= 0) & (py < SIDE)
    flat = (py.clamp(0, SIDE - 1) * SIDE + px.clamp(0, SIDE - 1)).long()
    flat = flat + (torch.arange(n) * SIDE * SIDE)[:, None, None]
    dist = torch.where(inside, dist, torch.full_like(dist, float("inf")))
    out = torch.full((n * SIDE * SIDE,), float("inf"))
    out.scatter_reduce_(0, flat.reshape(-1), dist.reshape(-1), reduce="amin")
    img = (reach - out).clamp_(0.0, 1.0)
    return img.view(n, SIDE * SIDE).numpy()


def generate_curves(
    n: int,
    seed: int = 0,
    stroke_width: float = 1.5,
    margin: float = 1.5,
    segments: int = 400,
    parametrisation: str = "chord",
    block: int = 1000,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``n`` CURVES-like images (module docstring).

    Deterministic in ``seed``; the control points are drawn in one call, so the first ``k``
    images are the same for every ``n ≥ k``. Rows are row-major 28×28 images (x = column).

    Args:
        n: Number of images.
        seed: Seed of the control points.
        stroke_width: Stroke width w in pixels.
        margin: Control points are uniform in ``[margin, 27 − margin]²``.
        segments: Samples along each curve are ``segments + 1``.
        parametrisation: ``"chord"`` or ``"uniform"`` (τ = ½).
        block: Images rendered per batch (memory).

    Returns:
        ``(images, control_points)``: ``(n, 784)`` float32 in [0, 1] and ``(n, 3, 2)`` float32.
    """
    rng = np.random.default_rng(seed)
    ctrl = rng.uniform(margin, SIDE - 1 - margin, size=(n, 3, 2))
    images = np.empty((n, SIDE * SIDE), dtype=np.float32)
    for i in range(0, n, block):
        pts = _curve_points(ctrl[i : i + block], segments, parametrisation)
        images[i : i + block] = _render(pts, stroke_width)
    return images, ctrl.astype(np.float32)


# -- files --------------------------------------------------------------------------------------------
def read_curves_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read Martens' ``digs3pts_1.mat`` (MATLAB v5, or v7.3 with h5py).

    Args:
        path: The ``.mat`` file.

    Returns:
        ``(bdata, bdatatest)`` as ``(N, 784)`` float32.

    Raises:
        CorruptDataError: If the file is unreadable or the variables are missing or misshapen.
    """
    try:
        import scipy.io

        mat = scipy.io.loadmat(str(path), variable_names=["bdata", "bdatatest"])
        train, test = mat.get("bdata"), mat.get("bdatatest")
    except NotImplementedError:  # v7.3 = HDF5; MATLAB stores the transpose
        try:
            import h5py
        except ImportError as err:
            raise CorruptDataError(f"{path} is a MATLAB v7.3 (HDF5) file; install h5py to read it") from err
        with h5py.File(path, "r") as f:
            train, test = np.asarray(f["bdata"]).T, np.asarray(f["bdatatest"]).T
    except (ValueError, OSError, TypeError) as err:
        raise CorruptDataError(f"{path}: not a readable MATLAB file ({err}); re-download it") from err
    if train is None or test is None:
        raise CorruptDataError(f"{path}: variables 'bdata' and 'bdatatest' expected")
    out = []
    for name, arr in (("bdata", train), ("bdatatest", test)):
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim != 2 or SIDE * SIDE not in arr.shape:
            raise CorruptDataError(f"{path}: {name} has shape {arr.shape}, expected (N, 784)")
        if arr.shape[1] != SIDE * SIDE:
            arr = arr.T  # stored as 784 × N
        out.append(np.ascontiguousarray(arr))
    return out[0], out[1]


def _writable_dir(path: Path) -> bool:
    """Whether ``path`` can be created/used for the cache.

    A directory whose owner-write bit is off counts as read-only even for root (who could write
    anyway): shared data directories are marked that way and must never receive generated files.
    """
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    if not probe.is_dir() or not (probe.stat().st_mode & stat.S_IWUSR) or not os.access(probe, os.W_OK):
        return False
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
        return True
    except OSError:
        return False


def _cache_file_name(seed: int, n_train: int, n_test: int, stroke_width: float, param: str) -> str:
    return f"curves_like_v{GENERATOR_VERSION}_seed{seed}_{n_train}x{n_test}_w{stroke_width:g}_{param}.npz"


def curves_like_arrays(
    data_dir: str | Path | None,
    seed: int = 0,
    n_train: int = 20000,
    n_test: int = 10000,
    stroke_width: float = 1.5,
    parametrisation: str = "chord",
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """The generated CURVES-like ``bdata`` and ``bdatatest``, through a ``.npz`` cache.

    The cache is looked up in ``<data_dir>/curves_like/`` then ``<cache_dir>/curves_like/`` and
    written to the first writable one (a read-only data directory is never written to).

    Args:
        data_dir: Data directory (``None``: only ``cache_dir``).
        seed: Generator seed.
        n_train: Images playing ``bdata``.
        n_test: Images playing ``bdatatest``.
        stroke_width: Stroke width in pixels.
        parametrisation: ``"chord"`` or ``"uniform"``.
        cache: Read and write the cache.
        cache_dir: Second cache location.

    Returns:
        ``(bdata, bdatatest, where)``: the arrays and the cache file used (or
        ``"generated (not cached)"``).
    """
    fname = _cache_file_name(seed, n_train, n_test, stroke_width, parametrisation)
    candidates = []
    if data_dir is not None:
        candidates.append(Path(data_dir) / "curves_like")
    if cache_dir is not None:
        candidates.append(Path(cache_dir) / "curves_like")
    if cache:
        for folder in candidates:
            path = folder / fname
            if path.is_file():
                try:
                    with np.load(path) as z:
                        return z["bdata"], z["bdatatest"], str(path)
                except (OSError, ValueError, KeyError) as err:
                    log.warning("CURVES-like cache %s unreadable (%s); regenerating", path, err)
    log.info("generating CURVES-like data (%d + %d images, seed %d)", n_train, n_test, seed)
    images, _ = generate_curves(n_train + n_test, seed, stroke_width, parametrisation=parametrisation)
    train, test = images[:n_train], images[n_train:]
    where = "generated (not cached)"
    if cache:
        for folder in candidates:
            if _writable_dir(folder):
                path = folder / fname
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
                np.savez_compressed(tmp, bdata=train, bdatatest=test)
                os.replace(tmp, path)
                where = str(path)
                break
        else:
            log.warning("CURVES-like: no writable cache directory among %s; not cached", candidates)
    return train, test, where


def load_curves(
    data_dir: str | None,
    num_train: int | None = 20000,
    num_val: int = 2000,
    num_test: int | None = 8000,
    split_seed: int | None = 0,
    source: str = "auto",
    generator_seed: int = 0,
    stroke_width: float = 1.5,
    parametrisation: str = "chord",
    cache: bool = True,
    cache_dir: str | None = None,
    target: str = "image",
    dtype: torch.dtype = torch.float32,
    generated_train: int = 20000,
    generated_test: int = 10000,
) -> DataBundle:
    """CURVES as a :class:`DataBundle` (autoencoder targets ``y = x``).

    Train = the first ``num_train`` ``bdata`` rows; validation and test are disjoint random
    subsets (``split_seed``) of ``bdatatest``.

    Args:
        data_dir: Data directory (``None``: generate, cache only in ``cache_dir``).
        num_train: First ``bdata`` rows used for training (``None``: all).
        num_val: Validation rows drawn from ``bdatatest`` (0: no validation split).
        num_test: Test rows drawn from the rest of ``bdatatest`` (``None``: all the rest).
        split_seed: Seed of the validation/test split (``None``: file order).
        source: ``"auto"`` reads ``<data_dir>/curves/digs3pts_1.mat`` when it exists and
            otherwise uses the CURVES-like generator (logged, and ``meta['synthetic'] = True``,
            ``name = 'curves_like'``); ``"real"`` insists on the file; ``"synthetic"`` always
            generates.
        generator_seed: Seed of the CURVES-like generator.
        stroke_width: Generator stroke width in pixels.
        parametrisation: Generator parametrisation, ``"chord"`` or ``"uniform"``.
        cache: Use the generator's ``.npz`` cache.
        cache_dir: Second cache location (when the data directory is read-only).
        target: Must be ``"image"`` (CURVES has no labels).
        dtype: Dtype of the tensors.
        generated_train: CURVES-like images playing ``bdata`` (the original's 20,000; smaller
            only for tests).
        generated_test: CURVES-like images playing ``bdatatest`` (the original's 10,000).

    Returns:
        The bundle.

    Raises:
        ValueError: On an unknown ``source``, a ``target`` other than ``"image"`` or more
            training rows than exist.
        DataNotFoundError: If ``source="real"`` and the file is missing.
        CorruptDataError: If the file is unreadable.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if target != "image":
        raise ValueError("CURVES has no labels: target must be 'image'")
    real_path = None if data_dir is None else Path(data_dir) / "curves" / REAL_FILE
    use_real = source == "real" or (source == "auto" and real_path is not None and real_path.is_file())
    if use_real:
        if real_path is None or not real_path.is_file():
            directory = Path(data_dir or ".") / "curves"
            raise DataNotFoundError(missing_data_message("CURVES", directory, [REAL_FILE], HOW_TO_GET))
        train, test = read_curves_mat(real_path)
        meta = {"name": "curves", "synthetic": False, "source": str(real_path.resolve())}
    else:
        if source == "auto":
            log.warning(
                "CURVES: %s not found; using the CURVES-like generator (a documented approximation, "
                "labelled curves_like — not the original data)",
                real_path,
            )
        train, test, where = curves_like_arrays(
            data_dir,
            generator_seed,
            generated_train,
            generated_test,
            stroke_width,
            parametrisation,
            cache,
            cache_dir,
        )
        meta = {
            "name": "curves_like",
            "display_name": "CURVES-like",
            "synthetic": True,
            "source": where,
            "generator": {
                "version": GENERATOR_VERSION,
                "seed": generator_seed,
                "stroke_width": stroke_width,
                "parametrisation": parametrisation,
            },
        }
    n_tr = train.shape[0] if num_train is None else num_train
    if n_tr > train.shape[0]:
        raise ValueError(f"num_train={n_tr} but only {train.shape[0]} training images exist")
    n_te = test.shape[0] - num_val if num_test is None else num_test
    val_idx, test_idx = split_indices(test.shape[0], [num_val, n_te], split_seed)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dtype)

    x_tr = tensor(train[:n_tr])
    x_val = tensor(test[val_idx.numpy()]) if num_val > 0 else None
    x_te = tensor(test[test_idx.numpy()])
    meta.update(split_seed=split_seed, target=target)
    return DataBundle(
        train=(x_tr, x_tr),
        val=None if x_val is None else (x_val, x_val),
        test=(x_te, x_te),
        meta=meta,
    )
