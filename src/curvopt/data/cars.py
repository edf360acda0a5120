"""Cars196 (Stanford Cars) as frozen ResNet-50 features, and a synthetic Cars196-shaped stand-in.

The FGN paper's head experiment (§5.2, Appendix F.2) passes every image once through a frozen
ImageNet ResNet-50 from TorchVision with the weights' own transform (no augmentation), keeps the
2048-d average-pooled pre-classifier output (``fc = Identity``, eval mode), standardises each
coordinate with the *training-set* mean and std, and caches the result. 8,144 train / 8,041 test
images, 196 classes.

Sources, in the order ``source="auto"`` tries them:

1. a feature cache ``resnet50_<weights>.pt`` (dict ``train_x, train_y, test_x, test_y`` of raw,
   un-standardised float32 features and int64 labels 0..195) in ``<data_dir>/cars196/features``
   or ``cache_dir``;
2. images, from which the cache is built once (needs ``torchvision`` and the ResNet-50 weights in
   the torch hub cache; imported lazily, so nothing else needs them):
   - an image folder ``<data_dir>/cars196/images/{train,test}/<class>/*`` (class = sorted folder
     name), or
   - TorchVision's StanfordCars layout ``<data_dir>/cars196/stanford_cars/{cars_train,cars_test}``
     with ``devkit/cars_train_annos.mat`` and ``cars_test_annos_withlabels.mat`` (labels 1..196),
     or
   - a Hugging Face dataset saved with ``save_to_disk`` at ``<data_dir>/cars196/hf`` (or the
     hub id in ``hf_dataset``) with ``train``/``test`` splits and ``image``/``label`` columns.

None of these exists in this workplace (no Cars196 images, no torchvision, no weights). For
offline and quick runs, :func:`cars196_synthetic` builds a stand-in with the same shapes, labelled
``synthetic=True`` in ``DataBundle.meta`` (and therefore in every record and figure).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvopt.api import DataBundle
from curvopt.data.common import hub_reachable, missing_data_message, offline_note
from curvopt.errors import DataNotFoundError

log = logging.getLogger(__name__)

NUM_CLASSES = 196
NUM_TRAIN = 8144
NUM_TEST = 8041
FEATURE_DIM = 2048
WEIGHTS = ("IMAGENET1K_V2", "IMAGENET1K_V1")
HOW_TO_GET = (
    "provide a feature cache resnet50_<weights>.pt (train_x/train_y/test_x/test_y) in "
    "<data_dir>/cars196/features, or the Cars196 images (an image folder <data_dir>/cars196/images/"
    "{train,test}/<class>/, TorchVision's stanford_cars layout, or a saved HF dataset at "
    "<data_dir>/cars196/hf) together with torchvision and its ResNet-50 weights; offline, use "
    "dataset=cars196_synthetic (a labelled synthetic stand-in)."
)


# -- standardisation and splits ---------------------------------------------------------------------
def standardize(train: Tensor, *others: Tensor, eps: float = 1e-6) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Standardise features with training-set statistics (docs/decisions.md, FGN-6).

    Per-coordinate ``(x − mean_train) / (std_train + eps)`` with the population std of the
    training features, applied unchanged to the other splits.

    Args:
        train: ``(n, d)`` training features (they define the statistics).
        *others: Further splits to transform the same way.
        eps: Added to the std.

    Returns:
        ``([train, *others] standardised, {"mean": ..., "std": ...})``.
    """
    mean = train.mean(dim=0)
    std = train.std(dim=0, unbiased=False)
    scale = std + eps
    out = [(t - mean) / scale for t in (train, *others)]
    return out, {"mean": mean, "std": std}


def stratified_split(y: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Stratified hold-out: ``round(fraction · n_c)`` examples of every class c.

    At least one is held out when the fraction is positive and the class has two or more, and at
    least one is kept.

    Args:
        y: Integer labels.
        fraction: Fraction of each class to hold out.
        seed: Seed of the per-class shuffles.

    Returns:
        ``(keep, held_out)`` sorted index tensors.
    """
    g = torch.Generator().manual_seed(seed)
    keep, held = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        k = int(round(fraction * idx.numel()))
        if fraction > 0 and idx.numel() >= 2:
            k = min(max(k, 1), idx.numel() - 1)
        held.append(idx[:k])
        keep.append(idx[k:])
    return torch.sort(torch.cat(keep)).values, torch.sort(torch.cat(held)).values


def _bundle(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    meta: dict[str, Any],
    standardize_features: bool,
    eps: float,
    val_fraction: float,
    split_seed: int,
) -> DataBundle:
    val = None
    if val_fraction > 0:
        keep, held = stratified_split(train_y, val_fraction, split_seed)
        val = (train_x[held], train_y[held])
        train_x, train_y = train_x[keep], train_y[keep]
    if standardize_features:
        parts = [train_x, test_x] + ([val[0]] if val is not None else [])
        scaled, _ = standardize(*parts, eps=eps)
        train_x, test_x = scaled[0], scaled[1]
        if val is not None:
            val = (scaled[2], val[1])
    meta = {
        **meta,
        "num_classes": NUM_CLASSES,
        "feature_dim": int(train_x.shape[1]),
        "standardized": bool(standardize_features),
        "val_fraction": float(val_fraction),
    }
    return DataBundle(train=(train_x, train_y), val=val, test=(test_x, test_y), meta=meta)


# -- the synthetic stand-in ------------------------------------------------------------------------
def cars196_synthetic(
    num_train: int = NUM_TRAIN,
    num_test: int = NUM_TEST,
    num_classes: int = NUM_CLASSES,
    dim: int = FEATURE_DIM,
    num_makes: int = 49,
    latent_dim: int = 64,
    make_scale: float = 0.4,
    model_scale: float = 0.2,
    noise_scale: float = 1.0,
    nuisance_scale: float = 1.0,
    seed: int = 0,
    standardize_features: bool = True,
    eps: float = 1e-6,
    val_fraction: float = 0.0,
    split_seed: int = 0,
    name: str = "cars196_synthetic",
) -> DataBundle:
    """A deterministic Cars196-*shaped* stand-in: 196 classes, 2048-d non-negative features.

    8,144 / 8,041 examples. **Synthetic** (``meta['synthetic'] = True``); numbers obtained on it
    are not Cars196 results.

    Why this structure: fine-grained car classes are confusable within a make, so classes are
    grouped into ``num_makes`` makes. A class's latent mean is its make's centre plus a smaller
    model offset; an example is its class mean plus latent noise, mapped through a fixed random
    ``latent_dim → dim`` projection, plus per-coordinate nuisance noise, and rectified (ReLU, like
    pooled CNN features). A linear head then learns slowly and saturates well below 100 % test
    accuracy, and its competitor mass concentrates on the sibling models (small ξ), so accuracy
    curves and FGN's diagnostics behave qualitatively like a frozen-feature head. Labels cycle
    through the classes (41-42 train examples per class, as in Cars196's average).

    Args:
        num_train: Training examples.
        num_test: Test examples.
        num_classes: Number of classes.
        dim: Feature dimension.
        num_makes: Number of makes the classes are grouped into.
        latent_dim: Dimension of the latent class means.
        make_scale: Standard deviation of the make centres.
        model_scale: Standard deviation of a class's offset from its make centre.
        noise_scale: Standard deviation of the per-example latent noise.
        nuisance_scale: Standard deviation of the per-coordinate noise after the projection.
        seed: Seed of every draw.
        standardize_features: Standardise with training statistics (:func:`standardize`).
        eps: Added to the std when standardising.
        val_fraction: Fraction of each class held out of train as validation (0: none).
        split_seed: Seed of the validation hold-out.
        name: ``meta["name"]`` of the bundle.

    Returns:
        The bundle, ``meta["synthetic"] = True``.
    """
    g = torch.Generator().manual_seed(seed)
    make_of_class = torch.arange(num_classes) % num_makes
    makes = torch.randn(num_makes, latent_dim, generator=g) * make_scale
    class_means = makes[make_of_class] + torch.randn(num_classes, latent_dim, generator=g) * model_scale
    projection = torch.randn(latent_dim, dim, generator=g) / latent_dim**0.5

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.arange(n) % num_classes
        y = y[torch.randperm(n, generator=g)]
        latent = class_means[y] + torch.randn(n, latent_dim, generator=g) * noise_scale
        x = latent @ projection + torch.randn(n, dim, generator=g) * nuisance_scale
        return torch.relu(x), y

    train_x, train_y = draw(num_train)
    test_x, test_y = draw(num_test)
    meta = {
        "name": name,
        "synthetic": True,
        "source": f"synthetic stand-in (seed {seed}); NOT Cars196",
        "generator": {
            "num_makes": num_makes,
            "latent_dim": latent_dim,
            "make_scale": make_scale,
            "model_scale": model_scale,
            "noise_scale": noise_scale,
            "nuisance_scale": nuisance_scale,
        },
    }
    return _bundle(
        train_x, train_y, test_x, test_y, meta, standardize_features, eps, val_fraction, split_seed
    )


# -- the real pipeline ---------------------------------------------------------------------------------
def _import_torchvision() -> Any:
    try:
        import torchvision  # noqa: PLC0415
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Cars196 feature extraction needs torchvision (ResNet-50 and its ImageNet weight "
            "transform), which is not installed. Install the build matching torch, e.g. "
            "`pip install torch==2.13.0 torchvision==0.28.*` (CPU wheel index for CPU torch), or "
            "provide a pre-extracted feature cache, or use dataset=cars196_synthetic."
        ) from err
    return torchvision


def _feature_cache_name(weights: str) -> str:
    return f"resnet50_{weights}.pt"


def load_feature_cache(path: Path) -> dict[str, Tensor]:
    """Read and check a feature cache (``.pt`` dict or ``.npz`` with the same keys).

    Args:
        path: The cache file.

    Returns:
        ``train_x``/``test_x`` float32 and ``train_y``/``test_y`` int64.

    Raises:
        ValueError: If a key is missing, shapes disagree or labels are outside ``[0, 196)``.
    """
    if path.suffix == ".npz":
        with np.load(path) as f:
            raw = {k: torch.from_numpy(f[k]) for k in f.files}
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("train_x", "train_y", "test_x", "test_y"):
        if key not in raw:
            raise ValueError(f"{path}: feature cache lacks {key!r} (has {sorted(raw)})")
    out = {
        "train_x": raw["train_x"].float(),
        "test_x": raw["test_x"].float(),
        "train_y": raw["train_y"].long(),
        "test_y": raw["test_y"].long(),
    }
    for split in ("train", "test"):
        x, y = out[f"{split}_x"], out[f"{split}_y"]
        if x.dim() != 2 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{path}: {split}_x {tuple(x.shape)} and {split}_y {tuple(y.shape)} do not match"
            )
        if y.min() < 0 or y.max() >= NUM_CLASSES:
            raise ValueError(
                f"{path}: {split} labels must lie in [0, {NUM_CLASSES}) (got {int(y.min())}..{int(y.max())})"
            )
    return out


def _image_folder_items(root: Path) -> dict[str, list[tuple[Path, int]]] | None:
    train_dir, test_dir = root / "train", root / "test"
    if not (train_dir.is_dir() and test_dir.is_dir()):
        return None
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    test_classes = sorted(p.name for p in test_dir.iterdir() if p.is_dir())
    if classes != test_classes:
        raise ValueError(f"{root}: train and test class folders differ")
    if len(classes) != NUM_CLASSES:
        raise ValueError(f"{root}: expected {NUM_CLASSES} class folders, found {len(classes)}")
    exts = {".jpg", ".jpeg", ".png"}
    items: dict[str, list[tuple[Path, int]]] = {}
    for split, folder in (("train", train_dir), ("test", test_dir)):
        items[split] = [
            (f, label)
            for label, cls in enumerate(classes)
            for f in sorted((folder / cls).iterdir())
            if f.suffix.lower() in exts
        ]
    return items


def _stanford_layout_items(root: Path) -> dict[str, list[tuple[Path, int]]] | None:
    train_annos = root / "devkit" / "cars_train_annos.mat"
    test_annos = root / "cars_test_annos_withlabels.mat"
    if not (train_annos.is_file() and test_annos.is_file()):
        return None
    from scipy.io import loadmat  # noqa: PLC0415

    items = {}
    for split, annos, folder in (("train", train_annos, "cars_train"), ("test", test_annos, "cars_test")):
        records = loadmat(annos, squeeze_me=True)["annotations"]
        items[split] = [
            (root / folder / str(r["fname"]), int(r["class"]) - 1) for r in records
        ]  # 1..196 → 0..195
    return items


def _pil_images(items: list[tuple[Path, int]]) -> Iterator[tuple[Any, int]]:
    from PIL import Image  # noqa: PLC0415

    for path, label in items:
        with Image.open(path) as img:
            yield img.convert("RGB"), label


def _hf_images(source: str, split: str) -> Iterator[tuple[Any, int]]:
    import datasets  # noqa: PLC0415

    if not Path(source).exists() and not hub_reachable():
        raise DataNotFoundError(
            f"Cars196: {source} is neither a local dataset directory nor reachable\n{offline_note()}"
        )
    ds = (
        datasets.load_from_disk(source)[split]
        if Path(source).exists()
        else datasets.load_dataset(source, split=split)
    )
    label_key = "label" if "label" in ds.column_names else "labels"
    for row in ds:
        yield row["image"].convert("RGB"), int(row[label_key])


def extract_resnet50_features(
    images: Iterable[tuple[Any, int]],
    weights: str = "IMAGENET1K_V2",
    device: str = "cpu",
    batch_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Frozen ResNet-50 features (``fc = Identity``, eval mode) with the weights' own transform.

    Args:
        images: ``(PIL image, label)`` pairs.
        weights: ``"IMAGENET1K_V2"`` or ``"IMAGENET1K_V1"``.
        device: Device of the forward passes.
        batch_size: Images per forward pass.

    Returns:
        ``(features, labels)``: float32 ``(n, 2048)`` and int64 ``(n,)``.

    Raises:
        ImportError: If torchvision is missing.
        ValueError: On unknown weights.
        DataNotFoundError: If the weights cannot be loaded.
    """
    tv = _import_torchvision()
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    enum = getattr(tv.models.ResNet50_Weights, weights)
    try:
        model = tv.models.resnet50(weights=enum)
    except Exception as err:  # pragma: no cover - offline weight download
        raise DataNotFoundError(
            f"could not load TorchVision ResNet-50 weights {weights}: {err}\n"
            f"Put the checkpoint ({enum.url.rsplit('/', 1)[-1]}) into $TORCH_HOME/hub/checkpoints/ "
            "or run once with network access."
        ) from err
    model.fc = torch.nn.Identity()
    model.eval().to(device)
    transform = enum.transforms()
    feats, labels, batch, batch_labels = [], [], [], []

    def flush() -> None:
        with torch.inference_mode():
            feats.append(model(torch.stack(batch).to(device)).float().cpu())
        labels.extend(batch_labels)
        batch.clear()
        batch_labels.clear()

    for img, label in images:
        batch.append(transform(img))
        batch_labels.append(label)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return torch.cat(feats), torch.tensor(labels, dtype=torch.long)


def build_feature_cache(
    data_dir: Path, cache_path: Path, weights: str, hf_dataset: str | None, device: str, batch_size: int
) -> Path | None:
    """Extract features from whichever image source exists and save them as a cache.

    Sources, in order: an image folder, TorchVision's StanfordCars layout, a Hugging Face
    dataset (module docstring).

    Args:
        data_dir: Data directory (sources are looked up under ``cars196/``).
        cache_path: Where to write the cache.
        weights: ResNet-50 weights name.
        hf_dataset: Hugging Face dataset id or path (default ``<data_dir>/cars196/hf`` if present).
        device: Device of the extraction.
        batch_size: Images per forward pass.

    Returns:
        ``cache_path``, or ``None`` when no image source exists.
    """
    root = data_dir / "cars196"
    sources: list[tuple[str, Any]] = []
    for finder, sub in ((_image_folder_items, "images"), (_stanford_layout_items, "stanford_cars")):
        found = finder(root / sub) if (root / sub).is_dir() else None
        if found is not None:
            sources.append((f"{root / sub}", {s: _pil_images(found[s]) for s in ("train", "test")}))
    hf_source = hf_dataset or (str(root / "hf") if (root / "hf").is_dir() else None)
    if not sources and hf_source is not None:
        sources.append((hf_source, {s: _hf_images(hf_source, s) for s in ("train", "test")}))
    if not sources:
        return None
    origin, streams = sources[0]
    log.info(
        "extracting Cars196 ResNet-50 %s features from %s (once; cached at %s)", weights, origin, cache_path
    )
    train_x, train_y = extract_resnet50_features(streams["train"], weights, device, batch_size)
    test_x, test_y = extract_resnet50_features(streams["test"], weights, device, batch_size)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "train_x": train_x,
            "train_y": train_y,
            "test_x": test_x,
            "test_y": test_y,
            "meta": {
                "weights": weights,
                "source": origin,
                "extractor": "torchvision resnet50, fc=Identity, eval",
            },
        },
        cache_path,
    )
    return cache_path


def cars196(
    data_dir: str = "data",
    source: str = "auto",
    cache_dir: str | None = None,
    weights: str = "IMAGENET1K_V2",
    hf_dataset: str | None = None,
    standardize_features: bool = True,
    eps: float = 1e-6,
    val_fraction: float = 0.0,
    split_seed: int = 0,
    extract_device: str = "cpu",
    extract_batch_size: int = 64,
    name: str = "cars196",
) -> DataBundle:
    """Real Cars196 ResNet-50 features (module docstring).

    Args:
        data_dir: Data directory.
        source: ``"auto"`` | ``"features"`` (cache only) | ``"images"`` (extract, then cache).
        cache_dir: Extra cache location (searched, and written instead of
            ``<data_dir>/cars196/features``).
        weights: ``"IMAGENET1K_V2"`` (TorchVision's DEFAULT, resize 232 / crop 224; the paper
            does not say; docs/decisions.md, FGN-6) or ``"IMAGENET1K_V1"``.
        hf_dataset: Hugging Face dataset id or path to extract from.
        standardize_features: Standardise with training statistics.
        eps: Added to the std when standardising.
        val_fraction: ``> 0`` holds out a stratified validation split of train (the paper's
            selection protocol); standardisation statistics then come from the remaining train
            part.
        split_seed: Seed of the validation hold-out.
        extract_device: Device of a feature extraction.
        extract_batch_size: Images per forward pass of a feature extraction.
        name: ``meta["name"]`` of the bundle.

    Returns:
        The bundle.

    Raises:
        ValueError: On an unknown ``source`` or a malformed cache.
        DataNotFoundError: If neither a cache nor images are found.
    """
    if source not in ("auto", "features", "images"):
        raise ValueError(f"source must be auto | features | images, got {source!r}")
    root = Path(data_dir)
    name_pt = _feature_cache_name(weights)
    candidates = [
        root / "cars196" / "features" / name_pt,
        root / "cars196" / "features" / name_pt.replace(".pt", ".npz"),
    ]
    if cache_dir is not None:
        candidates += [Path(cache_dir) / name_pt, Path(cache_dir) / name_pt.replace(".pt", ".npz")]
    cache = next((p for p in candidates if p.is_file()), None) if source != "images" else None
    if cache is None and source in ("auto", "images"):
        target = (
            Path(cache_dir) / name_pt if cache_dir is not None else root / "cars196" / "features" / name_pt
        )
        cache = build_feature_cache(root, target, weights, hf_dataset, extract_device, extract_batch_size)
    if cache is None:
        raise DataNotFoundError(
            missing_data_message(
                "Cars196 (ResNet-50 features)",
                root / "cars196",
                [str(p) for p in candidates]
                + ["or images: images/{train,test}/<class>/, stanford_cars/, hf/"],
                HOW_TO_GET,
            )
        )
    feats = load_feature_cache(cache)
    meta = {
        "name": name,
        "synthetic": False,
        "source": str(cache),
        "weights": weights,
        "extractor": "torchvision resnet50, fc=Identity, eval mode, weights.transforms()",
    }
    if feats["train_x"].shape[0] != NUM_TRAIN or feats["test_x"].shape[0] != NUM_TEST:
        log.warning(
            "Cars196 cache %s has %d/%d examples, the canonical split is %d/%d",
            cache,
            feats["train_x"].shape[0],
            feats["test_x"].shape[0],
            NUM_TRAIN,
            NUM_TEST,
        )
    return _bundle(
        feats["train_x"],
        feats["train_y"],
        feats["test_x"],
        feats["test_y"],
        meta,
        standardize_features,
        eps,
        val_fraction,
        split_seed,
    )
