"""FedNova's client with the "cross-client variance reduction" of FedNTD's and FedLMD's official code.

The FedNova paper (Wang et al., NeurIPS 2020, Eq. 7) changes only the
server's averaging (:mod:`fedreid.fl.server_hooks.fednova`): its clients run
plain local SGD (``train.objective: fedavg``). The code the FedLMD paper ran
its FedNova baseline with (Lee-Gihun/FedNTD ``algorithms/fednova/``, the same
files in wnma3mz/FedLMD, ``config/fednova.json``: ``nova_ccvr: true``) also
corrects every local gradient (``ClientTrainer._nova_step``)::

    g <- g + c_i,   c_i = weighted_d - d_i

where ``d_i = (x - y_i) / (eta a_i)`` is the client's normalised update of
the last round it took part in (``Server._clients_training``: ``aidi /
local_a``, ``aidi = (x - y_i) / eta`` with ``eta`` the round's learning rate,
``a_i = ||a_i||_1`` of its heavy-ball steps, :func:`~fedreid.fl.local.base.heavy_ball_steps`), zero
before its first round. The official optimizer has no Nesterov momentum; with
``train.nesterov`` the divisor is the Nesterov ``||a_i||_1``
(:func:`~fedreid.fl.local.base.normalised_steps`), the same the ``fednova`` hook divides by, so
``d_i`` stays the update per unit of gradient. ``weighted_d`` is meant to be the clients'
size-weighted mean of the ``d_i``, but ``Server._update_weighted_d`` is never
called, so it stays zero and the correction is ``-d_i``. This objective does
exactly that: ``train.objective: fednova_ccvr`` with the ``fednova`` server
hook reproduces the official FedNova baseline.

``d_i`` covers the shared trainable parameters
(:func:`~fedreid.fl.local.base.shared_parameters`), persists in
:meth:`state_dict`, and is computed from the round's steps ``K`` and the
last step's learning rate and momentum, as the official code reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar, Mapping, Optional

import torch
from torch import Tensor, nn

from fedreid.fl.local.base import (
    AnchoredObjective,
    ObjectiveError,
    StepRate,
    add_to_gradients,
    cpu_clone,
    normalised_divisors,
    on_parameter,
    register_objective,
    step_rates,
)

#: Key of ``d_i`` in :meth:`FedNovaCCVR.state_dict`.
D_KEY = "d_i"


@register_objective
class FedNovaCCVR(AnchoredObjective):
    """Local SGD on ``g - d_i`` (FedNTD's ``nova_ccvr``, see the module docstring); client state ``d_i``."""

    name = "fednova_ccvr"
    #: The FedNova server hook must aggregate (checked with the config).
    requires_hook: ClassVar[Optional[str]] = "fednova"

    def __init__(self) -> None:
        super().__init__()
        self.d_i: "OrderedDict[str, Tensor]" = OrderedDict()  # CPU, persisted
        self._correction: dict[str, Tensor] = {}
        self._last_rate: dict[str, StepRate] = {}

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        # c_i = weighted_d - d_i with the official weighted_d, which stays zero
        self._correction = OrderedDict(
            (name, on_parameter(p, None if name not in self.d_i else -self.d_i[name], f"fednova_ccvr: d_i of {name}"))
            for name, p in self._params.items()
        )
        self._last_rate = {}

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``g <- g + c_i`` on every shared parameter (one without a gradient gets ``c_i``)."""
        self._check_in_round("before_step")
        add_to_gradients(self._params, self._correction)

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().after_step(model, optimizer)
        self._last_rate = step_rates(optimizer, self._params)

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """``d_i = (x - y_i) / (eta a_i)`` for the client's next round (``Server._clients_training``)."""
        self._check_in_round("end_round")
        if self.steps == 0:
            raise ObjectiveError("fednova_ccvr: end_round() after zero local steps")
        divisors = normalised_divisors(self.steps, self._last_rate)
        new_d: "OrderedDict[str, Tensor]" = OrderedDict()
        for name, p in self._params.items():
            move = self._ref[name] - p.detach()
            new_d[name] = move / divisors[name] if divisors[name] > 0 else torch.zeros_like(move)
        self.d_i = cpu_clone(new_d)
        self._params, self._ref, self._correction, self._last_rate = {}, {}, {}, {}
        return super().end_round(model)

    def state_dict(self) -> dict[str, Any]:
        return {D_KEY: cpu_clone(self.d_i)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {D_KEY}
        if unknown:
            raise ObjectiveError(f"fednova_ccvr: unknown state keys {sorted(unknown)}")
        self.d_i = cpu_clone(state.get(D_KEY, {}))


__all__ = ["D_KEY", "FedNovaCCVR"]
