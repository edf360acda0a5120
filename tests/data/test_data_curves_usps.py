"""CURVES(-like) and USPS loaders: generator determinism and geometry, file handling, splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from curvopt.data.curves import _curve_points, generate_curves, load_curves
from curvopt.data.usps import load_usps, read_usps_esl, read_usps_roweis
from curvopt.errors import CorruptDataError, DataNotFoundError


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- CURVES-like generator ---------------------------------------------------------------------------
def test_generator_is_deterministic_with_prefix_property():
    a, ca = generate_curves(64, seed=3)
    b, cb = generate_curves(64, seed=3)
    c, _ = generate_curves(200, seed=3, block=50)
    d, _ = generate_curves(64, seed=4)
    assert np.array_equal(a, b) and np.array_equal(ca, cb)
    assert np.array_equal(a, c[:64])  # independent of n and of the rendering block size
    assert not np.array_equal(a, d)


def test_generator_shapes_range_and_ink():
    x, ctrl = generate_curves(300, seed=0)
    assert x.shape == (300, 784) and x.dtype == np.float32 and ctrl.shape == (300, 3, 2)
    assert x.min() == 0.0 and x.max() == 1.0
    ink = (x > 0).mean(1)
    assert ink.min() > 0.005 and ink.max() < 0.5  # every image has a stroke, none is filled
    assert 0.0 < (x == 1.0).mean() < (x > 0).mean()  # saturated core plus anti-aliased edge
    assert ctrl.min() >= 1.5 and ctrl.max() <= 25.5


def test_curve_passes_through_the_three_points_and_matches_dense_render():
    x, ctrl = generate_curves(40, seed=1)
    imgs = x.reshape(40, 28, 28)
    for i in range(40):
        for px, py in ctrl[i]:
            # the nearest pixel centre is ≤ √½ px away ⇒ intensity ≥ 1.25 − 0.71
            assert imgs[i, int(round(py)), int(round(px))] >= 0.5
    # against the exact pixel-to-curve distance of a very fine polyline (float64)
    pts = _curve_points(ctrl.astype(np.float64), 3000, "chord")
    grid = np.arange(28.0)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    pix = np.stack([xx.ravel(), yy.ravel()], 1)
    dist = np.sqrt(((pix[None, :, None, :] - pts[:, None, ::3, :]) ** 2).sum(-1)).min(-1)
    ref = np.clip(1.25 - dist, 0.0, 1.0)
    assert np.abs(ref - x).max() < 0.03


def test_load_curves_like_generates_caches_and_labels_it(tmp_path, caplog):
    kw = dict(
        source="synthetic", generated_train=120, generated_test=60, num_train=100, num_val=10, num_test=40
    )
    data = load_curves(str(tmp_path), **kw)
    assert data.meta["name"] == "curves_like" and data.meta["synthetic"] is True
    assert (
        data.train[0].shape == (100, 784)
        and data.val[0].shape == (10, 784)
        and data.test[0].shape == (40, 784)
    )
    assert data.train[1] is data.train[0]  # autoencoder targets
    cached = list((tmp_path / "curves_like").glob("*.npz"))
    assert len(cached) == 1 and data.meta["source"] == str(cached[0])
    again = load_curves(str(tmp_path), **kw)
    assert torch.equal(again.train[0], data.train[0]) and torch.equal(again.test[0], data.test[0])
    # val/test are disjoint parts of the generated "bdatatest"
    direct, _ = generate_curves(180, seed=0)
    test_rows = {r.tobytes() for r in direct[120:]}
    assert all(r.numpy().tobytes() in test_rows for r in torch.cat([data.val[0], data.test[0]]))
    assert len({r.numpy().tobytes() for r in torch.cat([data.val[0], data.test[0]])}) == 50
    assert np.array_equal(data.train[0].numpy(), direct[:100])
    # unwritable data dir (a path below a regular file): falls back to cache_dir
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    other = load_curves(str(blocker), cache_dir=str(tmp_path / "cache"), **kw)
    assert (tmp_path / "cache" / "curves_like").is_dir() and torch.equal(other.train[0], data.train[0])
    # a data dir marked read-only (like the shared one) is never written to, even by root
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        load_curves(str(ro), cache_dir=str(tmp_path / "cache2"), **kw)
        assert (
            list(ro.iterdir()) == [] and len(list((tmp_path / "cache2" / "curves_like").glob("*.npz"))) == 1
        )
    finally:
        ro.chmod(0o755)


def test_load_curves_reads_real_file_when_present(tmp_path):
    import scipy.io

    folder = tmp_path / "curves"
    folder.mkdir()
    rng = np.random.default_rng(0)
    bdata, bdatatest = rng.random((30, 784)), rng.random((20, 784))
    scipy.io.savemat(folder / "digs3pts_1.mat", {"bdata": bdata, "bdatatest": bdatatest})
    data = load_curves(str(tmp_path), num_train=30, num_val=5, num_test=None)
    assert data.meta["name"] == "curves" and data.meta["synthetic"] is False
    np.testing.assert_allclose(data.train[0].numpy(), bdata.astype(np.float32))
    assert data.val[0].shape == (5, 784) and data.test[0].shape == (15, 784)


def test_load_curves_missing_and_corrupt_real_file(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_curves(str(tmp_path), source="real")
    msg = str(err.value)
    assert "digs3pts_1.mat" in msg and str((tmp_path / "curves").resolve()) in msg and "How to get" in msg
    (tmp_path / "curves").mkdir()
    (tmp_path / "curves" / "digs3pts_1.mat").write_bytes(b"not a mat file at all" * 10)
    with pytest.raises(CorruptDataError):
        load_curves(str(tmp_path), source="auto")


# -- USPS -------------------------------------------------------------------------------------------------
@pytest.fixture
def usps_dir(shared_data_dir: Path) -> Path:
    if not (shared_data_dir / "usps" / "usps_all.mat").is_file():
        pytest.skip(f"usps_all.mat not in {shared_data_dir / 'usps'}")
    return shared_data_dir


def test_usps_real_file_splits_and_range(usps_dir):
    data = load_usps(str(usps_dir))
    assert data.meta["source_kind"] == "roweis" and data.meta["name"] == "usps"
    (xtr, ytr), (xva, _), (xte, _) = data.train, data.val, data.test
    assert xtr.shape == (8000, 256) and xva.shape == (1000, 256) and xte.shape == (2000, 256)
    assert torch.equal(xtr, ytr) and xtr.dtype == torch.float32
    assert xtr.min() >= 0 and xtr.max() <= 1 and xtr.max() == 1.0
    rows = [set(map(bytes, (x.numpy() * 255).round().astype(np.uint8))) for x in (xtr, xva, xte)]
    assert sum(len(r) for r in rows) == 11000 and len(set.union(*rows)) == 11000  # disjoint
    again = load_usps(str(usps_dir))
    assert torch.equal(again.test[0], xte)
    other = load_usps(str(usps_dir), split_seed=1)
    assert not torch.equal(other.test[0], xte)
    labels = load_usps(str(usps_dir), target="label", num_train=100, num_val=0, num_test=0)
    assert labels.train[1].dtype == torch.int64 and labels.val is None


def test_usps_images_are_upright(usps_dir):
    """Roweis stores each 16×16 image column-major; after our transpose the class means must
    agree with the (row-major, upright) ESL images — and clearly less so without it."""
    pytest.importorskip("h5py")
    esl = usps_dir / "usps" / "usps.h5"
    if not esl.is_file():
        pytest.skip("usps.h5 not present for the orientation cross-check")
    x, y = read_usps_roweis(usps_dir / "usps" / "usps_all.mat")
    xe, ye = read_usps_esl(esl)
    assert np.bincount(y).tolist() == [1100] * 10
    for digit in (2, 3, 5, 7):
        m = x[y == digit].mean(0)
        me = xe[ye == digit].mean(0)
        wrong = m.reshape(16, 16).T.ravel()
        assert np.corrcoef(m, me)[0, 1] > 0.6 > np.corrcoef(wrong, me)[0, 1] + 0.3


def test_usps_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_usps(str(tmp_path))
    msg = str(err.value)
    assert (
        "usps_all.mat" in msg and "usps.h5" in msg and str(tmp_path.resolve()) in msg and "How to get" in msg
    )
    (tmp_path / "usps").mkdir()
    (tmp_path / "usps" / "usps_all.mat").write_bytes(b"\x00garbage" * 50)
    with pytest.raises(CorruptDataError) as err:
        load_usps(str(tmp_path))
    assert "usps_all.mat" in str(err.value)


def test_usps_falls_back_to_esl_h5(usps_dir, tmp_path):
    pytest.importorskip("h5py")
    src = usps_dir / "usps" / "usps.h5"
    if not src.is_file():
        pytest.skip("usps.h5 not present")
    (tmp_path / "usps").mkdir()
    (tmp_path / "usps" / "usps.h5").symlink_to(src)
    data = load_usps(str(tmp_path))
    assert data.meta["source_kind"] == "esl"
    assert data.train[0].shape == (9298 - 3000, 256) and data.test[0].shape == (2000, 256)
    assert float(data.train[0].min()) >= 0.0 and float(data.train[0].max()) <= 1.0


def test_dataset_and_model_configs_compose():
    from curvopt.training.build import call_target
    from tests.conftest import compose

    for ds, model, n_var in (("curves", "curves_autoencoder", 842340), ("usps", "usps_autoencoder", 419081)):
        cfg = compose([f"dataset={ds}", f"model={model}"])
        assert cfg.dataset.name == ds and cfg.dataset._target_ and cfg.dataset.data_dir == cfg.paths.data_dir
        spec = {k: v for k, v in dict(cfg.model).items() if k != "loss"}
        net = call_target(spec)
        assert sum(p.numel() for p in net.parameters()) == n_var
