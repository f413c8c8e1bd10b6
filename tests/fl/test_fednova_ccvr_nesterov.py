"""FedNova's CCVR client (FedNTD ``algorithms/fednova``) under Nesterov momentum: ``d_i`` is
divided by the same ``||a_i||_1`` as the ``fednova`` server hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedreid.fl.local.base import normalised_steps
from fedreid.fl.local.objectives import build_objective
from fedreid.fl.server_hooks.fednova import local_norm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_fednova_ccvr_divides_by_the_hooks_norm_under_nesterov():
    # A constant gradient 0.5: d_i = (x - y_i) / (lr ||a_i||_1) must be 0.5 whatever the momentum
    # kind, so the next round's corrected gradient g - d_i is 0 and the model stays put (as the
    # heavy-ball case of FedNTD's algorithms/fednova does).
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor([1.0]))

    tau, lr, rho = 20, 0.01, 0.9
    for nesterov in (False, True):
        assert normalised_steps(tau, rho, nesterov) == local_norm(tau, rho, nesterov)
        m = Scalar()
        obj = build_objective("fednova_ccvr")
        moves = []
        for r in range(2):
            start = m.a.detach().clone()
            obj.begin_round(m, {"a": start.clone()}, round_index=r)
            opt = torch.optim.SGD([m.a], lr=lr, momentum=rho, nesterov=nesterov)
            for _ in range(tau):
                opt.zero_grad()
                (0.5 * m.a).sum().backward()
                obj.before_step(m, opt)
                opt.step()
                obj.after_step(m, opt)
            obj.end_round(m)
            moves.append(float(start - m.a.detach()))
            if r == 0:
                # x - y = lr * 0.5 * ||a_i||_1 with the hook's norm
                assert moves[0] == pytest.approx(lr * 0.5 * local_norm(tau, rho, nesterov), rel=1e-4)
                assert float(obj.d_i["a"]) == pytest.approx(0.5, rel=1e-4), nesterov
        assert moves[1] == pytest.approx(0.0, abs=1e-5), nesterov
