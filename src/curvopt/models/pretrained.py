"""Where the ImageNet-pretrained ResNet-18 weights of FOSI's transfer-learning (TL) task are found.

The model (:mod:`curvopt.models.resnet_head`) looks the file up when it is built and loads it; a
missing file stops the run before training (the loop's one forward through the model, before its
first step, raises it). The lookup belongs to the model, whose weights these are; it raises
:class:`curvopt.errors.DataNotFoundError` like every missing input.

Weights are looked up, in order: the configured path (a file, or a folder holding it); torch's hub
cache (``$TORCH_HOME/hub/checkpoints``), where torchvision stores them; a download through
``torch.hub`` when ``allow_download`` and online.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from curvopt.errors import DataNotFoundError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "resnet18-f37072fd.pth"
WEIGHTS_URL = f"https://download.pytorch.org/models/{WEIGHTS_FILE}"
HOW_TO_GET = (
    f"download {WEIGHTS_URL} (torchvision's ResNet18_Weights.IMAGENET1K_V1) and put it at "
    f"<data_dir>/resnet18/{WEIGHTS_FILE} (or set model.weights to its path), "
    "or into torch's hub cache (~/.cache/torch/hub/checkpoints/), e.g. by running once online "
    "`python -c \"import torch; torch.hub.load_state_dict_from_url('" + WEIGHTS_URL + "')\"`."
)


def resolve_weights(path: str | None, allow_download: bool = False) -> Path:
    """Find the pretrained ResNet-18 state-dict file.

    Args:
        path: The configured location: the ``.pth`` file itself, or a folder holding
            :data:`WEIGHTS_FILE`; ``None`` looks in torch's hub cache only.
        allow_download: Try ``torch.hub`` (into the hub cache) when no candidate exists.

    Returns:
        The path of an existing weights file.

    Raises:
        DataNotFoundError: No candidate exists (and the download, if allowed, failed); the
            message lists the places searched and how to get the file.
    """
    candidates: list[Path] = []
    if path:
        p = Path(os.path.expanduser(str(path)))
        candidates += [p / WEIGHTS_FILE, p] if p.suffix != ".pth" else [p]
    candidates.append(Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE)
    for c in candidates:
        if c.is_file():
            return c
    if allow_download:
        try:
            torch.hub.load_state_dict_from_url(WEIGHTS_URL, progress=False, check_hash=True)
            return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE
        except Exception as err:  # offline
            log.info("download of %s failed: %s", WEIGHTS_URL, err)
    searched = "\n".join(f"  - {c}" for c in candidates)
    raise DataNotFoundError(
        f"ImageNet-pretrained ResNet-18 weights not found (needed by the FOSI transfer-learning task).\n"
        f"Searched:\n{searched}\nHow to get them: {HOW_TO_GET}"
    )
