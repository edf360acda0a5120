"""The grid's tasks and methods, and which method applies to which task (decided from the model and
its loss, with the reason a method does not apply).

:func:`model_facts` builds a task's model (no data) and reads what the methods' preconditions look at;
:func:`applicability` is a pure function of those facts, so the decisions are testable on hand-made
facts and the reasons land in the table instead of empty cells.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The methods, in the table's order: first-order baselines, FOSI, the Gauss-Newton family, K-FAC,
# L-BFGS, the low-rank LLM optimizers. Config names under conf/optimizer/.
METHODS: tuple[str, ...] = (
    "adam",
    "heavy_ball",
    "fosi_adam",
    "fosi_heavy_ball",
    "shf_lsmr",
    "hf_cg",
    "fgn",
    "sgn",
    "kfac",
    "lbfgs",
    "racs",
    "alice",
)

LABELS = {
    "adam": "Adam",
    "heavy_ball": "Heavy-ball",
    "fosi_adam": "FOSI-Adam",
    "fosi_heavy_ball": "FOSI-HB",
    "shf_lsmr": "SHF-LSMR",
    "hf_cg": "HF-CG",
    "fgn": "FGN",
    "sgn": "SGN",
    "kfac": "K-FAC",
    "lbfgs": "L-BFGS",
    "racs": "RACS",
    "alice": "Alice",
}

# The hyper-parameter each method's trials vary (conf/per_optimizer/cross_common/<method>.yaml).
TUNED = {
    "adam": "lr",
    "heavy_ball": "lr",
    "fosi_adam": "lr",
    "fosi_heavy_ball": "lr",
    "shf_lsmr": "damping",
    "hf_cg": "initlambda",
    "fgn": "lr",
    "sgn": "lr",
    "kfac": "damping",
    "lbfgs": "history_size",
    "racs": "lr",
    "alice": "lr",
}


@dataclass(frozen=True)
class Task:
    """One task of the grid.

    Attributes:
        key: Short name (``usps``); the experiment is ``cross_<key>``.
        title: What the table calls it.
        paper: Whose task it is.
        metric: The validation metric judged (``val/E_sq``).
        mode: ``min`` or ``max``.
    """

    key: str
    title: str
    paper: str
    metric: str
    mode: str

    @property
    def experiment(self) -> str:
        return f"cross_{self.key}"


TASKS: dict[str, Task] = {
    t.key: t
    for t in (
        Task("usps", "USPS deep autoencoder", "SHF", "val/E_sq", "min"),
        Task("lr", "MNIST logistic regression", "FOSI", "val/accuracy", "max"),
        Task("lm", "Tiny Shakespeare char-LSTM LM", "FOSI", "val/loss", "min"),
        Task("llm", "tiny LLaMA on the C4 sample", "Alice", "val/loss", "min"),
    )
}


@dataclass(frozen=True)
class ModelFacts:
    """What the methods' preconditions look at, read from a built model.

    Attributes:
        loss: The loss kind (``squared_error``, ``cross_entropy``, ``sigmoid_bce``).
        plain_mlp: An ``nn.Sequential`` of Linear layers and elementwise activations
            (``curvopt.curvature.mlp_gn.mlp_layers``), the MLP of SHF and Martens' HF.
        sequence_output: The model predicts a sequence (language models).
        recurrent: Some module is a recurrent cell (a layer applied at every time step).
        uncovered: Parameter tensors outside nn.Linear / nn.Conv2d / nn.ConvTranspose2d modules.
        matrix_params: Number of trainable 2-D parameter tensors.
        body_matrices: Of those, the ones RACS's method group takes when the output head stays in
            Adam (``curvopt.optim.grouping.split_params``, the RACS paper's convention).
        in_memory_train: The whole training split is held in memory.
    """

    loss: str
    plain_mlp: bool
    sequence_output: bool
    recurrent: bool
    uncovered: tuple[str, ...] = field(default_factory=tuple)
    matrix_params: int = 0
    body_matrices: int = 0
    in_memory_train: bool = True

    def to_dict(self) -> dict:
        d = asdict(self)
        d["uncovered"] = list(self.uncovered)
        return d


def applicability(method: str, facts: ModelFacts) -> tuple[bool, str]:
    """Whether ``method`` applies to a model with ``facts``, and why not.

    The rules (docs/cross.md): SHF-LSMR needs a sum of squares over an MLP (its Gauss-Newton LSMR
    system is the least-squares Jacobian's); HF-CG a sum of squares or a matching cross-entropy over an
    MLP, with the whole training set in memory (full-set gradient and line search); FGN/SGN a softmax
    cross-entropy head with one prediction per example; K-FAC Kronecker blocks for every parameter of layers applied once per example;
    RACS/Alice matrix weights (RACS: besides the output head, which it leaves to Adam); Adam, heavy-ball, FOSI and L-BFGS any differentiable model.

    Args:
        method: A name of :data:`METHODS`.
        facts: The task's model facts.

    Returns:
        ``(applies, reason)``; the reason is empty when it applies.
    """
    if method in ("adam", "heavy_ball", "fosi_adam", "fosi_heavy_ball", "lbfgs"):
        return True, ""
    if method == "shf_lsmr":
        if facts.loss != "squared_error":
            return (
                False,
                f"SHF-LSMR solves a least-squares system: needs a sum-of-squares loss (here {facts.loss})",
            )
        if not facts.plain_mlp:
            return False, "SHF-LSMR's Gauss-Newton products are the MLP's (here not a plain MLP)"
        if not facts.in_memory_train:
            return False, "SHF-LSMR's sample-size test needs the training set in memory"
        return True, ""
    if method == "hf_cg":
        if facts.loss not in ("squared_error", "cross_entropy", "sigmoid_bce"):
            return False, f"HF-CG's Gauss-Newton needs a matching loss (here {facts.loss})"
        if not facts.plain_mlp:
            what = "a recurrent network" if facts.recurrent else "not a plain MLP"
            return False, f"HF-CG (Martens 2010) is defined here for MLPs (here {what})"
        if facts.sequence_output:
            return False, "HF-CG's per-example output Hessian is for one prediction per example"
        if not facts.in_memory_train:
            return False, "HF-CG takes full-training-set gradients and line searches"
        return True, ""
    if method in ("fgn", "sgn"):
        if facts.loss != "cross_entropy":
            return (
                False,
                f"{method.upper()} is a softmax cross-entropy method (here {facts.loss}: no softmax head)",
            )
        if facts.sequence_output:
            return False, (
                f"{method.upper()} needs one softmax over classes per example, logits (batch, C); "
                "a language model predicts a sequence, logits (batch, T, V)"
            )
        return True, ""
    if method == "kfac":
        if facts.recurrent:
            return False, (
                "K-FAC's blocks assume a layer applied once per example; the LSTM applies its gate matrix "
                "at every time step (the FOSI paper omits K-FAC here too)"
            )
        if facts.uncovered:
            names = ", ".join(facts.uncovered[:3]) + (" ..." if len(facts.uncovered) > 3 else "")
            return (
                False,
                f"K-FAC has no Kronecker block for {len(facts.uncovered)} parameter tensors ({names})",
            )
        return True, ""
    if method in ("racs", "alice"):
        if facts.matrix_params == 0:
            return False, f"{method.upper()} preconditions matrix weights; the model has none"
        if method == "racs" and facts.body_matrices == 0:
            return False, (
                "RACS leaves the output head to Adam (the paper's convention, lm_head_in_method=false) "
                "and the model's only matrix is that head: RACS would be Adam here"
            )
        return True, ""
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def facts_of_model(model, loss: str, in_memory_train: bool = True) -> ModelFacts:
    """:class:`ModelFacts` of a built model.

    Args:
        model: The ``nn.Module``.
        loss: Its loss kind.
        in_memory_train: Whether the task's training split is held in memory.

    Returns:
        The facts.
    """
    from torch import nn

    from curvopt.curvature.mlp_gn import mlp_layers

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    plain = mlp_layers(model, params) is not None
    covered: set[int] = set()
    recurrent = False
    for m in model.modules():
        name = type(m).__name__.lower()
        if isinstance(m, (nn.RNNBase, nn.RNNCellBase)) or "lstm" in name or "gru" in name:
            recurrent = True
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)):
            covered.update(id(p) for p in m.parameters(recurse=False))
    uncovered = tuple(n for n, p in params.items() if id(p) not in covered)
    from curvopt.optim.grouping import split_params

    body = sum(p.ndim == 2 for _, p in split_params(model, lm_head_in_method=False).method)
    sequence = any(s in type(model).__name__.lower() for s in ("lm", "lstm", "llama", "causal"))
    return ModelFacts(
        loss=loss,
        plain_mlp=plain,
        sequence_output=sequence or recurrent,
        recurrent=recurrent,
        uncovered=uncovered,
        matrix_params=sum(p.ndim == 2 for p in params.values()),
        body_matrices=body,
        in_memory_train=in_memory_train,
    )


def task_facts(task: Task, profile: str = "quick") -> ModelFacts:
    """Build ``task``'s model from its composed config (no data) and read its facts.

    Args:
        task: The task.
        profile: ``quick`` or ``paper`` (the model is the same; the config is the profile's).

    Returns:
        The facts.
    """
    import torch

    from curvopt.training.build import build_model
    from experiments.runs import compose_config, experiment_config

    cfg = compose_config([f"experiment={experiment_config(task.experiment, profile)}", "logger=none"])
    model, loss = build_model(cfg, torch.float32, torch.device("cpu"))
    streaming = bool(cfg.dataset.get("streaming", False))
    return facts_of_model(model, loss, in_memory_train=not streaming)


def plan(task: Task, facts: ModelFacts, methods: tuple[str, ...] = METHODS) -> dict[str, dict]:
    """Per method: ``{"applies": bool, "reason": str}``."""
    out = {}
    for m in methods:
        ok, why = applicability(m, facts)
        out[m] = {"applies": ok, "reason": why}
    return out
