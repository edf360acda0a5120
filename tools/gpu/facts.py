"""Facts of the device and of each train process: ``exec`` runs one train run with TF32 set as the
queue asks and records what the process saw (torch, CUDA, cuDNN, TF32, float32 matmul precision)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def device_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        facts.update(
            torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available()
        )
        facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            facts.update(
                device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                multiprocessors=p.multi_processor_count, device_count=torch.cuda.device_count(),
            )  # fmt: skip
        else:
            facts["device_name"] = (
                f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
            )
    except ImportError:
        facts["torch"] = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        if out.returncode == 0:
            facts["nvidia_smi"] = out.stdout.strip()
            facts["driver"] = out.stdout.split(",")[1].strip() if "," in out.stdout else None
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def cmd_exec(argv: list[str]) -> None:
    facts_path, tf32 = None, "default"
    while argv and argv[0] != "--":
        key, value, argv = argv[0], argv[1], argv[2:]
        if key == "--facts":
            facts_path = Path(value)
        elif key == "--tf32":
            tf32 = value
    script, rest = argv[1], argv[2:]
    import runpy

    import torch

    if tf32 in ("on", "off"):
        torch.set_float32_matmul_precision("high" if tf32 == "on" else "highest")
        torch.backends.cudnn.allow_tf32 = tf32 == "on"
    sys.argv = [script, *rest]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if facts_path is not None:
            facts_path.write_text(json.dumps(process_facts(torch, tf32), indent=2))


def process_facts(torch: Any, tf32: str) -> dict[str, Any]:
    f: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "tf32_setting": tf32}
    f["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    for key, get in (
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("tf32_matmul", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("tf32_cudnn", lambda: torch.backends.cudnn.allow_tf32),
    ):
        try:
            f[key] = get()
        except Exception as err:  # noqa: BLE001 - torch versions differ in what they allow
            f[key] = f"unreadable: {err}"
    f["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        f["device_name"] = torch.cuda.get_device_name()
        f["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
    else:
        f["device_name"] = "cpu"
    return f
