"""The official GaLore / Fira / APOLLO packages behind our configs: first steps checked against
NumPy from the papers' algorithms (GaLore, Fira, APOLLO), so a wrong key or scale in the wrapper fails."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curvopt.optim.grouping import build_optimizer


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is as fast, and MKL's threaded SVD/EVD slows down ~50x when other
    processes share the 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def two_layer(shape=(6, 10), seed=0):
    torch.manual_seed(seed)
    # Sequential: the first Linear is a method matrix (weight shape = ``shape``), the last is the head
    model = torch.nn.Sequential(
        torch.nn.Linear(shape[1], shape[0], bias=False), torch.nn.Linear(shape[0], 2)
    ).double()
    return model


def step_once(model, opt, G):
    w0 = model[0].weight.detach().clone()
    model[0].weight.grad = torch.tensor(G)
    for p in model[1].parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return (model[0].weight.detach() - w0).numpy()


def first_adam_direction(sigma, b1=0.9, b2=0.999, eps=1e-6):
    """HF-style AdamW step 1 (what the packages run): lr·√(1−β2)/(1−β1) · m/(√v + ε)."""
    m, v = (1 - b1) * sigma, (1 - b2) * sigma**2
    return math.sqrt(1 - b2) / (1 - b1) * m / (np.sqrt(v) + eps)


def top_left(G, r):
    U, _, _ = np.linalg.svd(G, full_matrices=False)
    return U[:, :r]


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_galore_first_step_matches_algorithm_8(shape):
    pytest.importorskip("galore_torch")
    rng = np.random.default_rng(0)
    G = rng.standard_normal(shape)
    model = two_layer(shape)
    opt = build_optimizer(
        model, "galore", lr=0.1, rank=3, scale=0.25, update_proj_gap=200, lm_head_in_method=False
    )
    delta = step_once(model, opt, G)
    wide = shape[0] < shape[1]
    Gm = G if wide else G.T  # project the smaller side
    U = top_left(Gm, 3)
    upd = U @ first_adam_direction(U.T @ Gm)  # invariant to the SVD's column signs
    expected = -0.1 * 0.25 * (upd if wide else upd.T)
    np.testing.assert_allclose(delta, expected, rtol=1e-4, atol=1e-7)  # upstream SVD runs in fp32


def test_fira_first_step_is_galore_plus_scaled_residual():
    pytest.importorskip("fira")
    rng = np.random.default_rng(1)
    G = rng.standard_normal((6, 10))
    model = two_layer((6, 10))
    opt = build_optimizer(model, "fira", lr=0.1, rank=3, alpha=0.25, lm_head_in_method=False)
    delta = step_once(model, opt, G)
    U = top_left(G, 3)
    sigma = U.T @ G
    ng = first_adam_direction(sigma) * (1 - 0.9) / math.sqrt(1 - 0.999)  # m/(√v+ε) before bias scaling
    phi = np.linalg.norm(ng, axis=0) / (np.linalg.norm(sigma, axis=0) + 1e-8)
    residual = G - 0.25 * U @ sigma  # the official code's quirk: G − α·UUᵀG (docs/decisions.md)
    step_size = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    expected = -step_size * (0.25 * U @ ng + residual * phi[None, :])
    np.testing.assert_allclose(delta, expected, rtol=1e-4, atol=1e-7)  # upstream SVD runs in fp32


def test_apollo_mini_first_step_is_tensor_scaled_gradient():
    pytest.importorskip("apollo_torch")
    rng = np.random.default_rng(2)
    G = rng.standard_normal((6, 10))
    model = two_layer((6, 10))
    opt = build_optimizer(model, "apollo_mini", lr=0.1, lm_head_in_method=False)
    delta = step_once(model, opt, G)
    proj = opt.state[model[0].weight]["projector"].ortho_matrix.double().numpy()  # m×1 random
    sigma = proj.T @ G
    ng = first_adam_direction(sigma) * (1 - 0.9) / math.sqrt(1 - 0.999)
    s = np.linalg.norm(ng) / (np.linalg.norm(sigma) + 1e-8)
    step_size = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    np.testing.assert_allclose(
        delta, -step_size * math.sqrt(128.0) * s * G, rtol=1e-4, atol=1e-7
    )  # upstream SVD runs in fp32


@pytest.mark.parametrize("method", ["galore", "fira", "apollo", "apollo_mini"])
def test_baselines_train_tiny_llama_in_bf16(method):
    pytest.importorskip({"galore": "galore_torch", "fira": "fira"}.get(method, "apollo_torch"))
    from curvopt.models.llama import build_llama

    torch.manual_seed(0)
    model = build_llama("tiny", dtype=torch.bfloat16)
    kw = {"rank": 8, "update_proj_gap": 2} if method != "apollo_mini" else {"update_proj_gap": 2}
    opt = build_optimizer(model, method, lr=0.01, **kw)
    x = torch.randint(0, 256, (4, 24))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    saved = opt.state_dict()
    assert any("projector" in st for st in saved["state"].values())


def test_missing_package_message_says_what_to_install(monkeypatch):
    import builtins

    from curvopt.optim import lowrank

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "galore_torch":
            raise ImportError("not here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(lowrank.importlib, "import_module", lambda name: fake_import(name))
    with pytest.raises(ImportError, match="pip install torch==2.13.0 galore-torch"):
        lowrank.official_class("galore")


_STEP_CODE = """
import sys
if {block}:
    sys.modules["bitsandbytes"] = None  # as on a node without it: importing it fails
import torch
from curvopt.optim import lowrank
out = []
for method, build in (("galore", lowrank.galore), ("apollo", lowrank.apollo)):
    cls = lowrank.official_class(method)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 12))
    opt = build([], [w], lr=0.01, rank=4, update_proj_gap=2)
    for _ in range(3):
        w.grad = torch.randn(16, 12)
        opt.step()
    out.append(f"{{method}} {{cls.__module__}}.{{cls.__name__}} {{w.detach().double().sum().item():.12e}}")
print("bitsandbytes loaded:", "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None)
print("\\n".join(out))
"""


def test_baselines_run_without_bitsandbytes():
    """GaLore and APOLLO import bitsandbytes in their package __init__ only for their 8-bit
    variants; without it the same classes load from their own modules and take the same steps."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}

    def run(block: bool) -> list[str]:
        code = _STEP_CODE.format(block=block)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().splitlines()

    with_bnb, without_bnb = run(False), run(True)
    assert without_bnb[0] == "bitsandbytes loaded: False"
    assert with_bnb[0] == "bitsandbytes loaded: True"
    assert without_bnb[1].startswith("galore galore_torch.adamw.AdamW ")
    assert without_bnb[2].startswith("apollo apollo_torch.apollo.AdamW ")
    assert with_bnb[1:] == without_bnb[1:]  # same classes, same weights after three steps
