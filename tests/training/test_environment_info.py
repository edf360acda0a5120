"""What a run's summary says about where it ran (issue 26: device, torch and CUDA versions, TF32)."""

from __future__ import annotations

import torch

from curvopt.training.records import environment_info


def test_environment_info_names_the_cuda_build_and_float32_precision_on_cpu() -> None:
    info = environment_info(torch.device("cpu"))
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    assert "cuda" in info and info["cuda"] == torch.version.cuda  # None for a CPU build
    assert info["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert "tf32_matmul" not in info  # TF32 switches are recorded on a CUDA device only


def test_environment_info_records_the_tf32_switches_on_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H100")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = flag  # a torch switch, not an attribute to patch
            info = environment_info(torch.device("cuda", 0))
            assert info["tf32_matmul"] is flag
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert info["device_name"] == "Fake H100" and info["cudnn"] == 91000
    assert info["tf32_cudnn"] == bool(torch.backends.cudnn.allow_tf32)
