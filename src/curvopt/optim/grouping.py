"""Which parameters get the method and which stay on Adam, and the loop factory.

docs/alice.md ("Parameter grouping") describes the split.

The paper's split, for LLaMA:

============================  ================================  ==============  ==================
method                         attention q/k/v/o, MLP gate/up/   ``lm_head``     embedding, RMSNorm
                               down (``nn.Linear`` in attn/mlp)
============================  ================================  ==============  ==================
Adam / AdamW                   Adam                              Adam            Adam
RACS, APOLLO(-Mini)            method                            Adam            Adam
GaLore/Fira/Alice/Alice-0      method                            **method**      Adam
  "+lm head" (Ppl.*)           method                            Adam            Adam
============================  ================================  ==============  ==================

One switch, ``lm_head_in_method``, moves the last layer between the method and Adam (default:
the method for the low-rank methods — the paper's main criterion "Ppl." — and Adam for RACS and
APOLLO). Matrices are found as GaLore does: the weights of ``nn.Linear`` modules whose name
contains one of ``target_modules`` (``attn``, ``mlp``). A model without such modules (the tiny
MLPs of the smoke tests) falls back to "every ``nn.Linear`` weight except the last layer", the
last ``nn.Linear`` playing the role of ``lm_head``. Biases, norms, embeddings and any non-2-D
parameter always go to the Adam group.

Following the GaLore codebase (a choice the paper leaves open; docs/decisions.md, RACS-5) both groups live
in ONE optimizer with one base lr; ``adam_lr`` gives the Adam group its own peak lr instead. The lr
scheduler multiplies both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from curvopt.optim.alice import Alice
from curvopt.optim.racs import RACS
from curvopt.profiling import tensor_bytes

METHODS = ("adam", "adamw", "racs", "alice", "alice0", "galore", "fira", "apollo", "apollo_mini")
# methods that put lm_head in their own group by default (the paper's "Ppl." runs)
HEAD_IN_METHOD_DEFAULT = {"galore": True, "fira": True, "alice": True, "alice0": True}


@dataclass
class ParamSplit:
    """Names and parameters of the method group and the Adam group.

    Attributes:
        method: ``(name, parameter)`` of the matrices that get the method.
        adam: ``(name, parameter)`` of every other trainable parameter.
        head: Qualified name of the module treated as the last layer (``None`` if none).
    """

    method: list[tuple[str, nn.Parameter]]
    adam: list[tuple[str, nn.Parameter]]
    head: str | None  # qualified name of the module treated as the last layer

    def numel(self) -> tuple[int, int]:
        """Parameter counts of the two groups.

        Returns:
            ``(method elements, Adam elements)``.
        """
        return sum(p.numel() for _, p in self.method), sum(p.numel() for _, p in self.adam)


def _is_head(name: str, head_name: str) -> bool:
    return name == head_name or name.endswith("." + head_name)


def split_params(
    model: nn.Module,
    lm_head_in_method: bool = False,
    target_modules: tuple[str, ...] | list[str] = ("attn", "mlp"),
    head_name: str = "lm_head",
) -> ParamSplit:
    """Split ``model``'s trainable parameters into the method group and the Adam group.

    Args:
        model: The network.
        lm_head_in_method: Put the last layer's weight in the method group.
        target_modules: Substrings of ``nn.Linear`` module names whose weights get the method
            (GaLore's rule); without any match, every ``nn.Linear`` but the last.
        head_name: Name (or name suffix) of the last layer.

    Returns:
        The :class:`ParamSplit`.
    """
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    heads = [name for name, _ in linears if _is_head(name, head_name)]
    targets = [
        name for name, _ in linears if any(key in name for key in target_modules) and name not in heads
    ]
    if targets:
        head = heads[-1] if heads else None
        chosen = set(targets)
    else:  # generic model: all linears but the last one, the last one acting as the head
        head = linears[-1][0] if linears else None
        chosen = {name for name, _ in linears[:-1]}
    if lm_head_in_method and head is not None:
        chosen.add(head)
    method_ids: set[int] = set()
    method: list[tuple[str, nn.Parameter]] = []
    for name, mod in linears:
        if name in chosen and mod.weight.requires_grad and id(mod.weight) not in method_ids:
            method.append((f"{name}.weight" if name else "weight", mod.weight))
            method_ids.add(id(mod.weight))
    adam = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in method_ids]
    return ParamSplit(method=method, adam=adam, head=head)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def build_optimizer(
    model: nn.Module,
    method: str,
    lr: float | None = None,
    adam_lr: float | None = None,
    lm_head_in_method: bool | None = None,
    target_modules: tuple[str, ...] | list[str] = ("attn", "mlp"),
    head_name: str = "lm_head",
    **hparams: Any,
) -> torch.optim.Optimizer:
    """One optimizer for ``model``: ``method`` on the chosen matrices, Adam on the rest.

    Args:
        model: The network.
        method: One of :data:`METHODS`. ``"adam"``/``"adamw"`` return ``torch.optim.AdamW`` on
            everything; ``"alice0"`` is Alice with ``betas[2] = 0``; ``"apollo_mini"`` is APOLLO
            with rank 1, tensor scaling, scale 128.
        lr: Base (peak) learning rate (required except for Adam, default 1e-3 there).
        adam_lr: Own learning rate of the Adam group (``None``: ``lr``).
        lm_head_in_method: Put the last layer in the method group; ``None``: the method's default
            (:data:`HEAD_IN_METHOD_DEFAULT`).
        target_modules: As in :func:`split_params`.
        head_name: As in :func:`split_params`.
        **hparams: The method's constructor arguments (``curvopt.optim.racs.RACS``,
            ``curvopt.optim.alice.Alice``, ``curvopt.optim.lowrank.{galore,fira,apollo}``); list
            values (betas) become tuples.

    Returns:
        The optimizer.

    Raises:
        ValueError: If ``method`` is unknown, no parameter qualifies, or ``lr`` is missing (and
            as the method's constructor, e.g. a negative or NaN lr).

    Example:
        Alice-0 on every ``nn.Linear`` but the last (a model without ``attn``/``mlp`` modules),
        Adam on the rest, in the usual loop:

        >>> import torch
        >>> from curvopt.optim import build_optimizer
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> opt = build_optimizer(model, "alice0", lr=0.02, rank=2, lm_head_in_method=False)
        >>> loss_fn, x, y = torch.nn.MSELoss(), torch.randn(16, 4), torch.randn(16, 2)
        >>> opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> [len(g["params"]) for g in opt.param_groups], [g["adam"] for g in opt.param_groups]
        ([1, 3], [False, True])
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    hparams = {k: _tuple(v) for k, v in hparams.items()}
    if method in ("adam", "adamw"):
        kwargs = {"lr": lr if lr is not None else 1e-3, **hparams}
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **kwargs)
    if lm_head_in_method is None:
        lm_head_in_method = HEAD_IN_METHOD_DEFAULT.get(method, False)
    split = split_params(model, lm_head_in_method, tuple(target_modules), head_name)
    if not split.method:
        raise ValueError(
            f"no parameter of {type(model).__name__} qualifies for {method}; check target_modules"
        )
    method_params = [p for _, p in split.method]
    adam_params = [p for _, p in split.adam]
    if lr is None:
        raise ValueError(f"{method} needs an lr")

    if method in ("racs", "alice", "alice0"):
        cls = RACS if method == "racs" else Alice
        if method == "alice0":
            b = hparams.get("betas", (0.9, 0.9, 0.0))
            hparams["betas"] = (b[0], b[1], 0.0)
        groups: list[dict[str, Any]] = [{"params": method_params}]
        if adam_params:
            groups.append(
                {"params": adam_params, "adam": True, **({"lr": adam_lr} if adam_lr is not None else {})}
            )
        return cls(groups, lr=lr, **hparams)

    from curvopt.optim import lowrank

    if method == "galore":
        return lowrank.galore(adam_params, method_params, lr=lr, adam_lr=adam_lr, **hparams)
    if method == "fira":
        return lowrank.fira(adam_params, method_params, lr=lr, adam_lr=adam_lr, **hparams)
    if method == "apollo_mini":
        defaults = {"rank": 1, "scale_type": "tensor", "scale": 128.0, "proj": "random"}
        return lowrank.apollo(adam_params, method_params, lr=lr, adam_lr=adam_lr, **{**defaults, **hparams})
    return lowrank.apollo(adam_params, method_params, lr=lr, adam_lr=adam_lr, **hparams)


def build_grouped(
    objective: Any, data: Any = None, method: str = "alice", **hparams: Any
) -> torch.optim.Optimizer:
    """Loop factory (``_target_`` of ``conf/optimizer/{racs,alice,…}.yaml``).

    Groups ``objective.model``'s parameters and builds the optimizer. The loop's
    ``build_algorithm`` wraps the result in a ``TorchOptimizerAlgorithm`` together with the
    config's ``scheduler``, gradient accumulation and DDP — the same path as a plain
    ``torch.optim`` target.

    Args:
        objective: Anything with a ``model`` attribute (an :class:`~curvopt.objective.Objective`).
        data: The run's data (unused).
        method: As in :func:`build_optimizer`.
        **hparams: Remaining keyword arguments of :func:`build_optimizer`.

    Returns:
        The ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import build_grouped
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> opt = build_grouped(Objective(model, "squared_error"), method="racs", lr=0.02)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 2)
        >>> steps = 0
        >>> while steps < 3:
        ...     opt.zero_grad()
        ...     (model(x) - y).square().sum(dim=1).mean().backward()
        ...     steps += opt.step() is None
        >>> type(opt).__name__
        'RACS'
    """
    del data
    return build_optimizer(objective.model, method, **hparams)


def describe(
    model: nn.Module, method: str, lm_head_in_method: bool | None = None, **kw: Any
) -> dict[str, Any]:
    """Counts for records and docs: how many parameters each group holds.

    Args:
        model: The network.
        method: The method name.
        lm_head_in_method: As in :func:`build_optimizer`.
        **kw: ``target_modules`` / ``head_name`` of :func:`split_params`.

    Returns:
        ``method``, ``lm_head_in_method``, ``head``, ``method_matrices``, ``method_params``,
        ``adam_params``.
    """
    if lm_head_in_method is None:
        lm_head_in_method = HEAD_IN_METHOD_DEFAULT.get(method, False)
    split = split_params(model, lm_head_in_method, **kw)
    n_method, n_adam = split.numel()
    return {
        "method": method,
        "lm_head_in_method": lm_head_in_method,
        "head": split.head,
        "method_matrices": len(split.method),
        "method_params": n_method,
        "adam_params": n_adam,
    }


# ----------------------------------------------------------------------------- memory accounting


# Table 7 / 9 / 11 ranks per LLaMA size (GaLore, Fira, APOLLO-svd and Alice use the same r).
def method_state_numel(method: str, shape: tuple[int, int], rank: int = 128) -> dict[str, tuple[int, bool]]:
    """State tensors our optimizer (or the official package) allocates for one weight matrix.

    Mirrors the constructors; the tests compare it with instantiated state.

    Args:
        method: ``adam``, ``adamw``, ``galore``, ``fira``, ``apollo``, ``apollo_mini``, ``apollo_svd``, ``racs``, ``alice0`` or ``alice``.
        shape: The weight's shape, as ``nn.Linear`` stores it.
        rank: Rank of the low-rank methods.

    Returns:
        ``name -> (elements, stored in fp32 regardless of the parameter dtype)``.

    Raises:
        ValueError: If the method has no known layout.
    """
    from curvopt.optim import lowrank

    if method in ("adam", "adamw"):
        m, n = shape
        return {"exp_avg": (m * n, False), "exp_avg_sq": (m * n, False)}
    if method == "racs":
        return {k: (v, k == "phi") for k, v in RACS.state_numel(shape).items()}
    if method in ("alice", "alice0"):
        betas = (0.9, 0.9, 0.999 if method == "alice" else 0.0)
        return {
            k: (v, k in ("Qt", "phi")) for k, v in Alice.state_numel(shape, rank=rank, betas=betas).items()
        }
    if method in ("galore", "apollo_svd"):
        return {k: (v, False) for k, v in lowrank.projected_state_numel(shape, rank).items()}
    if method == "fira":
        return {k: (v, False) for k, v in lowrank.fira_state_numel(shape, rank).items()}
    if method in ("apollo", "apollo_mini"):
        return {
            k: (v, False)
            for k, v in lowrank.apollo_state_numel(shape, 1 if method == "apollo_mini" else rank).items()
        }
    raise ValueError(f"no state layout for {method!r}")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor reachable from ``optimizer.state``; memory shared by several tensors counts once.

    Includes tensors held by the official packages' projector objects (searched up to a depth of
    4 containers/attributes).

    Args:
        optimizer: Any ``torch.optim.Optimizer``.

    Returns:
        The number of bytes.
    """
    return tensor_bytes(*optimizer.state.values())
