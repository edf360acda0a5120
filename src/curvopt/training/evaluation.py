"""Evaluation metrics per split, computed in chunks outside the algorithm's timer.

Which metrics are reported follows from the loss kind and the targets:

* every task: ``loss`` (the objective's mean loss);
* reconstruction (targets shaped like the outputs, float): ``E_sq = mean_i Σ_pixels (x̂ − x)²``
  (Martens' convention) and ``f = E_sq / 2`` (the SHF paper's objective). With ``sigmoid_bce``
  (Martens' autoencoder) the reconstruction is ``sigmoid(logits)``;
* class-index targets with ``cross_entropy``: ``accuracy``;
* multi-hot targets with ``sigmoid_bce`` whose size differs from the input's (multi-label
  classification, the FOSI paper's AudioSet task): ``hit_rate``, the fraction of examples whose
  top-scoring class is one of their positive labels (the authors' "accuracy");
* sequence targets (language modelling, ``y`` of shape ``(N, T)`` with ``ignore_index`` on
  padding): ``loss`` is the **token-weighted** mean cross-entropy over all non-ignored targets,
  ``ppl = exp(loss)``, and ``tokens`` the number of targets scored. With ``galore_compat`` also
  ``loss_galore`` / ``ppl_galore``: GaLore's ``evaluate_model`` value — the sum of per-batch mean
  losses divided by ``num_batches + 1`` (its ``total_batches`` starts at 1), averaged over ranks —
  so our numbers can be set beside the cited ones (docs/decisions.md, RACS-3).

Under data parallelism each rank evaluates its own chunk and ``reduce`` (a sum over ranks of a
list of floats) combines the sums before the division, so every rank gets the same metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from curvopt.objective import Objective, per_example_loss

Reduce = Callable[[list[float]], list[float]]


@torch.no_grad()
def evaluate_split(
    objective: Objective,
    x: Tensor,
    y: Tensor,
    batch_size: int = 2000,
    galore_compat: bool = False,
    reduce: Reduce | None = None,
    world_size: int = 1,
) -> dict[str, float]:
    """Metrics of one split (module docstring), in eval mode and without gradients.

    The model's train/eval mode is restored afterwards.

    Args:
        objective: The model and its loss kind.
        x: The split's inputs (this rank's chunk under data parallelism).
        y: The split's targets.
        batch_size: Rows per forward pass.
        galore_compat: Also report GaLore's ``loss_galore`` / ``ppl_galore`` for sequences.
        reduce: Sum over ranks of a list of floats (data parallelism); ``None`` for one process.
        world_size: Number of ranks (divides GaLore's per-rank value).

    Returns:
        ``loss`` and, depending on the task, ``accuracy``, ``ppl``, ``tokens``, ``hit_rate``,
        ``E_sq``, ``f``, ``loss_galore``, ``ppl_galore``.
    """
    model, kind = objective.model, objective.loss_kind
    was_training = model.training
    model.eval()
    total_loss, total_sq, correct, count, tokens, hits = 0.0, 0.0, 0, 0, 0, 0
    batch_mean_sum, num_batches = 0.0, 0
    reconstruction = y.dtype.is_floating_point and kind in ("squared_error", "sigmoid_bce") and y.dim() >= 2
    multilabel = (
        kind == "sigmoid_bce" and y.dtype.is_floating_point and y.dim() == 2 and y[0].numel() != x[0].numel()
    )
    reconstruction = reconstruction and not multilabel
    classification = kind == "cross_entropy" and not y.dtype.is_floating_point
    sequence = classification and y.dim() >= 2
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = model(xb)
        losses = per_example_loss(out, yb, kind, objective.ignore_index)
        if classification:
            mask = yb != objective.ignore_index
            batch_loss = float(losses[mask].sum())
            batch_tokens = int(mask.sum())
            total_loss += batch_loss
            pred = out.argmax(dim=-1)
            correct += int(((pred == yb) & mask).sum())
            tokens += batch_tokens
            if batch_tokens:
                batch_mean_sum += batch_loss / batch_tokens
            num_batches += 1
        else:
            total_loss += float(losses.sum())
        if multilabel:
            hits += int(yb.gather(1, out.argmax(dim=-1, keepdim=True)).gt(0.5).sum())
        if reconstruction:
            recon = torch.sigmoid(out) if kind == "sigmoid_bce" else out
            total_sq += float(((recon - yb) ** 2).flatten(1).sum())
        count += xb.shape[0]
    model.train(was_training)
    if reduce is not None:
        galore_local = batch_mean_sum / (num_batches + 1)
        total_loss, total_sq, correct, count, tokens, galore_sum, hits = reduce(
            [total_loss, total_sq, float(correct), float(count), float(tokens), galore_local, float(hits)]
        )
        galore_value = galore_sum / world_size
    else:
        galore_value = batch_mean_sum / (num_batches + 1)
    metrics: dict[str, float] = {}
    if classification:
        metrics["loss"] = total_loss / max(tokens, 1)
        metrics["accuracy"] = correct / max(tokens, 1)
    else:
        metrics["loss"] = total_loss / max(count, 1)
    if sequence:
        metrics["ppl"] = _exp(metrics["loss"])
        metrics["tokens"] = float(tokens)
        if galore_compat:
            metrics["loss_galore"] = galore_value
            metrics["ppl_galore"] = _exp(galore_value)
    if multilabel:
        metrics["hit_rate"] = hits / max(count, 1)
    if reconstruction:
        metrics["E_sq"] = total_sq / max(count, 1)
        metrics["f"] = total_sq / (2 * max(count, 1))
    return metrics


def _exp(value: float) -> float:
    try:
        return math.exp(value)
    except OverflowError:
        return float("inf")
