"""What a run directory may be used for, and the config a resumed run continues with.

A run directory ``results/<experiment>/<run_id>/`` belongs to one run. Before anything is
loaded, :func:`check_run_dir` decides from its files what the command may do with it:

* a new (or empty) directory: start;
* ``trainer.resume=true``: continue from ``checkpoint.pt`` (refused without one);
* ``trainer.restart=true``: start again; the old records are moved aside to
  ``<run_id>.<status>-<time>/`` (never deleted);
* anything else that holds records (finished, failed, interrupted or killed) is refused with a
  message that says which flag does what.
* a run id whose rows were packed into its experiment directory (``metrics.parquet``,
  :mod:`curvopt.analysis.pack`) is refused whatever the flags, until
  ``python -m experiments.pack --unpack <run_dir>`` brings its rows back: a run continued
  or started there would otherwise replace the packed rows at the next packing.

On resume the run's saved ``config.yaml`` is its config (:func:`resume_config`): the command
line may only *extend* the run (:data:`EXTEND_KEYS`) or change where and how it is observed
(:func:`is_environment_key`: paths, logger, progress output); an override that changes anything
else is refused with the difference printed, unless ``trainer.allow_config_change=true``.
A ``config.yaml`` edited by hand since the checkpoint was written is refused the same way
(:func:`config_edits`), and one that is not valid YAML is named (:func:`load_saved_config`).
:func:`plan_resume` does all of it for a run directory.

``run_id`` and ``experiment_name`` are single directory names (:func:`check_name`): nothing a run
writes can land outside ``paths.results_dir``.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from curvopt.errors import ConfigError, NoCheckpointError, RunExistsError
from curvopt.training.checkpoint import (
    CHECKPOINT_NAME,
    checkpoint_config,
    load_weights_only,
    verify_checkpoint,
)
from curvopt.training.records import (
    METRICS_NAME,
    PARKED_METRICS_NAME,
    PATH_KEYS,
    has_metrics,
    packed_run_ids,
    path_roots,
    portable_paths,
    read_metrics,
)

RECORD_FILES = (
    "config.yaml",
    "overrides.yaml",
    METRICS_NAME,
    PARKED_METRICS_NAME,
    "summary.json",
    CHECKPOINT_NAME,
)
# overrides accepted on resume because they only extend the run (it continues identically)
EXTEND_KEYS = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_algo_time_s",
    "trainer.patience_evals",
    "trainer.checkpoint_every",
    "trainer.checkpoint_every_s",
    "trainer.keep_checkpoint",
)
# where the run reads and writes, how it reports: always the current command line's
ENVIRONMENT_PREFIXES = ("paths.", "logger.", "hydra.")
ENVIRONMENT_KEYS = (
    "trainer.resume",
    "trainer.restart",
    "trainer.pause_at_step",
    "trainer.allow_config_change",
    "trainer.progress",
    "trainer.progress_log_every_s",
)
# the run directory's names: the command found the run by them (a run moved with
# `python -m experiments.pack --move` is resumed under its new names)
DIRECTORY_KEYS = ("run_id", "experiment_name")
# config groups whose choice is part of the environment (not of the run)
ENVIRONMENT_GROUPS = ("logger", "paths", "trainer")
# run_id / experiment_name: at most this many bytes, so that the moved-aside name
# <run_id>.<status>-<YYYYmmdd-HHMMSS>-<n> stays under the 255-byte limit of a file name
MAX_NAME_BYTES = 200


def check_name(key: str, value: Any) -> str:
    """Check that ``run_id`` / ``experiment_name`` is one directory name under the results dir.

    Refused: an empty name, a slash or backslash, a leading ``.`` (``.``, ``..``, hidden names), NUL
    or other control characters, more than :data:`MAX_NAME_BYTES` bytes (UTF-8), and (for
    ``run_id``) a name that ends like a run moved aside (``<id>.<status>-<time>``).

    Args:
        key: ``run_id`` or ``experiment_name``, for the message.
        value: The configured value.

    Returns:
        The name as a string.

    Raises:
        ConfigError: Naming the value and the rule it breaks.
    """
    name = str(value)
    if not name:
        problem = "is empty"
    elif "/" in name or "\\" in name:
        problem = "contains a path separator ('/' or '\\')"
    elif name.startswith("."):
        problem = "starts with '.' ('.', '..' and hidden names are not allowed)"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "contains NUL or another control character"
    elif len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        problem = (
            f"is {len(name.encode('utf-8', 'surrogatepass'))} bytes long; at most {MAX_NAME_BYTES} "
            "(room for the <name>.<status>-<time> a restart moves old records to)"
        )
    elif key == "run_id" and is_set_aside(name):
        problem = "ends like a run moved aside (<run_id>.<status>-<time>)"
    else:
        return name
    shown = name if len(name) <= 60 else name[:57] + "..."
    raise ConfigError(
        f"{key}={shown!r} {problem}: {key} must be a single directory name under "
        f"paths.results_dir (no '/' or '\\', no leading '.', no control characters, at most "
        f"{MAX_NAME_BYTES} bytes); choose another"
    )


def is_environment_key(key: str) -> bool:
    """Whether a config key says where and how a run is observed rather than what it computes.

    Args:
        key: A dotted config key.

    Returns:
        ``True`` for :data:`ENVIRONMENT_KEYS`, keys under ``paths.``/``logger.``/``hydra.``, and
        ``paths``/``logger`` themselves.
    """
    return key in ENVIRONMENT_KEYS or key.startswith(ENVIRONMENT_PREFIXES) or key in ("paths", "logger")


@dataclass
class CommandLine:
    """A Hydra command line: the overrides as typed and the config-group choices in effect.

    Attributes:
        overrides: The overrides as typed (``key=value``, ``group=choice``).
        choices: Config group → choice in effect.
    """

    overrides: list[str] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)

    def _parsed(self) -> list[Any]:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_overrides(list(self.overrides))

    @property
    def explicit_keys(self) -> set[str]:
        """Keys set by ``key=value`` (not group choices)."""
        return {ov.key_or_group for ov in self._parsed() if ov.key_or_group not in self.choices}

    @property
    def chosen_groups(self) -> set[str]:
        """Config groups chosen on the command line (``optimizer=adam``)."""
        return {ov.key_or_group for ov in self._parsed() if ov.key_or_group in self.choices}

    @classmethod
    def parse(cls, overrides: Sequence[str], groups: Iterable[str]) -> CommandLine:
        """Build a command line from overrides alone (tests, scripts).

        Args:
            overrides: The overrides as typed.
            groups: The config-group names; ``group=value`` overrides become choices.

        Returns:
            The :class:`CommandLine`.
        """
        groups = set(groups)
        choices = {}
        for item in overrides:
            key, _, value = item.partition("=")
            if key in groups:
                choices[key] = value
        return cls(list(overrides), choices)


# -- the run directory ----------------------------------------------------------------------------
def has_records(run_dir: Path) -> bool:
    """Whether a run directory holds any record file (:data:`RECORD_FILES`).

    Args:
        run_dir: The run directory.

    Returns:
        ``True`` if at least one record file exists.
    """
    return any((run_dir / name).exists() for name in RECORD_FILES)


def run_status(run_dir: Path) -> str:
    """The status of the run in ``run_dir``.

    Args:
        run_dir: The run directory.

    Returns:
        ``completed`` / ``diverged`` / ``failed`` / ``interrupted`` from ``summary.json``, or
        ``killed`` when a run left records but no summary (or one still saying ``running``).
    """
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        status = None
    return status if status and status != "running" else "killed"


def _describe(run_dir: Path, status: str) -> str:
    checkpoint = run_dir / CHECKPOINT_NAME
    return f"status {status}, " + ("a checkpoint" if checkpoint.exists() else "no checkpoint")


def check_run_dir(run_dir: Path, resume: bool, restart: bool) -> str:
    """Decide what this command does with ``run_dir`` (module docstring).

    Args:
        run_dir: The run directory.
        resume: ``trainer.resume``.
        restart: ``trainer.restart``.

    Returns:
        ``"new"``, ``"resume"`` or ``"restart"``.

    Raises:
        ConfigError: If both ``resume`` and ``restart`` are set.
        NoCheckpointError: If ``resume`` is set and there is no checkpoint.
        RunExistsError: If the directory holds records and neither flag says what to do (the
            message names the flags that would work), or if the run's rows are packed in its
            experiment directory (they are unpacked first, whatever the flags).
    """
    if resume and restart:
        raise ConfigError("trainer.resume=true and trainer.restart=true exclude each other; choose one")
    if not (run_dir / METRICS_NAME).exists():  # a parked copy left beside a packed run counts for nothing
        _refuse_packed(run_dir, resume, restart)
    records = run_dir.is_dir() and has_records(run_dir)
    if resume:
        if not (run_dir / CHECKPOINT_NAME).exists():
            if not records:
                raise NoCheckpointError(
                    f"trainer.resume=true needs run_id=<existing run> with a checkpoint; none at {run_dir}"
                )
            status = run_status(run_dir)
            raise NoCheckpointError(
                f"trainer.resume=true but {run_dir} ({_describe(run_dir, status)}) has nothing to resume "
                "from; start it again with trainer.restart=true (its records are moved aside), and set "
                "trainer.checkpoint_every or trainer.checkpoint_every_s so that a run leaves checkpoints"
            )
        return "resume"
    if not records:
        return "new"
    if restart:
        return "restart"
    status = run_status(run_dir)
    if status in ("completed", "diverged"):
        raise RunExistsError(
            f"{run_dir} already holds a finished run ({status}); choose another run_id, pass "
            "trainer.restart=true to run it again (the old records are moved aside, not deleted), or "
            "trainer.resume=true with a larger trainer.max_steps to extend it"
        )
    resumable = (run_dir / CHECKPOINT_NAME).exists()
    raise RunExistsError(
        f"{run_dir} holds an unfinished run ({_describe(run_dir, status)}); "
        + ("continue it with trainer.resume=true, or " if resumable else "")
        + "start it again with trainer.restart=true (the old records are moved aside, not deleted)"
    )


def _refuse_packed(run_dir: Path, resume: bool, restart: bool) -> None:
    """Refuse a run id whose rows are packed in its experiment directory.

    A resumed or new run there would write a metrics file that holds only its own rows, and
    packing again would replace the packed run with it: the earlier rows would be lost. The rows
    come back first with ``python -m experiments.pack --unpack <run_dir>``.

    Raises:
        RunExistsError: ``run_dir``'s run id is in its experiment's pack.
    """
    if run_dir.name not in packed_run_ids(run_dir.parent):
        return
    unpack = f"python -m experiments.pack --unpack {run_dir}"
    where = f"the records of run {run_dir.name} are packed in {run_dir.parent} (metrics.parquet, runs.jsonl)"
    if resume:
        todo = f"unpack them first ({unpack}), then resume with the same command"
    elif restart:
        todo = f"unpack them first ({unpack}); trainer.restart=true then moves them aside"
    else:
        todo = (
            "choose another run_id, or unpack them "
            f"({unpack}) and continue it with trainer.resume=true or run it again with trainer.restart=true"
        )
    raise RunExistsError(f"{where}; {todo}")


_ASIDE = re.compile(r"\.(completed|diverged|failed|interrupted|killed|running)-\d{8}-\d{6}(-\d+)?$")


def is_set_aside(name: str) -> bool:
    """Whether a directory name is an old run moved aside.

    Such directories (``<run_id>.<status>-<time>``, made by ``trainer.restart=true`` or a driver)
    are kept, but are not runs of the experiment any more.

    Args:
        name: A directory name.

    Returns:
        ``True`` if the name has the moved-aside suffix.
    """
    return bool(_ASIDE.search(name))


def move_records_aside(run_dir: Path) -> Path:
    """Move the record files of ``run_dir`` into a new sibling ``<run_id>.<status>-<time>/``.

    Everything but ``run.lock`` is moved; nothing is deleted.

    Args:
        run_dir: The run directory.

    Returns:
        The new sibling directory.
    """
    status = run_status(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.{status}-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.{status}-{stamp}-{n}")
    aside.mkdir(parents=True)
    for path in run_dir.iterdir():
        if path.name != "run.lock":
            shutil.move(str(path), str(aside / path.name))
    return aside


def save_command_line(run_dir: Path, cli: CommandLine | None) -> None:
    """Write ``overrides.yaml`` (overrides and group choices) into the run directory.

    Args:
        run_dir: The run directory.
        cli: The command line; ``None`` writes nothing.
    """
    if cli is None:
        return
    text = OmegaConf.to_yaml(
        OmegaConf.create({"overrides": list(cli.overrides), "choices": dict(cli.choices)})
    )
    # a folder on the command line is kept relative to the data directory / the repository
    (run_dir / "overrides.yaml").write_text(portable_paths(text))


# -- the config of a resumed run ------------------------------------------------------------------
def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the leaves of a nested dict (lists and empty dicts are leaves)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _under(key: str, roots: Iterable[str]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in roots)


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


_ABSENT = object()
# identity of a group's choice for runs saved before overrides.yaml existed
_LEGACY_IDENTITY = {
    "experiment": ("experiment_name", "profile"),
    "optimizer": ("optimizer.name",),
    "dataset": ("dataset.name",),
}


@dataclass
class ResumePlan:
    """The config a resumed run continues with, and what changed.

    Attributes:
        config: The resolved config.
        extended: ``"key: old -> new"`` applied because they extend the run.
        changed: ``"key: old -> new"`` applied under ``trainer.allow_config_change``.
        changed_keys: The keys (or group names) of ``changed``.
        edits: ``(key, "key: checkpoint value -> config.yaml value")`` for a ``config.yaml``
            edited since the checkpoint was written (:func:`config_edits`; only under
            ``trainer.allow_config_change``).
        optimizer_changes: The ``optimizer.*`` keys whose value differs from the config the
            checkpoint was trained with (:func:`changed_optimizer_keys`): the resumed optimizer
            state would override them.
    """

    config: DictConfig
    extended: list[str]  # "key: old -> new" applied because they extend the run
    changed: list[str]  # "key: old -> new" applied under trainer.allow_config_change
    changed_keys: list[str] = field(default_factory=list)  # their keys (a group name for a group)
    edits: list[tuple[str, str]] = field(default_factory=list)  # config.yaml edited since the checkpoint
    optimizer_changes: list[str] = field(default_factory=list)  # differ from the checkpoint's config


def _same_folder(key: str, old: Any, new: Any, roots: list[tuple[str, str]]) -> bool:
    """Whether a folder key's saved (portable) value names the folder ``new`` names on this machine."""
    if key.rsplit(".", 1)[-1] not in PATH_KEYS or not (isinstance(old, str) and isinstance(new, str)):
        return False
    return portable_paths(new, roots) == old


def resume_config(
    saved: DictConfig | dict,
    fresh: DictConfig,
    cli: CommandLine | None = None,
    saved_choices: dict[str, str] | None = None,
    allow_change: bool = False,
) -> ResumePlan:
    """The config a resumed run continues with.

    Its ``saved`` config, plus from ``fresh`` the environment keys, the :data:`EXTEND_KEYS` set
    explicitly and keys new since the run was saved. Interpolations that produced a saved value
    (``data_dir: ${paths.data_dir}``) follow the current environment.

    Args:
        saved: The run's saved ``config.yaml``.
        fresh: The config this command composed.
        cli: Tells which keys and groups the command line set; without it (a config built in
            Python) every differing key counts as set.
        saved_choices: The group choices saved in the run's ``overrides.yaml`` (``None`` for
            runs saved before it existed).
        allow_change: Apply other explicit changes instead of refusing (records then mix two
            configs).

    Returns:
        The :class:`ResumePlan`.

    Raises:
        ConfigError: If the command line changes a key or group choice outside the environment
            and :data:`EXTEND_KEYS`, unless ``allow_change``; the message lists the differences.
    """
    saved_c = OmegaConf.to_container(saved, resolve=True) if isinstance(saved, DictConfig) else dict(saved)
    raw = OmegaConf.to_container(fresh, resolve=False)
    resolved = OmegaConf.to_container(fresh, resolve=True)
    assert isinstance(saved_c, dict) and isinstance(raw, dict) and isinstance(resolved, dict)
    s_flat, f_flat, r_flat = _flatten(saved_c), _flatten(resolved), _flatten(raw)
    explicit = cli.explicit_keys if cli is not None else None
    paths_cfg = resolved.get("paths")
    fresh_roots = path_roots(paths_cfg.get("data_dir") if isinstance(paths_cfg, dict) else None)
    chosen = (cli.chosen_groups - set(ENVIRONMENT_GROUPS)) if cli is not None else set()

    updates: dict[str, Any] = {}
    extended, conflicts = [], []
    for group in sorted(chosen):  # a different group choice changes the run
        new = cli.choices.get(group) if cli is not None else None
        if saved_choices is not None and group in saved_choices:
            if saved_choices[group] != new:
                conflicts.append((group, f"{group}: {saved_choices[group]} -> {new}", [group]))
            continue
        # the run's command line did not choose this group (its experiment's default applied), or
        # it was saved before overrides.yaml existed: compare what the choice sets
        if group in _LEGACY_IDENTITY:
            keys = _LEGACY_IDENTITY[group]
        else:
            keys = tuple(k for k in f_flat if _under(k, [group]) and not _under(k, explicit or ()))
        diff = [k for k in keys if s_flat.get(k, _ABSENT) != f_flat.get(k, _ABSENT) and k in f_flat]
        if diff:
            lines = "; ".join(f"{k}: {_show(s_flat.get(k, _ABSENT))} -> {f_flat[k]!r}" for k in diff)
            conflicts.append((group, f"{group}={new} ({lines})", [group]))

    for key in sorted(set(f_flat) | set(s_flat)):
        if key.startswith("hydra"):
            continue
        old, new = s_flat.get(key, _ABSENT), f_flat.get(key, _ABSENT)
        if is_environment_key(key) or key in DIRECTORY_KEYS:
            if new is not _ABSENT:
                updates[key] = new
            continue
        if new is _ABSENT or old == new:
            continue
        if _same_folder(key, old, new, fresh_roots):
            # config.yaml saves folders portably ($CURVOPT_DATA_DIR/..., relative to the repository);
            # the folder this machine names for the same place is no change
            updates[key] = r_flat.get(key, new)
            continue
        if old is _ABSENT:  # a key added to the configs since the run was saved
            updates[key] = r_flat.get(key, new)
            continue
        if explicit is not None and not _under(key, explicit):
            continue  # not asked for: the run keeps its value
        line = f"{key}: {old!r} -> {new!r}"
        if key in EXTEND_KEYS:
            updates[key] = new
            extended.append(line)
        else:
            conflicts.append((key, line, [key]))

    changed, changed_keys = [], []
    if conflicts:
        if not allow_change:
            listed = "\n".join(f"  {line}" for _, line, _ in conflicts)
            raise ConfigError(
                "trainer.resume=true continues a run with its saved config.yaml, but this command "
                f"changes it:\n{listed}\n"
                "Drop these overrides to continue the run as it was, start a new run_id, or pass "
                "trainer.allow_config_change=true to continue with the changed values (the records "
                "then mix two configs). Overrides that only extend a run are accepted: "
                + ", ".join(EXTEND_KEYS)
                + "."
            )
        for key, line, roots in conflicts:
            changed.append(line)
            changed_keys.append(key)
            if (
                roots == [key]
                and key in chosen
                and key != "experiment"
                and isinstance(saved_c.get(key), dict)
            ):
                # another choice of a group: its settings replace the old choice's (an Adam run
                # switched to SGD keeps no `betas` for SGD to reject)
                saved_c[key] = copy.deepcopy(resolved.get(key))
            for key, value in f_flat.items():
                if _under(key, roots) or (roots == ["experiment"] and not is_environment_key(key)):
                    updates[key] = value

    # interpolations that produced the saved value (data_dir: ${paths.data_dir}) follow the
    # current environment: re-point them instead of keeping the saved literal
    base = OmegaConf.create(saved_c)
    for key, value in r_flat.items():
        if key in updates or not (isinstance(value, str) and "${" in value) or key not in s_flat:
            continue
        probe = OmegaConf.create(saved_c)
        try:
            OmegaConf.update(probe, key, value, force_add=True)
            if OmegaConf.select(probe, key) == s_flat[key]:
                updates[key] = value
        except Exception:  # an interpolation the saved config cannot resolve: keep the literal
            continue
    for key, value in updates.items():
        OmegaConf.update(base, key, value, force_add=True, merge=False)
    config = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    assert isinstance(config, DictConfig)
    return ResumePlan(config, extended, changed, changed_keys)


# -- the saved config.yaml against the checkpoint -------------------------------------------------
def load_saved_config(path: Path) -> DictConfig:
    """Read a run's ``config.yaml``.

    Args:
        path: The file.

    Returns:
        The config.

    Raises:
        ConfigError: The file is not valid YAML or not a mapping; the message names it.
    """
    try:
        saved = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError, UnicodeDecodeError, OmegaConf's own errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{path} is not a valid config ({type(err).__name__}: {first}); it was damaged or edited by "
            "hand: restore it (e.g. from git or a backup), or start the run again with "
            "trainer.restart=true (the old records are moved aside)"
        ) from err
    if not isinstance(saved, DictConfig):
        raise ConfigError(
            f"{path} is not a mapping of config keys; restore it, or start the run again with "
            "trainer.restart=true"
        )
    return saved


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def config_edits(
    recorded: str | None, saved: DictConfig, fresh: DictConfig | None = None
) -> list[tuple[str, str]]:
    """Keys of the run's ``config.yaml`` that differ from the config its checkpoint was trained with.

    The checkpoint records the config text the run wrote (``config_yaml``); a difference means
    ``config.yaml`` was edited (by hand, or by a resume whose changes never reached a checkpoint).
    Not counted: where the run is observed (:func:`is_environment_key`), ``run_id`` (the directory
    names the run), the keys that only extend a run (:data:`EXTEND_KEYS`), keys the checkpoint's
    config does not have (added by a newer version of the configs) and keys whose value is an
    interpolation in ``fresh`` (``data_dir: ${paths.data_dir}`` follows the machine).

    Args:
        recorded: The checkpoint's config text; ``None`` (checkpoints written before it was
            recorded) gives no differences.
        saved: The run's ``config.yaml``.
        fresh: The config this command composed (unresolved), for its interpolations.

    Returns:
        ``(key, "key: checkpoint value -> config.yaml value")`` per difference, sorted by key.
    """
    if recorded is None:
        return []
    then = OmegaConf.to_container(OmegaConf.create(recorded), resolve=False)
    now = OmegaConf.to_container(saved, resolve=False)
    assert isinstance(then, dict) and isinstance(now, dict)
    t_flat, n_flat = _flatten(then), _flatten(now)
    raw = _flatten(OmegaConf.to_container(fresh, resolve=False)) if fresh is not None else {}
    out = []
    for key in sorted(t_flat):
        if key in DIRECTORY_KEYS or key.startswith("hydra") or is_environment_key(key) or key in EXTEND_KEYS:
            continue
        if isinstance(raw.get(key), str) and "${" in raw[key]:
            continue
        old, new = t_flat[key], n_flat.get(key, _ABSENT)
        if new is _ABSENT or not _same(old, new):
            out.append((key, f"{key}: {old!r} -> {_show(new)}"))
    return out


def changed_optimizer_keys(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``optimizer.*`` keys whose value differs between two configs (present in both, or removed).

    Keys only ``now`` has (added to the configs since) do not count: their default applies.

    Args:
        then: The config the checkpoint was trained with.
        now: The config the resumed run continues with.

    Returns:
        The differing keys, sorted.
    """
    old = _flatten(then.get("optimizer") or {}, "optimizer.")
    new = _flatten(now.get("optimizer") or {}, "optimizer.")
    return sorted(k for k in old if k != "optimizer.name" and (k not in new or not _same(new[k], old[k])))


def saved_choices(run_dir: Path) -> dict[str, str] | None:
    """The config-group choices a run saved in its ``overrides.yaml``.

    Args:
        run_dir: The run directory.

    Returns:
        Group -> choice; ``None`` for runs saved before ``overrides.yaml`` existed.
    """
    path = run_dir / "overrides.yaml"
    if not path.exists():
        return None
    saved = OmegaConf.to_container(load_saved_config(path))
    return dict(saved.get("choices") or {}) if isinstance(saved, dict) else None


def plan_resume(
    run_dir: Path, fresh: DictConfig, cli: CommandLine | None, allow_change: bool, verify: bool = True
) -> ResumePlan | None:
    """The config a resumed run continues with, checked against its checkpoint first.

    Nothing is loaded but the checkpoint's recorded config text. The run's ``config.yaml`` must be
    the config its checkpoint was trained with (:func:`config_edits`), then the command line may
    only extend the run (:func:`resume_config`).

    Args:
        run_dir: The run directory (it holds ``checkpoint.pt``).
        fresh: The config this command composed.
        cli: The command line (:func:`resume_config`).
        allow_change: ``trainer.allow_config_change``: continue with edits and changes instead of
            refusing them.
        verify: Check the checkpoint against its checksum first (rank 0 of a torchrun run; the
            other ranks leave it to rank 0).

    Returns:
        The :class:`ResumePlan`; ``None`` for a run without a saved ``config.yaml`` (it continues
        with ``fresh``).

    Raises:
        CorruptCheckpointError: The checkpoint does not match its checksum or cannot be read.
        ConfigError: ``config.yaml`` was edited since the checkpoint, or the command line
            changes the run, and ``allow_change`` is off; the message lists the differences.
    """
    checkpoint = run_dir / CHECKPOINT_NAME
    if verify:  # before anything is loaded: a damaged checkpoint is refused at once
        verify_checkpoint(checkpoint)
    recorded = checkpoint_config(checkpoint)
    step = checkpoint_step(checkpoint)
    check_pause_step((fresh.get("trainer") or {}).get("pause_at_step"), step, run_dir)
    has_config = (run_dir / "config.yaml").exists()
    saved = load_saved_config(run_dir / "config.yaml") if has_config else None
    if verify:  # rank 0 owns the records; the run logged rows as its own config said
        settled_park(run_dir)
        check_metrics_cover(run_dir, step, ((saved if saved is not None else fresh).get("trainer")) or {})
    if saved is None:
        return None
    if saved.get("run_id") is None:  # saved before run ids were recorded: the directory's name
        saved.run_id = run_dir.name
    edits = config_edits(recorded, saved, fresh)
    if edits and not allow_change:
        listed = "\n".join(f"  {line}" for _, line in edits)
        raise ConfigError(
            f"{run_dir / 'config.yaml'} differs from the config its checkpoint was trained with "
            f"(edited after the checkpoint was written):\n{listed}\n"
            "Undo the edit to continue the run as it was, pass trainer.allow_config_change=true to "
            "continue with the edited values (the records then mix two configs), or start a new run "
            "(another run_id, or trainer.restart=true)."
        )
    trained_with = OmegaConf.to_container(
        OmegaConf.create(recorded) if recorded is not None else saved, resolve=True
    )
    plan = resume_config(saved, fresh, cli, saved_choices(run_dir), allow_change=allow_change)
    now = OmegaConf.to_container(plan.config, resolve=True)
    assert isinstance(trained_with, dict) and isinstance(now, dict)
    plan.edits = edits
    check_same_optimizer(trained_with, now, run_dir)
    plan.optimizer_changes = changed_optimizer_keys(trained_with, now)
    return plan


def check_same_optimizer(then: dict[str, Any], now: dict[str, Any], run_dir: Path) -> None:
    """Refuse a resume that switches to another optimizer, whatever ``trainer.allow_config_change`` says.

    The checkpoint holds the state of the optimizer the run trained with (Adam's moments, SGD's
    momentum buffers, ...); another optimizer cannot continue from it.

    Raises:
        ConfigError: Naming the optimizer the run has and the one asked for.
    """
    old, new = then.get("optimizer") or {}, now.get("optimizer") or {}
    if not isinstance(old, dict) or not isinstance(new, dict):
        return
    keys = [k for k in ("name", "_target_") if k in old and k in new and old[k] != new[k]]
    if not keys:
        return
    was, asked = old.get("name", old.get("_target_")), new.get("name", new.get("_target_"))
    raise ConfigError(
        f"this resume changes the optimizer group: optimizer={was} -> optimizer={asked}, but {run_dir} "
        f"holds the state of {was}, which {asked} cannot continue from; resume with optimizer={was} (or "
        "without optimizer=), or start a new run with it (another run_id, or trainer.restart=true)"
    )


# -- what a resumed run finds in its directory ----------------------------------------------------
def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint was written at, read without loading its tensors.

    Args:
        path: The checkpoint.

    Returns:
        Its ``step``; ``None`` when it does not record one.
    """
    state = load_weights_only(path, map_location="cpu", mmap=True)
    step = state.get("step") if isinstance(state, dict) else None
    return int(step) if isinstance(step, int) else None


def check_pause_step(pause_at_step: Any, step: int | None, run_dir: Path) -> None:
    """Refuse a ``trainer.pause_at_step`` the resumed run has already reached.

    Raises:
        ConfigError: ``pause_at_step`` is at or before the checkpoint's step (the run would stop at
            once, with nothing trained and nothing said).
    """
    if pause_at_step is None or step is None or int(pause_at_step) > step:
        return
    raise ConfigError(
        f"trainer.pause_at_step={pause_at_step}: {run_dir} resumes at step {step}, already at or past it; "
        f"give a step after {step}, or leave pause_at_step out to run to the end"
    )


def settled_park(run_dir: Path) -> None:
    """Settle a run whose ``--park`` was killed between writing the gzip copy and deleting the original.

    Both ``metrics.jsonl`` and ``metrics.jsonl.gz`` then hold the same rows: the gzip copy goes. When
    they differ, which rows are the run's is unclear: refused, naming both.

    Raises:
        RunExistsError: The two files hold different rows.
    """
    plain, parked = run_dir / METRICS_NAME, run_dir / PARKED_METRICS_NAME
    if not (plain.exists() and parked.exists()):
        return
    try:
        same = gzip.decompress(parked.read_bytes()) == plain.read_bytes()
    except (OSError, EOFError):  # a damaged gzip copy: left for a person to judge
        same = False
    if same:
        parked.unlink()
        return
    raise RunExistsError(
        f"{run_dir} holds both {METRICS_NAME} and {PARKED_METRICS_NAME} with different rows; keep the one "
        "with the run's rows (the longer one, normally), delete the other, then resume"
    )


def check_metrics_cover(run_dir: Path, step: int | None, trainer: Any) -> None:
    """Refuse to resume over a ``metrics.jsonl`` that lacks rows up to the checkpoint's step.

    A run logs step 0 and every step divisible by ``trainer.log_every`` or ``trainer.eval_every``;
    a resume keeps the rows at or before its checkpoint and appends. Over a deleted or shortened
    file it would leave a gap no reader sees, under a summary that says ``completed``.

    Raises:
        RunExistsError: Naming the file, the rows it lacks and what to do.
    """
    if step is None:
        return
    path = run_dir / METRICS_NAME
    todo = (
        "restore it (git checkout, or a backup) and resume again, or start the run again with "
        "trainer.restart=true (its records are moved aside)"
    )
    if not has_metrics(run_dir):
        raise RunExistsError(
            f"{path} is missing: the run's rows up to its checkpoint (step {step}) are gone, and resuming "
            f"would record only the steps after it; {todo}"
        )
    steps = {r.get("step") for r in read_metrics(path) if isinstance(r, dict)}
    every = [int(n) for n in (trainer.get("log_every"), trainer.get("eval_every")) if n and int(n) > 0]
    last = max([0, *(step - step % n for n in every)])  # the last step before the checkpoint a row was due at
    missing = [s for s in (0, last) if s not in steps]
    if missing:
        have = sorted(s for s in steps if isinstance(s, int) and s <= step)
        held = f"rows of steps {have[0]}..{have[-1]}" if have else "no rows"
        raise RunExistsError(
            f"{path} is shortened: it holds {held} but lacks step {missing[0]} of the run resumed at step "
            f"{step} (a row was logged there); resuming would leave a gap; {todo}"
        )
