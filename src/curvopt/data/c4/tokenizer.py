"""The C4 tokenizer (``t5-base`` in GaLore's protocol): a local copy under ``<data_dir>/tokenizers/``, else the hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from curvopt.data.c4.sources import missing_message
from curvopt.data.common import hub_reachable
from curvopt.errors import CorruptDataError, DataNotFoundError

HUB_TOKENIZERS = {"t5-base": "google-t5/t5-base"}
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model", "vocab.json")


def load_tokenizer(data_dir: str | Path, name: str = "t5-base") -> Any:
    """``AutoTokenizer`` from ``<data_dir>/tokenizers/<name>`` (or the directory ``name``) or the hub.

    ``model_max_length`` is set huge: truncation is always explicit (``max_length``), and packing
    tokenises whole documents without the long-sequence warning.

    Args:
        data_dir: Data directory.
        name: Tokenizer name (``"t5-base"`` maps to ``google-t5/t5-base`` on the hub) or path.

    Returns:
        The tokenizer.

    Raises:
        DataNotFoundError: If there is no local tokenizer and the hub is unavailable.
        CorruptDataError: If a local tokenizer directory cannot be loaded.
    """
    from transformers import AutoTokenizer

    local = Path(data_dir) / "tokenizers" / name
    for folder in (local, Path(name)):
        if folder.is_dir():
            return _local_tokenizer(AutoTokenizer, folder, data_dir)
    if not hub_reachable():
        raise DataNotFoundError(
            missing_message(data_dir, f"no local tokenizer '{name}' and the hub is offline")
        )
    try:
        return AutoTokenizer.from_pretrained(HUB_TOKENIZERS.get(name, name), model_max_length=int(1e9))
    except Exception as err:  # network, auth, unknown name
        raise DataNotFoundError(
            missing_message(data_dir, f"tokenizer '{name}' unavailable ({err!r})")
        ) from None


def _local_tokenizer(auto: Any, folder: Path, data_dir: str | Path) -> Any:
    """A tokenizer from a local directory; an empty or unreadable one is named, not a traceback."""
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    if not any(name in present for name in TOKENIZER_FILES):
        raise DataNotFoundError(
            missing_message(
                data_dir,
                f"the tokenizer directory {folder.resolve()} holds no tokenizer files "
                f"(found: {', '.join(present) or 'nothing'}; expected one of {', '.join(TOKENIZER_FILES)})",
            )
        )
    try:
        return auto.from_pretrained(str(folder), model_max_length=int(1e9))
    except Exception as err:  # truncated JSON, a broken sentencepiece model, …
        raise CorruptDataError(
            f"{folder.resolve()}: the tokenizer cannot be loaded ({type(err).__name__}: {err}); one of its "
            f"files ({', '.join(present)}) is truncated or corrupt: copy the tokenizer again "
            "(e.g. huggingface-cli download google-t5/t5-base into that directory)"
        ) from None


def special_ids(tokenizer: Any) -> tuple[int, int, int]:
    """``(pad, eos, unk)`` ids of the tokenizer, T5's 0, 1, 2 where it defines none."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 1
    unk = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else 2
    return int(pad), int(eos), int(unk)
