"""Every method of the repository, importable from one place.

Two kinds of object (see :mod:`curvopt.api` and README "Use it in your own loop"):

* ``torch.optim.Optimizer`` subclasses and factories, for a plain torch loop
  (``loss.backward(); opt.step()``): :class:`FOSI` (and :func:`fosi_adam`,
  :func:`fosi_heavy_ball`, :func:`fosi_gd`), :class:`RACS`, :class:`Alice` (:func:`alice0`), the
  low-rank baselines :func:`galore`, :func:`fira`, :func:`apollo` (official packages, imported
  only when called) and :func:`build_optimizer` (a method on a model's matrices, Adam on the rest);
* :class:`~curvopt.api.Algorithm` implementations over an :class:`~curvopt.objective.Objective`,
  driven by ``step(batch)``: :class:`SHF` (SHF-LSMR), :class:`HFCG`, :class:`FGN`, :class:`SGN`,
  :class:`KFAC`, :class:`FOSIAlgorithm`, and their loop factories ``build_*``.

Names are resolved lazily (PEP 562), so ``import curvopt.optim.racs`` does not import the
curvature solvers and ``from curvopt.optim import RACS`` imports only ``racs``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> submodule of curvopt.optim that defines it
_EXPORTS: dict[str, str] = {
    # SHF-LSMR (Emirahmetoglu & Stewart)
    "SHF": "shf",
    "build_shf": "shf",
    # Martens' Hessian-free with CG
    "HFCG": "hf_cg",
    "build_hf_cg": "hf_cg",
    # FGN and its SGN baseline (Korbit & Zanon)
    "FGN": "fgn",
    "build_fgn": "fgn",
    "SGN": "sgn",
    "build_sgn": "sgn",
    # FOSI (Sivan, Gabel & Schuster)
    "FOSI": "fosi",
    "fosi_adam": "fosi",
    "fosi_heavy_ball": "fosi",
    "fosi_gd": "fosi",
    "make_base_optimizer": "fosi",
    "FOSIAlgorithm": "fosi_adapter",  # the adapter to the training loop
    "build_fosi": "fosi_adapter",
    # K-FAC baseline
    "KFAC": "kfac",
    "build_kfac": "kfac",
    # RACS and Alice
    "MatrixOptimizer": "matrix",
    "RACS": "racs",
    "Alice": "alice",
    "alice0": "alice",
    # GaLore, Fira, APOLLO (official packages, imported when called)
    "galore": "lowrank",
    "fira": "lowrank",
    "apollo": "lowrank",
    # one optimizer for a model: a method on its matrices, Adam on the rest
    "build_optimizer": "grouping",
    "build_grouped": "grouping",
}

__all__ = [
    "Alice",
    "FGN",
    "FOSI",
    "FOSIAlgorithm",
    "HFCG",
    "KFAC",
    "MatrixOptimizer",
    "RACS",
    "SGN",
    "SHF",
    "alice0",
    "apollo",
    "build_fgn",
    "build_fosi",
    "build_grouped",
    "build_hf_cg",
    "build_kfac",
    "build_optimizer",
    "build_sgn",
    "build_shf",
    "fira",
    "fosi_adam",
    "fosi_gd",
    "fosi_heavy_ball",
    "galore",
    "make_base_optimizer",
]  # = sorted(_EXPORTS); tests/test_api.py checks it

if TYPE_CHECKING:
    from curvopt.optim.alice import Alice, alice0
    from curvopt.optim.fgn import FGN, build_fgn
    from curvopt.optim.fosi import FOSI, fosi_adam, fosi_gd, fosi_heavy_ball, make_base_optimizer
    from curvopt.optim.fosi_adapter import FOSIAlgorithm, build_fosi
    from curvopt.optim.grouping import build_grouped, build_optimizer
    from curvopt.optim.hf_cg import HFCG, build_hf_cg
    from curvopt.optim.kfac import KFAC, build_kfac
    from curvopt.optim.lowrank import apollo, fira, galore
    from curvopt.optim.matrix import MatrixOptimizer
    from curvopt.optim.racs import RACS
    from curvopt.optim.sgn import SGN, build_sgn
    from curvopt.optim.shf import SHF, build_shf


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
