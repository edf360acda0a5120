"""README and docs tell the truth: every Python snippet runs as printed, the library examples lower
their loss, the README gets to the point before line 120, its results summary is the one `make
report` generates from results/REPORT.md, and its make commands exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
HEADING = "## Use it in your own loop"
# blocks that are sketches, not programs (names they use are defined by the reader): fix and remove
SKETCHES: dict[tuple[str, int], str] = {}


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


def section_blocks() -> list[str]:
    text = README.read_text()
    start = text.index(HEADING + "\n")
    end = text.find("\n## ", start + len(HEADING))
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)


# the library examples: the README's (FOSI) and docs/library.md's (SHF, FGN, RACS/Alice)
EXAMPLES = [*section_blocks(), *python_blocks(ROOT / "docs" / "library.md")]
NAMES = ["fosi_adam", "shf_lsmr", "fgn", "racs_alice"]
ALL_BLOCKS = [
    pytest.param(
        path,
        i,
        id=f"{path.relative_to(ROOT)}:{i}",
        marks=[pytest.mark.xfail(strict=True, reason=SKETCHES[(str(path.relative_to(ROOT)), i)])]
        if (str(path.relative_to(ROOT)), i) in SKETCHES
        else [],
    )
    for path in [README, *DOCS]
    for i in range(len(python_blocks(path)))
]


def test_one_example_per_paper() -> None:
    assert len(EXAMPLES) == len(NAMES)
    for block, needle in zip(EXAMPLES, ("fosi_adam", "SHF(", "FGN(", "Alice(")):
        assert needle in block


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the examples are tiny; avoid oversubscribing a shared CPU
    yield
    torch.set_num_threads(threads)


def _run(block: str, name: str) -> dict:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block, name, "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_example_runs_as_printed_and_lowers_the_loss(index: int, one_thread, capsys) -> None:
    losses = _run(EXAMPLES[index], NAMES[index])["losses"]
    curves = losses if isinstance(losses, dict) else {NAMES[index]: losses}
    assert curves
    for name, curve in curves.items():
        assert len(curve) >= 2, name
        assert all(isinstance(v, float) and v == v for v in curve), name
        assert curve[-1] < curve[0], f"{name}: {curve[0]} -> {curve[-1]}"
    assert "training loss" in capsys.readouterr().out


@pytest.mark.parametrize(("path", "index"), ALL_BLOCKS)
def test_every_python_snippet_runs_as_printed(path: Path, index: int, one_thread) -> None:
    """Each ```python block of README.md and docs/*.md, alone, in a fresh namespace."""
    _run(python_blocks(path)[index], f"{path.name}:{index}")


def _line(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def test_readme_gets_to_the_point_before_line_120() -> None:
    text = README.read_text()
    for needle in (
        "## Install",
        "make setup",
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install .",
        'pip install ".[repro]"',
        "make reproduce-fig2",
        "make test",
        HEADING,
        "from curvopt.optim import fosi_adam",
    ):
        assert _line(text, needle) < 120, needle
    assert "../shared" not in text  # a folder of one machine, not the reader's


def test_readme_results_summary_is_the_generated_one() -> None:
    """`make report` writes the block from the report it has just written; regenerate with it."""
    from experiments.report.readme import current_block, readme_block

    expected = readme_block((ROOT / "results" / "REPORT.md").read_text(), ROOT / "results")
    assert current_block(README) == expected, "README's results summary is stale: run `make report`"
    assert "Counts: " in expected and "SHF-LSMR" in expected


def test_readme_make_commands_exist() -> None:
    defined = set()
    for mk in [ROOT / "Makefile", *(ROOT / "mk").glob("*.mk")]:
        defined |= set(re.findall(r"^([A-Za-z0-9_-]+):", mk.read_text(), flags=re.M))
    used = re.findall(r"(?:^|`)make ([a-z][a-z0-9-]*)", README.read_text(), flags=re.M)
    assert used
    missing = sorted(set(used) - defined)
    assert not missing, missing


def _shell_blocks() -> list[tuple[Path, str]]:
    return [
        (path, block)
        for path in [README, *DOCS]
        for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```$", path.read_text(), flags=re.S | re.M)
    ]


def test_shell_snippets_name_what_exists() -> None:
    """The shell blocks of README and docs are too long to run here (hours of training); what they
    name must exist: make targets, `python -m` modules, `experiment=` configs."""
    import importlib.util

    defined = set()
    for mk in [ROOT / "Makefile", *(ROOT / "mk").glob("*.mk")]:
        defined |= set(re.findall(r"^([A-Za-z0-9_.-]+):", mk.read_text(), flags=re.M))
    experiments = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    missing = []
    for path, block in _shell_blocks():
        where = path.relative_to(ROOT)
        for target in re.findall(r"(?:^|[;&|]\s*|\s)make ([a-z][a-z0-9-]*)", block, flags=re.M):
            if target not in defined:
                missing.append(f"{where}: make {target}")
        for module in re.findall(r"python3? -m ([A-Za-z_][\w.]*)", block):
            if module.split(".")[0] in ("pytest", "pip", "venv", "torch", "ruff"):
                continue
            if importlib.util.find_spec(module) is None:
                missing.append(f"{where}: python -m {module}")
        for name in re.findall(r"\bexperiment=([\w]+)", block):
            if name not in experiments:
                missing.append(f"{where}: experiment={name}")
    assert not missing, missing
