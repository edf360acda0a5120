"""Reproduction report machinery: items, statuses, provenance and the Markdown/HTML writers.

Every item (one figure or table of one paper) is evaluated by a function that reads run records
(through :mod:`curvopt.analysis.records`) or a driver's own table output, and returns an
:class:`ItemResult`; each paper's evaluators live next to its drivers (``experiments/<paper>/report.py``,
listed by :mod:`experiments.report.papers`). A missing run raises :class:`NotRun`, which becomes a "not run" entry with the
``make`` command that produces it; any other exception becomes an "error" entry (the report never
crashes and never falls back to an older number).

Status rules (see ``experiments/report/tolerances.yaml`` for the per-item numbers):

* paper profile, quantitative check within tolerance -> ``reproduced``;
* paper profile, outside tolerance but the qualitative claim holds -> ``qualitatively reproduced``;
* paper profile, the claim fails -> ``different`` (with the measured gap);
* quick profile, the qualitative claim holds -> ``qualitatively reproduced``;
* quick profile otherwise (no claim check, or it fails) -> ``not yet run at paper scale`` (the
  gap is still printed: a quick-profile miss is not evidence against the paper);
* a quick-profile claim whose paper-scale twin (the same figure or table of the same paper on
  another dataset) reads ``different`` -> ``not yet run at paper scale``, never ``qualitatively
  reproduced`` (:func:`apply_twin_rule`);
* records cut short (a deadline, a run still going: ``ItemResult.complete`` false) ->
  ``in progress``, never ``different``;
* no records -> ``not run`` with the command.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from curvopt.analysis.records import RUNNING_OR_KILLED, load_summaries

REPRODUCED = "reproduced"
QUALITATIVE = "qualitatively reproduced"
NOT_PAPER_SCALE = "not yet run at paper scale"
IN_PROGRESS = "in progress"
DIFFERENT = "different"
NOT_RUN = "not run"
ERROR = "error"
STATUSES = (REPRODUCED, QUALITATIVE, NOT_PAPER_SCALE, IN_PROGRESS, DIFFERENT, NOT_RUN, ERROR)
BADGES = {
    REPRODUCED: "✅",
    QUALITATIVE: "🟢",
    NOT_PAPER_SCALE: "🟡",
    IN_PROGRESS: "⏳",
    DIFFERENT: "❌",
    NOT_RUN: "⚪",
    ERROR: "⚠️",
}
REPO = Path(__file__).resolve().parents[2]


class NotRun(Exception):
    """Raised by an evaluator when the records it needs are absent."""


@dataclass
class ItemResult:
    """What an evaluator found for one report item.

    Args:
        status: One of :data:`STATUSES` (``reproduced``, ``qualitatively reproduced``, ...).
        rows: The item's table (paper value, ours, which run produced it), or ``None``.
        figures: PNG files to show under the item (embedded in the HTML report).
        notes: Free-text lines (Markdown ``code`` and ``**bold**`` allowed) listed under the item.
        gap: The measured gap to the paper, in one line (``""``: none to report).
        provenance: Where "ours" comes from: profile, device, seeds and run count (see
            :func:`provenance`).
        complete: ``False`` when the records judged were cut short (a deadline stopped the
            measurement, a run is still going): a miss is then ``in progress``, not ``different``.
        incomplete: Why they are not complete, one line (shown as a note).
    """

    status: str
    rows: pd.DataFrame | None = None  # paper / ours / produced-by table
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gap: str = ""  # the measured gap, one line
    provenance: str = ""  # profile / device / seeds of "ours"
    complete: bool = True
    incomplete: str = ""


@dataclass
class Item:
    """One figure or table of one paper, and how to evaluate it.

    Args:
        paper: The paper's key in :data:`experiments.report.papers.PAPERS` (``shf``, ``fgn``, ``fosi``,
            ``alice``).
        key: The item's key in the tolerances file under its paper (e.g. ``table2``).
        title: The heading, ``"<Figure|Table> N: what it shows"``; the part before the colon is
            the short label of the summary table. An item whose title starts with ``Figure`` and
            returns no figure gets a note saying so.
        make: The command that produces the records (and the figure or table), e.g.
            ``make reproduce-table2``; shown with "not run" entries and under every item.
        evaluate: The evaluator: reads the records through the :class:`Context` and returns an
            :class:`ItemResult`; raises :class:`NotRun` when its records are absent.
    """

    paper: str
    key: str  # tolerance key, e.g. "table2"
    title: str  # "Table 2: errors at the best-validation iterate"
    make: str  # command that produces the records (and the figure/table)
    evaluate: Callable[[Context], ItemResult]


@dataclass
class Context:
    """What every evaluator reads from.

    Args:
        results: The results directory holding the run records (``results/`` for ``make report``).
        tolerances: The parsed tolerances file, ``{paper: {item key: {setting: value}}}``.
        repo: The repository root (where the paper numbers beside the drivers are read from).
    """

    results: Path
    tolerances: dict[str, Any]
    repo: Path = REPO

    def tol(self, paper: str, key: str) -> dict[str, Any]:
        """The tolerance settings of one item.

        Args:
            paper: The paper's key (``shf``, ``fgn``, ``fosi``, ``alice``).
            key: The item's key under that paper.

        Returns:
            A copy of the item's settings; empty when the tolerances file has none.
        """
        return dict(self.tolerances.get(paper, {}).get(key, {}))


# -- helpers for evaluators --------------------------------------------------------------------------------
def judge(profile: str, quantitative: bool | None, qualitative: bool | None) -> str:
    """The status from the profile and the two checks (see the module docstring's rules).

    Args:
        profile: The profile of the records judged (``paper``, ``quick``, ...); anything but
            ``paper`` can at best be ``qualitatively reproduced``.
        quantitative: Whether the numbers are within tolerance of the paper's; ``None``: this
            item has no such check.
        qualitative: Whether the paper's qualitative claim (ordering, shape) holds; ``None``: no
            such check.

    Returns:
        One of :data:`REPRODUCED`, :data:`QUALITATIVE`, :data:`DIFFERENT` (paper profile) or
        :data:`QUALITATIVE`, :data:`NOT_PAPER_SCALE` (other profiles).

    Raises:
        NotRun: At the paper profile with neither check: the records hold nothing the item can
            compare, so nothing is claimed.
    """
    if profile != "paper":
        return QUALITATIVE if qualitative else NOT_PAPER_SCALE
    if quantitative:
        return REPRODUCED
    if qualitative:
        return QUALITATIVE
    if quantitative is None and qualitative is None:
        raise NotRun("the records hold nothing this item can check")
    return DIFFERENT


def pick_profile(profiles: Iterable[Any]) -> str | None:
    """The profile whose records an item judges.

    Args:
        profiles: The profiles of the available records (e.g. a summaries column); ``None`` and
            NaN entries are skipped.

    Returns:
        ``paper`` when any paper-profile record exists, else ``quick``, else the alphabetically
        first profile; ``None`` when there is none.
    """
    found = [str(p) for p in profiles if p is not None and not (isinstance(p, float) and math.isnan(p))]
    if not found:
        return None
    for p in ("paper", "quick"):
        if p in found:
            return p
    return sorted(found)[0]


def finished_summaries(results: Path, experiment: str) -> pd.DataFrame:
    """Summaries of the finished runs (completed or diverged) of one experiment.

    Args:
        results: The results directory.
        experiment: The experiment's directory name under ``results`` (e.g. ``shf_fig2_usps``).

    Returns:
        One row per finished run (as :func:`curvopt.analysis.records.load_summaries` gives them),
        with a fresh index; an empty frame when there is none.
    """
    sums = load_summaries(results, experiment)
    if sums.empty or "status" not in sums:
        return pd.DataFrame()
    return sums[sums["status"].isin(["completed", "diverged"])].reset_index(drop=True)


def _column(frame: pd.DataFrame, *names: str) -> pd.Series:
    for name in names:
        if name in frame:
            return frame[name]
    return pd.Series([None] * len(frame), index=frame.index, dtype=object)


def provenance(summaries: pd.DataFrame, extra: str = "") -> str:
    """Where "ours" comes from, in one line: ``profile quick; device cpu; seeds 0,1,2 (6 runs)``.

    Runs without a ``summary.json`` (running, or killed) are not counted: they are named after
    the count (``running or killed, not counted (no summary.json): <run ids>``). They are those
    rows of ``summaries`` and the runs of the same experiment directories (from ``run_dir``) at
    the same profiles, so that a run the evaluator dropped is not silently missing.

    Args:
        summaries: Run summaries (e.g. from :func:`finished_summaries`); the profile, device and
            seed are read from ``cfg.profile``/``profile``, ``device_name``/``device`` (else
            ``cfg.trainer.device``) and ``cfg.seed``/``seed``.
        extra: Text appended after a ``;``.

    Returns:
        The line; ``"n/a"`` for no summaries, ``?`` for a field no summary has.
    """
    if summaries is None or summaries.empty:
        return "n/a"
    status = _column(summaries, "status")
    open_rows = summaries[status == RUNNING_OR_KILLED]
    summaries = summaries[status != RUNNING_OR_KILLED]
    profiles = sorted({str(p) for p in _column(summaries, "cfg.profile", "profile").dropna()})
    open_runs = sorted(
        set(_column(open_rows, "run_id").dropna().astype(str)) | _open_runs(summaries, profiles)
    )
    if summaries.empty:
        return "n/a" + (
            f"; running or killed, not counted (no summary.json): {', '.join(open_runs)}" if open_runs else ""
        )
    devices = sorted({str(d) for d in _column(summaries, "device_name", "device").dropna()})
    if not devices:
        devices = sorted({str(d) for d in _column(summaries, "cfg.trainer.device").dropna()})
    seeds = sorted({int(s) for s in _column(summaries, "cfg.seed", "seed").dropna()})
    text = (
        f"profile {', '.join(profiles) or '?'}; device {', '.join(devices) or '?'}; "
        f"seeds {','.join(map(str, seeds)) or '?'} ({len(summaries)} run{'s' if len(summaries) != 1 else ''})"
    )
    if open_runs:
        text += f"; running or killed, not counted (no summary.json): {', '.join(open_runs)}"
    return text + (f"; {extra}" if extra else "")


def _open_runs(summaries: pd.DataFrame, profiles: list[str]) -> set[str]:
    """Run ids without a summary in the experiment directories of ``summaries`` (at ``profiles``)."""
    if "run_dir" not in summaries:
        return set()
    found: set[str] = set()
    for root in sorted({Path(str(d)).parent for d in summaries["run_dir"].dropna()}):
        sums = load_summaries(root.parent, root.name)
        if sums.empty or "status" not in sums:
            continue
        rows = sums[sums["status"] == RUNNING_OR_KILLED]
        for _, row in rows.iterrows():
            profile = row.get("cfg.profile")
            if profiles and isinstance(profile, str) and profile not in profiles:
                continue
            found.add(str(row["run_id"]))
    return found


def existing_figures(results: Path, patterns: Iterable[str]) -> list[Path]:
    """The PNG files that exist under ``results`` for the given glob patterns.

    Args:
        results: The directory the patterns are relative to.
        patterns: Glob patterns (e.g. ``figures/shf_fig2*.png``); non-PNG matches are dropped.

    Returns:
        The matches, sorted within each pattern, patterns in the order given.
    """
    out: list[Path] = []
    for pattern in patterns:
        out += sorted(p for p in results.glob(pattern) if p.suffix == ".png")
    return out


def finite(x: Any) -> bool:
    """Whether ``x`` converts to a finite float.

    Args:
        x: Any value (a number, a numeric string, ``None``, ...).

    Returns:
        ``True`` for a finite number, ``False`` for NaN, ±inf and anything ``float()`` rejects.
    """
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def rel_gap(ours: float, paper: float) -> float:
    """The relative gap of our value to the paper's.

    Args:
        ours: Our value.
        paper: The paper's value.

    Returns:
        ``(ours − paper)/|paper|`` (positive: ours is larger); NaN when either value is not
        finite or the paper's is 0.
    """
    if not (math.isfinite(ours) and math.isfinite(paper)) or paper == 0:
        return math.nan
    return (ours - paper) / abs(paper)


def fmt(value: Any, digits: int = 4) -> str:
    """A value as the report's tables print it.

    Args:
        value: Any value.
        digits: Significant digits of a float.

    Returns:
        ``–`` for ``None`` and NaN, ``never`` for +inf (a threshold never reached), ``-inf``, a
        float in ``g`` format with ``digits`` significant digits, and ``str(value)`` otherwise.
    """
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if math.isinf(value):
            return "never" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)


# -- evaluation --------------------------------------------------------------------------------------------
def load_tolerances(path: Path) -> dict[str, Any]:
    """Read the tolerances file (``experiments/report/tolerances.yaml``).

    Args:
        path: The YAML file.

    Returns:
        ``{paper: {item key: {setting: value}}}``; empty for an empty file.
    """
    return yaml.safe_load(Path(path).read_text()) or {}


def evaluate(item: Item, ctx: Context) -> ItemResult:
    """Run one item's evaluator; the report never crashes on an item.

    Args:
        item: The item.
        ctx: The results directory and tolerances.

    Returns:
        The evaluator's result, with a note added for a result short of paper scale (the command
        at paper scale) and for a figure item that drew no figure. A :class:`NotRun` becomes a
        ``not run`` result naming ``item.make``; any other exception an ``error`` result.

    Raises:
        ValueError: The evaluator returned a status that is not one of :data:`STATUSES`.
    """
    try:
        result = item.evaluate(ctx)
    except NotRun as missing:
        return ItemResult(
            NOT_RUN, notes=[f"not run: `{item.make}`" + (f" ({missing})" if str(missing) else "")]
        )
    except Exception as err:  # a broken driver or a malformed record must not stop the report
        return ItemResult(
            ERROR,
            notes=[f"could not evaluate ({type(err).__name__}: {err}); regenerate with `{item.make}`"],
        )
    if result.status not in STATUSES:
        raise ValueError(f"{item.paper}/{item.key}: unknown status {result.status!r}")
    if not result.complete:
        if result.status == DIFFERENT:
            result.status = IN_PROGRESS  # a partial record says nothing against the paper yet
        result.notes.insert(
            0,
            f"**in progress**: {result.incomplete or 'the records are incomplete'}; "
            f"finish with `{item.make}`",
        )
    if result.status == NOT_PAPER_SCALE:
        result.notes.append(f"paper scale: `{item.make} SCALE=paper` (the papers' settings; a GPU for most)")
    if item.title.startswith("Figure") and not result.figures:
        result.notes.append(f"figure not drawn from these records yet: `{item.make}`")
    return result


def result_profile(result: ItemResult) -> str | None:
    """The profile a result judged, read from its provenance (``profile quick; device ...``).

    Args:
        result: An evaluated item.

    Returns:
        ``paper``, ``quick``, ... or ``None`` when the provenance names none; ``paper`` for the
        items judged at the paper's settings without a profile (``paper settings (...)``).
    """
    text = result.provenance or ""
    if text.startswith("paper settings") or "at the paper's sizes" in text:
        return "paper"
    match = re.search(r"\bprofile ([A-Za-z_]+)", text)
    return match.group(1) if match else None


def claim_label(item: Item) -> str:
    """The claim an item checks, without its dataset: ``Figure 3 (MNIST)`` -> ``Figure 3``."""
    return re.sub(r"\s*\([^)]*\)", "", item.title.split(":")[0]).replace(" row", "").strip()


def apply_twin_rule(evaluated: list[tuple[Item, ItemResult]]) -> list[tuple[Item, ItemResult]]:
    """A quick-profile ``qualitatively reproduced`` whose paper-scale twin reads ``different`` is not.

    Twins are the items of one paper that check the same figure or table (:func:`claim_label`),
    e.g. SHF Figure 3 on MNIST, USPS and CURVES-like. When a paper-scale twin misses the claim, a
    quick-profile pass of it becomes ``not yet run at paper scale``, with a note naming the twin.

    Args:
        evaluated: ``(item, result)`` pairs; results are changed in place.

    Returns:
        ``evaluated``.
    """
    for item, res in evaluated:
        if res.status != QUALITATIVE or result_profile(res) == "paper":
            continue
        twins = [
            other.title.split(":")[0]
            for other, ores in evaluated
            if other is not item
            and other.paper == item.paper
            and claim_label(other) == claim_label(item)
            and ores.status == DIFFERENT
            and result_profile(ores) == "paper"
        ]
        if twins:
            res.status = NOT_PAPER_SCALE
            res.notes.insert(
                0,
                f"the claim holds in the {result_profile(res) or 'short'}-profile runs, but at the paper's "
                f"settings {', '.join(twins)} read{'s' if len(twins) == 1 else ''} **different**: "
                "not counted as qualitatively reproduced",
            )
    return evaluated


# -- writers -----------------------------------------------------------------------------------------------
def _relpath(path: Path, start: Path) -> str:
    import os

    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def _md_table(frame: pd.DataFrame) -> str:
    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v).replace("|", "\\|") for v in row) + " |")
    return "\n".join(lines)


def _html_table(frame: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in row) + "</tr>"
        for row in frame.itertuples(index=False)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _inline(text: str) -> str:
    """Minimal Markdown for notes in HTML: `code` spans and **bold**."""
    out = html.escape(text)
    parts = out.split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def bench_section(results: Path) -> tuple[str, str, pd.DataFrame] | None:
    """The report's section for the cross-paper cost table that ``make bench`` writes.

    Args:
        results: The results directory; the table is read from
            ``<results>/tables/bench_cross_paper.csv``.

    Returns:
        ``(title, note, table)``: the table keeps the columns ``paper``, ``task``, ``optimizer``,
        ``device``, ``step / Adam``, ``state / Adam`` and ``notes`` where present, and is empty when the file
        is missing or unreadable.
    """
    path = results / "tables" / "bench_cross_paper.csv"
    note = (
        "Step time and optimizer-state memory relative to Adam on the same task, from the `benchmarks/` "
        "scripts' JSON (`make bench`), each row on the device it names: CPU rows in quick mode on a shared "
        "2-core CPU (contended timings, see notes), GPU rows from the lent GPU's runs."
    )
    if not path.exists():
        return "Cross-paper cost vs Adam", note, pd.DataFrame()
    try:
        frame = pd.read_csv(path)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        frame = pd.DataFrame()
    keep = [
        c
        for c in ("paper", "task", "optimizer", "device", "step / Adam", "state / Adam", "notes")
        if c in frame
    ]
    return "Cross-paper cost vs Adam", note, frame[keep] if keep else frame


def summary_rows(evaluated: list[tuple[Item, ItemResult]]) -> pd.DataFrame:
    """The report's summary table, one row per item.

    Args:
        evaluated: ``(item, result)`` pairs in report order.

    Returns:
        Columns ``paper``, ``item`` (the title's short label), ``status`` (with its badge),
        ``ours from`` (provenance) and ``gap``.
    """
    return pd.DataFrame(
        [
            {
                "paper": item.paper,
                "item": item.title.split(":")[0],
                "status": f"{BADGES[res.status]} {res.status}",
                "ours from": res.provenance or "–",
                "gap": res.gap or "–",
            }
            for item, res in evaluated
        ]
    )


def write_markdown(
    evaluated: list[tuple[Item, ItemResult]], papers: dict[str, str], out: Path, header: str
) -> Path:
    """Write the Markdown report.

    Args:
        evaluated: ``(item, result)`` pairs in report order.
        papers: ``{paper key: section title}`` of the papers to show, in order; items of other
            papers appear in the summary only.
        out: The Markdown file (its folder is created); figures are linked relative to it, and
            the bench table is read from ``<out folder>/tables/``.
        header: Markdown placed first (title and explanation).

    Returns:
        ``out``.
    """
    lines = [header, "", "## Summary", "", _md_table(summary_rows(evaluated)), ""]
    counts = pd.Series([r.status for _, r in evaluated]).value_counts()
    lines.append("Counts: " + ", ".join(f"{s}: {int(counts.get(s, 0))}" for s in STATUSES) + ".\n")
    for paper, title in papers.items():
        lines += [f"## {title}", ""]
        for item, res in (e for e in evaluated if e[0].paper == paper):
            lines += [f"### {item.title}", "", f"**Status: {BADGES[res.status]} {res.status}**"]
            if res.provenance:
                lines.append(f" — ours from: {res.provenance}")
            if res.gap:
                lines.append(f" — gap: {res.gap}")
            lines.append("")
            if res.rows is not None and not res.rows.empty:
                lines += [_md_table(res.rows), ""]
            for note in res.notes:
                lines.append(f"- {note}")
            if res.notes:
                lines.append("")
            for fig in res.figures:
                lines += [f"![{item.title}]({_relpath(Path(fig), out.parent)})", ""]
            lines.append(f"<sub>Regenerate: `{item.make}`</sub>\n")
    bench = bench_section(out.parent)
    if bench is not None:
        title, note, frame = bench
        lines += [
            f"## {title}",
            "",
            note,
            "",
            _md_table(frame) if not frame.empty else "not run: `make bench`",
            "",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def _png_for_html(path: Path, max_width: int = 1400) -> bytes:
    """The PNG for embedding: at most ``max_width`` pixels wide, quantised to a 256-colour palette.

    Plots lose nothing visible; REPORT.html shrinks ~3x. The file is returned unchanged when that
    is not smaller or Pillow cannot read it.
    """
    raw = path.read_bytes()
    try:
        import io

        from PIL import Image

        with Image.open(io.BytesIO(raw)) as img:
            small = img.convert("RGB")
            if small.width > max_width:
                size = (max_width, round(small.height * max_width / small.width))
                small = small.resize(size, Image.LANCZOS)
            buf = io.BytesIO()
            small.quantize(256).save(buf, format="PNG", optimize=True)
            return buf.getvalue() if buf.tell() < len(raw) else raw
    except Exception:  # not a PNG Pillow reads: embed it unchanged
        return raw


_CSS = """body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em;line-height:1.4}
table{border-collapse:collapse;margin:.5em 0;font-size:.85em}td,th{border:1px solid #bbb;padding:2px 6px}
th{background:#eee}img{max-width:100%;border:1px solid #ddd}code{background:#f4f4f4;padding:0 2px}
.status{font-weight:bold}"""


def write_html(
    evaluated: list[tuple[Item, ItemResult]], papers: dict[str, str], out: Path, header: str
) -> Path:
    """Write the HTML report: the Markdown's content, every figure embedded (one portable file).

    Args:
        evaluated: ``(item, result)`` pairs in report order.
        papers: ``{paper key: section title}`` of the papers to show, in order.
        out: The HTML file (its folder is created); the bench table is read from
            ``<out folder>/tables/``.
        header: The Markdown header: its first line (``# title``) becomes the title, the other
            non-empty lines paragraphs.

    Returns:
        ``out``.
    """
    title, *rest = header.splitlines()
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title.lstrip('# '))}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title.lstrip('# '))}</h1>",
        *(f"<p>{_inline(line)}</p>" for line in rest if line.strip()),
        "<h2>Summary</h2>",
        _html_table(summary_rows(evaluated)),
    ]
    for paper, ptitle in papers.items():
        parts.append(f"<h2>{html.escape(ptitle)}</h2>")
        for item, res in (e for e in evaluated if e[0].paper == paper):
            parts.append(f"<h3>{html.escape(item.title)}</h3>")
            line = f"<span class='status'>Status: {BADGES[res.status]} {html.escape(res.status)}</span>"
            if res.provenance:
                line += f" — ours from: {html.escape(res.provenance)}"
            if res.gap:
                line += f" — gap: {html.escape(res.gap)}"
            parts.append(f"<p>{line}</p>")
            if res.rows is not None and not res.rows.empty:
                parts.append(_html_table(res.rows))
            if res.notes:
                parts.append("<ul>" + "".join(f"<li>{_inline(n)}</li>" for n in res.notes) + "</ul>")
            for fig in res.figures:
                data = base64.b64encode(_png_for_html(Path(fig))).decode()
                parts.append(
                    f"<p><img alt='{html.escape(item.title)}' src='data:image/png;base64,{data}'></p>"
                )
            parts.append(f"<p><small>Regenerate: <code>{html.escape(item.make)}</code></small></p>")
    bench = bench_section(out.parent)
    if bench is not None:
        title, note, frame = bench
        parts += [f"<h2>{html.escape(title)}</h2>", f"<p>{_inline(note)}</p>"]
        parts.append(_html_table(frame) if not frame.empty else "<p>not run: <code>make bench</code></p>")
    parts.append("</body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts) + "\n")
    return out
