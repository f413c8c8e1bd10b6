"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

Client, Algorithm 1 (lines 8-13), control-variate update **option II**:

* each local step: ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)`` -- the stochastic
  gradient is corrected by ``c - c_i`` before the optimizer step
  (:meth:`Scaffold.before_step`);
* after ``K`` steps: ``c_i+ = c_i - c + (x - y_i) / (K eta_l)`` (Algorithm 1,
  line 12, option II), ``Delta c_i = c_i+ - c_i`` goes to the server with
  ``Delta y_i = y_i - x``, and the client keeps ``c_i <- c_i+`` (persisted in
  :meth:`state_dict`).

How ``c_i+`` is computed: ``control_variate`` (a named option)

* ``"gradient_mean"`` (default): the value option II stands for, computed so
  that it stays right under momentum. With plain SGD every step moves
  ``y`` by ``-eta_k (g_k + c - c_i)``, so ``x - y_i = sum_k eta_k (g_k + c - c_i)``
  and ``(x - y_i) / sum_k eta_k = mean_eta(g_k) + c - c_i``: option II's
  ``c_i+`` *is* the (learning-rate weighted) mean of the client's uncorrected
  local gradients ``g_k``, which is how the paper presents option II (it
  re-uses the gradients already computed during the local steps, where
  option I computes a fresh gradient at ``x``). Here that mean is accumulated during
  training (:meth:`Scaffold.before_step` reads ``p.grad`` before the
  correction; ``g_k`` includes the L2 term ``wd * y_k`` that
  ``torch.optim.SGD(weight_decay=wd)`` adds to the gradient, because the step
  moves ``y`` by it too). Under plain SGD both options agree to float rounding.
* ``"displacement"``: the literal formula ``c_i - c + (x - y_i) / (K eta_l)``,
  as most public implementations compute it. With SGD momentum ``mu`` each
  step displaces ``y`` by about ``eta / (1 - mu)`` times the corrected
  gradient once the momentum buffer has built up (Nesterov too), so this
  ``c_i+`` comes out up to ``1 / (1 - mu)`` too large (10x at ``mu = 0.9``;
  with a constant gradient 0.5, 50 steps at lr 0.01: 0.500 at ``mu = 0`` but
  4.105 at ``mu = 0.9``, 8.2x) -- the control variates no longer estimate
  gradients and the correction ``c - c_i`` over-steers.

* ``"adaptive_division"``: the displacement form divided by the effective
  number of heavy-ball steps instead of ``K``: ``c_i - c + (x - y_i) /
  (K' eta_l)`` with ``K' = (K - mu (1 - mu^K) / (1 - mu)) / (1 - mu)``
  (:func:`~fedreid.fl.local.base.heavy_ball_steps`), ``eta_l`` the round's last learning rate and
  ``mu`` the optimizer's momentum. This is the official code of FedNTD and
  FedLMD (Lee-Gihun/FedNTD ``algorithms/scaffold/ClientTrainer.py:__get_divisor``
  with ``adaptive_divison: true``, their ``config/scaffold.json``). Under
  heavy-ball momentum from a zero buffer at a constant rate, step ``j`` of
  ``K`` moves ``y`` by ``eta (1 - mu^(K-j+1)) / (1 - mu)`` times its
  corrected gradient in all, so this ``c_i+`` is the momentum-weighted mean
  of the uncorrected gradients (the first step weighs ~10x the last at
  ``mu = 0.9``), where ``gradient_mean`` weighs every step alike. With
  ``mu = 0`` it is ``displacement``.

``K eta_l`` (``gradient_mean`` and ``displacement``) is the sum of the learning rates the steps actually
used, per parameter (read from the optimizer's param groups): with one
constant rate it is exactly ``K eta_l``; with backbone/head groups at
different rates, or a schedule, each parameter gets its own sum, and the
gradient mean is weighted by the same rates (the plain mean for a constant
rate), which keeps the two options equal under plain SGD.

Server (Algorithm 1, lines 16-17), as pure functions here:
``x <- x + eta_g * mean_S(Delta y_i)`` (:func:`scaffold_server_model_update`) and
``c <- c + |S|/N * mean_S(Delta c_i)`` (:func:`scaffold_server_control_update`).
The mean of the models is the paper's plain one by default; ``server_weighting:
size`` weighs client ``i`` by ``n_i / n`` instead, as the official code of FedNTD
and FedLMD does (Lee-Gihun/FedNTD ``algorithms/scaffold/Server.py:run`` averages
the uploaded models with ``BaseServer._aggregation``, which weighs by
``client_sizes``; no global step size). The control variate ``c`` stays the plain
mean there too (``torch.stack(updated_c_amounts).mean(dim=0)``).

The reference point ``x`` of the displacement form: ``reference`` (a named option)

* ``"received"`` (default): the model the client received, as Algorithm 1
  has it (``x`` is what the server sent).
* ``"average"``: the server's average of the previous round *before* any
  after-aggregation step changed it. This is what the official FedFTG code
  does when SCAFFOLD runs with FedFTG (ZhangLin-PKU/FedFTG,
  ``methods/SCAFFOLDGAN.py``, ``train_SCAFFOLDGAN``): the clients start from
  the fine-tuned model ``avg_model_ft``, but ``new_c`` is computed against
  ``prev_params``, the parameters of ``avg_model``, the average before
  fine-tuning. The server sends that average with ``c``
  (:class:`~fedreid.fl.server_hooks.objectives.ScaffoldHook`). In the first
  round, and whenever no step changed the average, the two agree. The
  gradient mean does not use ``x``, so this option needs ``displacement``.

Conventions (documented choices, not in the paper):

* ``x``, ``c``, ``c_i`` cover the shared trainable parameters
  (:func:`~fedreid.fl.local.base.shared_parameters`); ``c`` and ``c_i`` start
  at zero (Algorithm 1 takes the initial ``c``, ``c_i`` as inputs; zero is the
  usual choice).
* A parameter that received no gradient this step (unused in the forward)
  still gets the correction ``c - c_i`` as its gradient, as the update rule
  prescribes; its own gradient counts as 0 in the mean.
* The mean covers only the steps between ``begin_round`` and ``end_round``;
  nothing of it is persisted (a resumed round restarts from ``begin_round``).

No official code was released by the authors; the widely used re-implementation
in the FedDyn repository (``alpemreacar/FedDyn``, ``utils_methods.py``
``train_SCAFFOLD``) scales ``c`` and ``Delta c`` by client size weights and
divides by the *initial* learning rate; those are not reproduced.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.errors import ConfigError
from fedreid.fl.local.base import (
    SERVER_WEIGHTINGS,
    AnchoredObjective,
    ObjectiveError,
    StepRate,
    add_to_gradients,
    check_choice,
    cpu_clone,
    heavy_ball_divisors,
    mean_weights,
    on_parameter,
    param_groups_by_id,
    register_objective,
    step_rates,
)
from fedreid.fl.state import weighted_average

#: Key of the server control variate in the round payload.
CONTROL_KEY = "control"
#: Key of ``Delta c_i`` in the metadata returned by :meth:`Scaffold.end_round`.
DELTA_C_KEY = "scaffold_delta_c"
#: Ways to compute option II's ``c_i+`` (see the module docstring).
CONTROL_VARIATES: tuple[str, ...] = ("gradient_mean", "displacement", "adaptive_division")
#: Key of the server's pre-fine-tuning average in the round payload (``reference="average"``).
AVERAGE_KEY = "average"
#: Reference points ``x`` of the displacement form (see the module docstring).
REFERENCES: tuple[str, ...] = ("received", "average")


def option_ii_control(
    c_i: Mapping[str, Tensor],
    c: Mapping[str, Tensor],
    x: Mapping[str, Tensor],
    y: Mapping[str, Tensor],
    lr_sum: Mapping[str, float],
) -> "OrderedDict[str, Tensor]":
    """``c_i+ = c_i - c + (x - y) / (K eta_l)`` per name (option II), ``K eta_l`` = ``lr_sum[name]``.

    A parameter that never moved under a positive rate (``lr_sum == 0``) gets
    ``c_i - c`` (its step term is 0/0; no information).
    """
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name in x:
        base = c_i[name] - c[name]
        denom = float(lr_sum[name])
        out[name] = base + (x[name] - y[name]) / denom if denom > 0 else base
    return out


def option_ii_gradient_mean(
    grad_sum: Mapping[str, Tensor],
    lr_sum: Mapping[str, float],
    plain_sum: Mapping[str, Tensor],
    steps: int,
) -> "OrderedDict[str, Tensor]":
    """``c_i+ = sum_k eta_k g_k / sum_k eta_k`` per name: option II's value under plain SGD.

    ``grad_sum[name]`` is ``sum_k eta_k g_k`` (uncorrected gradients, weight
    decay included), ``lr_sum[name]`` is ``sum_k eta_k``. Under plain SGD this
    equals :func:`option_ii_control`'s ``c_i - c + (x - y) / sum_k eta_k``
    exactly (see the module docstring). A parameter that never stepped under
    a positive rate (``lr_sum == 0``) gets the unweighted mean
    ``plain_sum[name] / steps``.
    """
    if steps < 1:
        raise ObjectiveError("scaffold: the gradient mean needs K >= 1 local steps")
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name, total in grad_sum.items():
        denom = float(lr_sum[name])
        out[name] = total / denom if denom > 0 else plain_sum[name] / steps
    return out


def scaffold_server_control_update(
    c: Optional[Mapping[str, Tensor]],
    delta_cs: Sequence[Mapping[str, Tensor]],
    num_clients: int,
) -> "OrderedDict[str, Tensor]":
    """``c + |S|/N * mean_S(Delta c_i)`` (Algorithm 1, line 17); ``c=None`` means zeros.

    ``delta_cs``: the sampled clients' ``Delta c_i`` (``|S|`` of them);
    ``num_clients``: ``N``, all clients of the federation.
    """
    if not delta_cs:
        raise ObjectiveError("scaffold: no client control deltas to aggregate")
    n = int(num_clients)
    if n < len(delta_cs):
        raise ObjectiveError(f"scaffold: num_clients={n} is smaller than the {len(delta_cs)} deltas received")
    mean = weighted_average(delta_cs, [1.0] * len(delta_cs))
    frac = len(delta_cs) / n
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name, d in mean.items():
        prev = c[name].to(d) if c is not None and name in c else torch.zeros_like(d)
        out[name] = prev + frac * d
    return out


def scaffold_server_model_update(
    x: Mapping[str, Tensor],
    delta_ys: Sequence[Mapping[str, Tensor]],
    global_lr: float = 1.0,
    weights: Optional[Sequence[float]] = None,
) -> "OrderedDict[str, Tensor]":
    """``x + eta_g * mean_S(Delta y_i)`` (Algorithm 1, line 17) over the names of ``delta_ys``.

    ``weights``: one per client, normalised here; None is the paper's plain
    mean. ``n_k`` gives FedNTD's official size-weighted average (with
    ``eta_g = 1`` it is ``sum_i n_i y_i / n``).
    """
    if not delta_ys:
        raise ObjectiveError("scaffold: no client model deltas to aggregate")
    mean = weighted_average(delta_ys, mean_weights(weights, len(delta_ys), "scaffold server mean"))
    return OrderedDict((name, x[name].to(d) + float(global_lr) * d) for name, d in mean.items())


@dataclass
class ScaffoldOptions:
    """Options of ``train.objective: scaffold`` (the server step size is ``fl.server_lr``)."""

    #: How option II's ``c_i+`` (Karimireddy et al. 2020, Alg. 1 line 12) is computed:
    #: ``gradient_mean`` (the learning-rate-weighted mean of the local gradients, the
    #: value option II stands for), ``displacement`` (its literal ``(x - y_i) / (K eta_l)`` form)
    #: or ``adaptive_division`` (divided by the effective heavy-ball steps, FedNTD's and FedLMD's
    #: official code, ``adaptive_divison: true``).
    control_variate: Literal["gradient_mean", "displacement", "adaptive_division"] = "gradient_mean"
    #: The ``x`` of the displacement forms: ``received`` (the model the client received,
    #: Algorithm 1) or ``average`` (the server's average before FedFTG's fine-tuning, as
    #: ZhangLin-PKU/FedFTG methods/SCAFFOLDGAN.py computes it; needs a displacement form).
    reference: Literal["received", "average"] = "received"
    #: The server's mean of the client models (``x + eta_g sum_i p_i (y_i - x)``):
    #: ``uniform`` (``p_i = 1/|S|``, Algorithm 1 line 17) or ``size`` (``p_i = n_i / n``,
    #: FedNTD's and FedLMD's official ``BaseServer._aggregation``). ``c`` is the plain mean either way.
    server_weighting: Literal["uniform", "size"] = "uniform"

    def validate(self, prefix: str) -> None:
        problem = _reference_problem(self.control_variate, self.reference)
        if problem:
            raise ConfigError(f"{prefix}.reference: {problem}")


def _reference_problem(control_variate: str, reference: str) -> Optional[str]:
    """Why ``reference`` cannot go with ``control_variate``, or None (each value alone is checked where it is read)."""
    if reference == "average" and control_variate == "gradient_mean":
        return ("'average' applies to control_variate=displacement or adaptive_division (the gradient mean "
                "does not use the reference point); set both")
    return None


@register_objective
class Scaffold(AnchoredObjective):
    """SCAFFOLD client with option II control variates; client state ``c_i``.

    ``control_variate``: how option II's ``c_i+`` (Algorithm 1, line 12) is
    computed -- ``"gradient_mean"`` (default; the mean of the uncorrected local
    gradients, which option II's formula equals under plain SGD and which
    stays right under momentum), ``"displacement"`` (the literal
    ``c_i - c + (x - y_i) / (K eta_l)``, mis-scaled by ``~1/(1 - momentum)``
    under SGD momentum) or ``"adaptive_division"`` (FedNTD's official
    divisor, a momentum-weighted gradient mean). See the module docstring.
    """

    name = "scaffold"
    Options: ClassVar[type] = ScaffoldOptions
    server_hook: ClassVar[Optional[str]] = "scaffold"

    def __init__(self, control_variate: str = "gradient_mean", reference: str = "received",
                 server_weighting: str = "uniform") -> None:
        super().__init__()
        #: read by the server half (:class:`~fedreid.fl.server_hooks.objectives.ScaffoldHook`), not here
        self.server_weighting = check_choice("scaffold server_weighting", server_weighting, SERVER_WEIGHTINGS)
        self.control_variate = check_choice("scaffold control_variate", control_variate, CONTROL_VARIATES)
        reference = check_choice("scaffold reference", reference, REFERENCES)
        problem = _reference_problem(self.control_variate, reference)
        if problem:
            raise ObjectiveError(f"scaffold reference: {problem}")
        self.reference = reference
        self.c_i: "OrderedDict[str, Tensor]" = OrderedDict()  # CPU, persisted
        self._c: dict[str, Tensor] = {}
        self._ci: dict[str, Tensor] = {}
        self._correction: dict[str, Tensor] = {}
        self._lr_sum: dict[str, float] = {}
        self._grad_sum: dict[str, Tensor] = {}  # sum_k eta_k g_k ("gradient_mean")
        self._plain_sum: dict[str, Tensor] = {}  # sum_k g_k (parameters outside the optimizer)
        self._last_rate: dict[str, StepRate] = {}  # the last step's rates ("adaptive_division")

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        server_c = (payload or {}).get(CONTROL_KEY)
        average = (payload or {}).get(AVERAGE_KEY)
        if self.reference == "average" and average:
            # option II's x: the server's average before fine-tuning, not the model received
            missing = [n for n in self._params if n not in average]
            if missing:
                raise ObjectiveError(f"scaffold: the server's average has no {missing[0]}")
            self._ref = OrderedDict(
                (n, on_parameter(p, average[n], f"scaffold: server average {n}")) for n, p in self._params.items())
        self._c = OrderedDict()
        self._ci = OrderedDict()
        for name, p in self._params.items():
            self._c[name] = on_parameter(p, server_c.get(name) if server_c else None, f"scaffold: server control {name}")
            self._ci[name] = on_parameter(p, self.c_i.get(name), f"scaffold: client control {name}")
        # g - c_i + c: the correction is the same every step of the round
        self._correction = OrderedDict((n, self._c[n] - self._ci[n]) for n in self._params)
        self._lr_sum = {n: 0.0 for n in self._params}
        if self.control_variate == "gradient_mean":
            self._grad_sum = OrderedDict((n, torch.zeros_like(c)) for n, c in self._c.items())
            self._plain_sum = OrderedDict((n, torch.zeros_like(c)) for n, c in self._c.items())
        else:
            self._grad_sum, self._plain_sum = {}, {}

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``g <- g - c_i + c`` on every method parameter (unused ones get ``c - c_i``).

        With ``control_variate="gradient_mean"`` it first adds this step's
        uncorrected gradient ``g_k + wd * y_k`` (``wd``: the parameter's
        optimizer weight decay, ``y_k``: its value before the step), weighted
        by the step's learning rate, to the round's sums.
        """
        self._check_in_round("before_step")
        if self.control_variate == "gradient_mean":
            self._accumulate_gradients(optimizer)
        add_to_gradients(self._params, self._correction)

    def _accumulate_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Add this step's uncorrected ``g_k + wd * y_k``, and it times the step's rate, to the round's sums."""
        groups = param_groups_by_id(optimizer)
        with torch.no_grad():
            for name, p in self._params.items():
                group = groups.get(id(p))
                lr = float(group["lr"]) if group is not None else 0.0
                wd = float(group.get("weight_decay", 0.0) or 0.0) if group is not None else 0.0
                g = p.grad.detach() if p.grad is not None else None
                if wd:
                    g = p.detach() * wd if g is None else g + p.detach() * wd
                if g is not None:
                    self._plain_sum[name].add_(g)
                    if lr:
                        self._grad_sum[name].add_(g, alpha=lr)

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Count the step and add each parameter's current learning rate to its ``K eta_l`` sum."""
        super().after_step(model, optimizer)
        rates = step_rates(optimizer, self._params)
        for name, (lr, _, _) in rates.items():
            self._lr_sum[name] += lr
        if self.control_variate == "adaptive_division":
            self._last_rate = rates

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """``c_i+`` (option II), ``c_i <- c_i+``; returns ``{"scaffold_delta_c": Delta c_i}`` (CPU)."""
        self._check_in_round("end_round")
        if self.steps == 0:
            raise ObjectiveError("scaffold: end_round() after zero local steps; option II needs K >= 1")
        y = OrderedDict((n, p.detach()) for n, p in self._params.items())
        if self.control_variate == "gradient_mean":
            new_ci = option_ii_gradient_mean(self._grad_sum, self._lr_sum, self._plain_sum, self.steps)
        elif self.control_variate == "adaptive_division":
            # K' eta_l with the last step's rate and momentum, as the official __get_divisor reads them
            new_ci = option_ii_control(self._ci, self._c, self._ref, y,
                                       heavy_ball_divisors(self.steps, self._last_rate))
        else:
            new_ci = option_ii_control(self._ci, self._c, self._ref, y, self._lr_sum)
        delta = OrderedDict((n, new_ci[n] - self._ci[n]) for n in new_ci)
        self.c_i = cpu_clone(new_ci)
        self._params, self._ref, self._c, self._ci, self._correction = {}, {}, {}, {}, {}
        self._grad_sum, self._plain_sum, self._last_rate = {}, {}, {}
        meta = super().end_round(model)
        meta[DELTA_C_KEY] = cpu_clone(delta)
        return meta

    def state_dict(self) -> dict[str, Any]:
        return {"c_i": cpu_clone(self.c_i)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"c_i"}
        if unknown:
            raise ObjectiveError(f"scaffold: unknown state keys {sorted(unknown)}")
        self.c_i = cpu_clone(state.get("c_i", {}))


__all__ = [
    "AVERAGE_KEY",
    "CONTROL_KEY",
    "CONTROL_VARIATES",
    "DELTA_C_KEY",
    "REFERENCES",
    "Scaffold",
    "option_ii_control",
    "option_ii_gradient_mean",
    "scaffold_server_control_update",
    "scaffold_server_model_update",
]
