"""Every run's summary records the bytes of the optimizer state it kept (issue 46: the cross-paper
grid compares methods by optimizer-state memory, from the runs' own records)."""

from __future__ import annotations

import pytest
import torch

from curvopt.optim.grouping import optimizer_state_bytes
from tests.training.test_faults import _run


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "hf_cg"])
def test_summary_holds_the_optimizer_state_bytes(tmp_path, optimizer):
    summary = _run(tmp_path, [f"optimizer={optimizer}", "trainer.max_steps=2"])
    state = summary["optimizer_state_bytes"]
    assert isinstance(state, int)
    if optimizer == "sgd":  # plain SGD keeps nothing between steps
        assert state == 0
    else:  # Adam's two moments; HF-CG's CG warm start and preconditioner
        assert state > 0


def test_state_bytes_count_a_bank_once():
    from curvopt.optim import RACS

    params = [torch.nn.Parameter(torch.randn(6, 9)) for _ in range(3)]
    opt = RACS(params, lr=0.02, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    per_matrix = 4 * (9 + 6 + 1)  # s, q, phi in float32
    assert optimizer_state_bytes(opt) == 3 * per_matrix
