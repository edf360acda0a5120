"""README "Use it in your own loop": every python block under that heading runs exactly as printed
and lowers its loss (each block leaves a ``losses`` list, or a dict of lists, of training losses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Use it in your own loop"


def section_blocks() -> list[str]:
    text = README.read_text()
    start = text.index(HEADING + "\n")
    end = text.find("\n## ", start + len(HEADING))
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)


BLOCKS = section_blocks()
NAMES = ["fosi_adam", "shf_lsmr", "fgn", "racs_alice"]


def test_section_has_one_example_per_paper() -> None:
    assert len(BLOCKS) == len(NAMES)
    for block, needle in zip(BLOCKS, ("fosi_adam", "SHF(", "FGN(", "Alice(")):
        assert needle in block


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the examples are tiny; avoid oversubscribing a shared CPU
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_example_runs_as_printed_and_lowers_the_loss(index: int, one_thread, capsys) -> None:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md:{NAMES[index]}", "exec"), namespace)  # noqa: S102
    losses = namespace["losses"]
    curves = losses if isinstance(losses, dict) else {NAMES[index]: losses}
    assert curves
    for name, curve in curves.items():
        assert len(curve) >= 2, name
        assert all(isinstance(v, float) and v == v for v in curve), name
        assert curve[-1] < curve[0], f"{name}: {curve[0]} -> {curve[-1]}"
    assert "training loss" in capsys.readouterr().out
