"""The items of the reproduction report, paper by paper, in the report's order.

Each paper's evaluators (one per figure/table) sit next to that paper's drivers, in
``experiments/<paper>/report.py``: they read run records (shared readers, or the drivers' own
record-reading functions) and compare with the paper numbers beside them (``experiments/*/paper_*.csv``),
with the tolerances of ``experiments/report/tolerances.yaml``. Each raises
:class:`~experiments.report.core.NotRun` when its records are absent. This module only lists them:

* SHF-LSMR: :mod:`experiments.shf.report`;
* FGN: :mod:`experiments.fgn.report`;
* FOSI: :mod:`experiments.fosi_quadratics.report` (quadratics), :mod:`experiments.fosi_tasks.report`
  (the DNN tasks, the overhead);
* RACS/Alice: :mod:`experiments.alice_llm.report` (with Table 3 from
  :mod:`experiments.alice_table3.report`).

The ``experiments`` package must be importable: run the report from the repository root
(``make report``, ``python -m experiments.report``).
"""

from __future__ import annotations

from experiments.alice_llm import report as alice
from experiments.fgn import report as fgn
from experiments.fosi_quadratics import report as fosi_quadratics
from experiments.fosi_tasks import report as fosi_tasks
from experiments.report.core import Item
from experiments.shf import report as shf

PAPERS = {
    "shf": "SHF-LSMR (Emirahmetoglu & Stewart): stochastic Hessian-free with LSMR",
    "fgn": "FGN: fast Gauss-Newton for multiclass cross-entropy",
    "fosi": "FOSI (Sivan, Gabel, Schuster, ICLR 2024)",
    "alice": "RACS / Alice (Gong et al., arXiv 2502.07752)",
}

ITEMS: list[Item] = [
    *shf.ITEMS,
    *fgn.ITEMS,
    *fosi_quadratics.ITEMS,
    *fosi_tasks.ITEMS,
    *alice.ITEMS,
]
