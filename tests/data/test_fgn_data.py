"""Cars196 pipeline pieces: synthetic stand-in, feature cache, standardisation, clear errors; head."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from curvopt.data.cars import (
    NUM_CLASSES,
    cars196,
    cars196_synthetic,
    extract_resnet50_features,
    standardize,
    stratified_split,
)
from curvopt.errors import DataNotFoundError
from curvopt.models.linear_head import linear_head


@pytest.fixture(scope="module")
def stand_in():
    return cars196_synthetic()


def test_synthetic_stand_in_has_cars196_shape_and_is_labelled(stand_in):
    x, y = stand_in.train
    xt, yt = stand_in.test
    assert x.shape == (8144, 2048) and xt.shape == (8041, 2048)
    assert x.dtype == torch.float32 and y.dtype == torch.long
    assert set(y.tolist()) == set(range(NUM_CLASSES)) == set(yt.tolist())
    counts = torch.bincount(y, minlength=NUM_CLASSES)
    assert counts.min() == 41 and counts.max() == 42
    assert stand_in.meta["synthetic"] is True and "NOT Cars196" in stand_in.meta["source"]
    assert stand_in.val is None
    # standardised with train statistics
    torch.testing.assert_close(x.mean(0), torch.zeros(2048), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std(0, unbiased=False), torch.ones(2048), atol=1e-3, rtol=0)
    assert abs(float(xt.mean())) < 0.05  # test uses the train statistics, so only roughly centred


def test_synthetic_stand_in_is_deterministic_and_seeded():
    a = cars196_synthetic(num_train=300, num_test=200, dim=64, seed=3)
    b = cars196_synthetic(num_train=300, num_test=200, dim=64, seed=3)
    c = cars196_synthetic(num_train=300, num_test=200, dim=64, seed=4)
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.test[1], b.test[1])
    assert not torch.equal(a.train[0], c.train[0])


def test_synthetic_classes_are_learnable_but_not_trivially(stand_in):
    """Nearest-class-mean on the standardised features: far above chance (1/196), far below 100 %."""
    x, y = stand_in.train
    xt, yt = stand_in.test
    means = torch.zeros(NUM_CLASSES, x.shape[1]).index_add_(0, y, x) / torch.bincount(y)[:, None]
    acc = (torch.cdist(xt, means).argmin(1) == yt).float().mean().item()
    assert 0.1 < acc < 0.9


def test_standardize_and_stratified_split():
    g = torch.Generator().manual_seed(0)
    train = torch.randn(50, 3, generator=g) * torch.tensor([1.0, 5.0, 0.0]) + 2.0
    test = torch.randn(20, 3, generator=g)
    (tr, te), stats = standardize(train, test, eps=1e-6)
    torch.testing.assert_close(tr[:, :2].mean(0), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(tr[:, :2].std(0, unbiased=False), torch.ones(2), atol=1e-5, rtol=0)
    assert torch.all(tr[:, 2] == 0)  # a constant feature stays finite thanks to eps
    torch.testing.assert_close(te, (test - stats["mean"]) / (stats["std"] + 1e-6))
    y = torch.arange(100) % 5
    keep, held = stratified_split(y, 0.2, seed=1)
    assert torch.equal(torch.bincount(y[held]), torch.full((5,), 4))
    assert set(keep.tolist()).isdisjoint(held.tolist()) and keep.numel() + held.numel() == 100


def test_feature_cache_is_loaded_standardised_and_split(tmp_path):
    g = torch.Generator().manual_seed(0)
    cache = tmp_path / "cars196" / "features"
    cache.mkdir(parents=True)
    y = torch.arange(392) % NUM_CLASSES
    torch.save(
        {
            "train_x": torch.rand(392, 16, generator=g) * 3,
            "train_y": y,
            "test_x": torch.rand(196, 16, generator=g),
            "test_y": torch.arange(196),
        },
        cache / "resnet50_IMAGENET1K_V2.pt",
    )
    data = cars196(data_dir=str(tmp_path), source="features", val_fraction=0.5)
    assert data.meta["synthetic"] is False and data.meta["source"].endswith("resnet50_IMAGENET1K_V2.pt")
    assert data.train[0].shape == (196, 16) and data.val[0].shape == (196, 16)
    torch.testing.assert_close(data.train[0].mean(0), torch.zeros(16), atol=1e-5, rtol=0)
    # bad labels in a cache are refused
    torch.save(
        {
            "train_x": torch.zeros(2, 4),
            "train_y": torch.tensor([0, 196]),
            "test_x": torch.zeros(1, 4),
            "test_y": torch.tensor([0]),
        },
        cache / "resnet50_IMAGENET1K_V1.pt",
    )
    with pytest.raises(ValueError, match="labels must lie"):
        cars196(data_dir=str(tmp_path), source="features", weights="IMAGENET1K_V1")


def test_missing_real_data_gives_a_clear_error(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        cars196(data_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    assert "Cars196" in message and "cars196_synthetic" in message and "resnet50_IMAGENET1K_V2.pt" in message


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here"
)
def test_feature_extraction_without_torchvision_says_what_to_install():
    with pytest.raises(ImportError, match="torchvision"):
        extract_resnet50_features(iter([]))


def test_linear_head_matches_the_paper_size_and_init():
    torch.manual_seed(0)
    head = linear_head()
    assert sum(p.numel() for p in head.parameters()) == 401_604
    assert torch.all(head.bias == 0)
    assert abs(float(head.weight.detach().std()) - 2048**-0.5) < 1e-3
    torch.manual_seed(0)
    again = linear_head()
    assert torch.equal(again.weight, head.weight)
    assert torch.all(linear_head(8, 3, init="zeros").weight == 0)
    with pytest.raises(ValueError, match="unknown init"):
        linear_head(init="xavier")


class _FakeResNet(torch.nn.Module):
    """Stands in for torchvision's ResNet-50: 2048-d "pooled" features that depend on the image,
    an ``fc`` the pipeline must replace by ``Identity``, and a record of the mode it ran in."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("proj", torch.randn(3 * 4 * 4, 2048, generator=g))
        self.fc = torch.nn.Linear(2048, 1000)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.fc(x.flatten(1) @ self.proj)


def _fake_torchvision(monkeypatch) -> list[_FakeResNet]:
    import sys
    import types

    import numpy as np

    built: list[_FakeResNet] = []

    class Weights:
        url = "https://download.pytorch.org/models/resnet50-11ad3fa6.pth"

        def transforms(self):
            return lambda img: torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)

    def resnet50(weights=None):
        assert isinstance(weights, Weights)
        built.append(_FakeResNet())
        return built[-1]

    models = types.SimpleNamespace(
        resnet50=resnet50,
        ResNet50_Weights=types.SimpleNamespace(IMAGENET1K_V1=Weights(), IMAGENET1K_V2=Weights()),
    )
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))
    return built


def test_image_folder_to_feature_cache_to_standardised_bundle(tmp_path, monkeypatch):
    """The real pipeline end to end with a fake ResNet-50 (no torchvision, weights or Cars196
    here): class folders in sorted order give labels 0..195, the backbone runs in eval mode with
    fc = Identity, features are cached once and standardised with train statistics."""
    from PIL import Image

    built = _fake_torchvision(monkeypatch)
    root = tmp_path / "cars196" / "images"
    g = torch.Generator().manual_seed(1)
    pixels = {}
    for split, per_class in (("train", 2), ("test", 1)):
        for k in range(NUM_CLASSES):
            folder = root / split / f"class_{k:03d}"
            folder.mkdir(parents=True)
            for j in range(per_class):
                arr = torch.randint(0, 256, (4, 4, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(arr).save(folder / f"{j}.png")
                pixels[(split, k, j)] = arr
    data = cars196(data_dir=str(tmp_path), extract_batch_size=50)
    cache = tmp_path / "cars196" / "features" / "resnet50_IMAGENET1K_V2.pt"
    assert cache.is_file() and data.meta["synthetic"] is False
    assert len(built) == 2 and all(not m for net in built for m in net.modes)  # eval mode
    assert all(isinstance(net.fc, torch.nn.Identity) for net in built)
    raw = torch.load(cache, weights_only=True)
    assert raw["train_x"].shape == (2 * NUM_CLASSES, 2048) and raw["test_x"].shape == (NUM_CLASSES, 2048)
    assert raw["train_y"].tolist() == [k for k in range(NUM_CLASSES) for _ in range(2)]
    assert raw["test_y"].tolist() == list(range(NUM_CLASSES))
    # the cached feature of one image is the backbone applied to that image alone
    one = torch.from_numpy(pixels[("test", 7, 0)].astype("float32") / 255.0).permute(2, 0, 1)
    torch.testing.assert_close(raw["test_x"][7], (one.flatten() @ built[0].proj), rtol=1e-4, atol=1e-4)
    # standardised with train statistics only (population std + eps), same map on test
    mean, std = raw["train_x"].mean(0), raw["train_x"].std(0, unbiased=False) + 1e-6
    torch.testing.assert_close(data.train[0], (raw["train_x"] - mean) / std, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(data.test[0], (raw["test_x"] - mean) / std, rtol=1e-4, atol=1e-4)
    # a second call reads the cache and does not extract again
    cars196(data_dir=str(tmp_path))
    assert len(built) == 2
