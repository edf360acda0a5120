"""Evaluation metrics per split, computed in chunks outside the algorithm's timer.

Which metrics are reported follows from the loss kind and the targets:

* every task: ``loss`` (the objective's mean loss);
* reconstruction (targets shaped like the outputs, float): ``E_sq = mean_i Σ_pixels (x̂ − x)²``
  (Martens' convention) and ``f = E_sq / 2`` (the SHF paper's objective). With ``sigmoid_bce``
  (Martens' autoencoder) the reconstruction is ``sigmoid(logits)``;
* class-index targets with ``cross_entropy``: ``accuracy``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvopt.objective import Objective, per_example_loss


@torch.no_grad()
def evaluate_split(objective: Objective, x: Tensor, y: Tensor, batch_size: int = 2000) -> dict[str, float]:
    model, kind = objective.model, objective.loss_kind
    was_training = model.training
    model.eval()
    total_loss, total_sq, correct, count, tokens = 0.0, 0.0, 0, 0, 0
    reconstruction = y.dtype.is_floating_point and kind in ("squared_error", "sigmoid_bce") and y.dim() >= 2
    classification = kind == "cross_entropy" and not y.dtype.is_floating_point
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = model(xb)
        losses = per_example_loss(out, yb, kind, objective.ignore_index)
        if classification:
            mask = yb != objective.ignore_index
            total_loss += float(losses[mask].sum())
            pred = out.argmax(dim=-1)
            correct += int(((pred == yb) & mask).sum())
            tokens += int(mask.sum())
        else:
            total_loss += float(losses.sum())
        if reconstruction:
            recon = torch.sigmoid(out) if kind == "sigmoid_bce" else out
            total_sq += float(((recon - yb) ** 2).flatten(1).sum())
        count += xb.shape[0]
    model.train(was_training)
    metrics: dict[str, float] = {}
    if classification:
        metrics["loss"] = total_loss / max(tokens, 1)
        metrics["accuracy"] = correct / max(tokens, 1)
    else:
        metrics["loss"] = total_loss / count
    if reconstruction:
        metrics["E_sq"] = total_sq / count
        metrics["f"] = total_sq / (2 * count)
    return metrics
