"""Client objectives: the interface, FedAvg's plain cross-entropy, and shared pieces.

Every federated method's *client side* is one small object. It owns the
client's persistent method state (SCAFFOLD's ``c_i``, FedDyn's gradient
term, MOON's previous local model) and nothing else: no data, no optimizer,
no global randomness. A training loop drives it like this::

    from fedreid.fl.local.objectives import build_objective

    obj = build_objective("fedprox", mu=0.01)          # one object per client
    obj.load_state_dict(saved)                         # its state from the last checkpoint, if any

    # each round, after the received shared state (and the client's own
    # private head) has been loaded into ``model``:
    obj.begin_round(model, global_state, round_index=r, payload=server_payload)
    for images, labels in loader:
        if obj.needs_features:                         # MOON: one forward gives both
            features = representation(model, images)
            logits = model.classifier(features)
        else:
            features, logits = None, model(images)
        loss = obj.loss(model, images, labels, logits, features)
        optimizer.zero_grad()
        loss.backward()
        obj.before_step(model, optimizer)              # SCAFFOLD: g <- g - c_i + c
        optimizer.step()
        obj.after_step(model, optimizer)               # counts steps (and, for SCAFFOLD, learning rates)
    if obj.wants_training_pass:                        # FedCurv's official Fisher: a fresh, seeded pass
        metadata = obj.end_round(model, training_batches=make_training_pass)
    else:
        metadata = obj.end_round(model)                # updates the client state; goes into Update.metadata
    saved = obj.state_dict()                           # checkpoint it with the client

Contract of the arguments:

* ``model``: ``model(x)`` returns logits, ``model.features(x)`` the
  penultimate representation (:func:`representation` also accepts
  :class:`~fedreid.models.reid.ReIDModel`'s ``embed``), and
  ``model.classifier`` is the last Linear, so
  ``model.classifier(model.features(x)) == model(x)``.
* ``global_state``: the shared tensors the server sent, ``{name: tensor}``
  with the model's ``state_dict`` names. It is the reference point
  ``w_global`` / ``theta^{t-1}`` / ``x`` of FedProx, FedDyn and SCAFFOLD.
  The *method parameters* are the model's trainable parameters whose names are
  in ``global_state`` (:func:`shared_parameters`): buffers (BatchNorm
  statistics) are not parameters, and the private identity head is not in the
  global state, so neither gets a proximal term, a control variate or a
  FedDyn term -- there is no global value for them.
* ``round_index``: 0-based, as ``Server.instructions()["round"]``; only
  FedLMD's Tf -> teacher switch reads it.
* ``payload``: method-specific tensors from the server (SCAFFOLD's server
  control variate under ``"control"``); ``None`` when the method needs none.
* Teachers (FedNTD, FedLMD, MOON's global model) are frozen copies of
  ``model`` taken in :meth:`LocalObjective.begin_round`, i.e. the received
  global state plus the client's own private head, in eval mode (BatchNorm
  uses running statistics, dropout is off: teacher outputs are deterministic
  and draw no random numbers).

:meth:`LocalObjective.loss` returns the full loss of one batch (the mean
cross-entropy plus the method's terms) and leaves the detached terms in
``last_terms`` for logging.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.errors import FedReIDError
from fedreid.options import NoOptions
from fedreid.registry import Registry

TensorDict = "OrderedDict[str, Tensor]"

#: Key of the round's instructions under which the server sends method tensors
#: to every client's objective (``begin_round(payload=...)``; SCAFFOLD's ``c``).
OBJECTIVE_PAYLOAD = "objective_payload"


class ObjectiveError(FedReIDError, ValueError):
    """A client objective is misconfigured or driven out of order; the message says which."""


# ---------------------------------------------------------------------------
# Small helpers shared by the methods
# ---------------------------------------------------------------------------


def check_positive(name: str, value: float, *, allow_zero: bool = True) -> float:
    """``value`` as float; raises :class:`ObjectiveError` when negative (or zero if not allowed)."""
    v = float(value)
    if not (v > 0 or (allow_zero and v == 0)):
        raise ObjectiveError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ObjectiveError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
    return value


#: How the server halves of SCAFFOLD and FedDyn weigh the client models in their mean:
#: ``uniform`` (``1 / |S|``, both papers' Algorithm 1) or ``size`` (``n_k / n``, FedNTD's and
#: FedLMD's official ``BaseServer._aggregation`` and ``feddyn/Server.py:_aggregation``).
SERVER_WEIGHTINGS: tuple[str, ...] = ("uniform", "size")


def mean_weights(weights: Optional[Sequence[float]], count: int, what: str) -> list[float]:
    """``weights`` (one non-negative number per client, positive sum) as floats; None means ``[1.0] * count``."""
    if weights is None:
        return [1.0] * count
    values = [float(w) for w in weights]
    if len(values) != count:
        raise ObjectiveError(f"{what}: {len(values)} weights for {count} clients")
    if any(not (w >= 0.0 and w < float("inf")) for w in values) or sum(values) <= 0.0:
        raise ObjectiveError(f"{what}: weights must be finite, non-negative and sum to > 0, got {values}")
    return values


def representation(model: nn.Module, x: Tensor) -> Tensor:
    """The penultimate representation: ``model.features(x)``, else ``model.embed(x)`` (ReIDModel)."""
    for attr in ("features", "embed"):
        fn = getattr(model, attr, None)
        if callable(fn):
            return fn(x)
    raise ObjectiveError(
        f"{type(model).__name__} has neither features() nor embed(); MOON needs the penultimate representation"
    )


def shared_parameters(model: nn.Module, global_state: Mapping[str, Tensor]) -> "OrderedDict[str, nn.Parameter]":
    """The trainable parameters of ``model`` whose names are keys of ``global_state``, in model order.

    Shapes must agree; keys of ``global_state`` that are buffers are skipped
    (they are not optimised).
    """
    out: "OrderedDict[str, nn.Parameter]" = OrderedDict()
    for name, p in model.named_parameters():
        if not p.requires_grad or name not in global_state:
            continue
        if tuple(global_state[name].shape) != tuple(p.shape):
            raise ObjectiveError(
                f"{name}: global shape {tuple(global_state[name].shape)} differs from the model's {tuple(p.shape)}"
            )
        out[name] = p
    return out


def reference_point(
    params: Mapping[str, nn.Parameter], global_state: Mapping[str, Tensor]
) -> "OrderedDict[str, Tensor]":
    """Detached copies of ``global_state[name]`` on each parameter's device and dtype."""
    return OrderedDict(
        (n, global_state[n].detach().to(device=p.device, dtype=p.dtype, copy=True)) for n, p in params.items()
    )


def on_parameter(p: Tensor, value: Optional[Tensor], what: str) -> Tensor:
    """Stored per-parameter state as a detached copy on ``p``'s device and dtype; zeros when ``value`` is None.

    Another shape than ``p``'s is an :class:`ObjectiveError` naming ``what``
    (e.g. ``"scaffold: client control body.weight"``).
    """
    if value is None:
        return torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
    if tuple(value.shape) != tuple(p.shape):
        raise ObjectiveError(f"{what} has shape {tuple(value.shape)}, parameter has {tuple(p.shape)}")
    return value.detach().to(device=p.device, dtype=p.dtype, copy=True)


def add_to_gradients(params: Mapping[str, Tensor], correction: Mapping[str, Tensor]) -> None:
    """``p.grad += correction[name]`` for every parameter; one without a gradient gets the correction itself."""
    with torch.no_grad():
        for name, p in params.items():
            if p.grad is None:
                p.grad = correction[name].clone()
            else:
                p.grad.add_(correction[name])


def param_groups_by_id(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """``id(parameter) -> its param group`` (learning rate, momentum, weight decay)."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


#: A parameter's step settings now: ``(lr, momentum, nesterov)``.
StepRate = tuple[float, float, bool]


def step_rates(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> dict[str, StepRate]:
    """``name -> (lr, momentum, nesterov)`` of each parameter's group now; ``(0.0, 0.0, False)`` outside the optimizer."""
    groups = param_groups_by_id(optimizer)
    rates = {}
    for name, p in params.items():
        group = groups.get(id(p))
        rates[name] = (0.0, 0.0, False) if group is None else (
            float(group["lr"]), float(group.get("momentum", 0.0) or 0.0), bool(group.get("nesterov", False)))
    return rates


def heavy_ball_divisors(steps: int, rates: Mapping[str, StepRate]) -> dict[str, float]:
    """``name -> lr * heavy_ball_steps(steps, momentum)``: what ``K`` heavy-ball steps at ``rates`` move per unit gradient.

    The Nesterov flag is not read (FedNTD's SCAFFOLD ``__get_divisor``); :func:`normalised_divisors` reads it.
    """
    return {name: lr * heavy_ball_steps(steps, momentum) for name, (lr, momentum, _) in rates.items()}


def normalised_divisors(steps: int, rates: Mapping[str, StepRate]) -> dict[str, float]:
    """``name -> lr * normalised_steps(steps, momentum, nesterov)``: FedNova's ``eta ||a_i||_1`` per parameter."""
    return {name: lr * normalised_steps(steps, momentum, nesterov) for name, (lr, momentum, nesterov) in rates.items()}


def cpu_clone(tensors: Mapping[str, Tensor]) -> "OrderedDict[str, Tensor]":
    return OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in tensors.items())


def frozen_copy(model: nn.Module, state: Optional[Mapping[str, Tensor]] = None) -> nn.Module:
    """A deep copy of ``model`` (optionally loaded with ``state``), eval mode, no gradients.

    Used for teachers and MOON's previous model; eval mode makes their outputs
    deterministic (no dropout draws, BatchNorm running statistics).
    """
    twin = copy.deepcopy(model)
    if state is not None:
        twin.load_state_dict(dict(state), strict=True)
    for p in twin.parameters():
        p.requires_grad_(False)
        p.grad = None
    return twin.eval()


def masked_softmax(logits: Tensor, keep: Tensor) -> Tensor:
    """Softmax of each row over the entries where ``keep`` is True; 0 elsewhere.

    A row with no kept entry gives all zeros (not NaN): "no distribution", so
    a KL term against it is 0.
    """
    x = logits.masked_fill(~keep, float("-inf"))
    x = x.masked_fill(~keep.any(dim=1, keepdim=True), 0.0)  # empty rows: finite input, zeroed below
    return torch.softmax(x, dim=1) * keep


def masked_log_softmax(logits: Tensor, keep: Tensor) -> Tensor:
    """Log-softmax of each row over the kept entries; ``-inf`` at the dropped ones.

    Exact masking: the dropped entries are removed from the normaliser, which
    is what "softmax over the logits with class c removed" means.
    """
    x = logits.masked_fill(~keep, float("-inf"))
    x = x.masked_fill(~keep.any(dim=1, keepdim=True), 0.0)
    return torch.log_softmax(x, dim=1)


def kl_teacher_student(p_teacher: Tensor, log_q_student: Tensor, support: Optional[Tensor] = None) -> Tensor:
    """Per-row ``KL(p_teacher || q_student) = sum_c p_c (log p_c - log q_c)``, shape ``[B]``.

    The direction of knowledge distillation (Hinton et al. 2015): the teacher
    distribution weights the log-ratio. It equals
    ``F.kl_div(log_q_student, p_teacher, reduction="none").sum(1)``
    (``kl_div`` takes the student's *log*-probabilities first and the teacher's
    probabilities second). The sum runs over ``support`` (default
    ``p_teacher > 0``; ``0 log 0 = 0``), so entries the student masked out
    (``log q = -inf``) with zero teacher mass never produce ``0 * inf``.
    """
    if support is None:
        support = p_teacher > 0
    p = p_teacher.masked_fill(~support, 0.0)
    log_q = log_q_student.masked_fill(~support, 0.0)
    log_p = torch.log(p.masked_fill(~support | (p <= 0), 1.0))  # log 1 = 0 where p is 0
    return (p * (log_p - log_q)).sum(dim=1)


def heavy_ball_steps(steps: int, momentum: float) -> float:
    """``(K - mu (1 - mu^K) / (1 - mu)) / (1 - mu)``: how many steps' worth heavy-ball SGD moves in ``K`` steps.

    With momentum ``mu``, a buffer starting at zero and a constant rate, the
    gradient of step ``j`` (1-based) moves the parameters by
    ``(1 - mu^(K-j+1)) / (1 - mu)`` steps in all, and these sum to this;
    ``K`` at ``mu = 0``. FedNova's ``||a_i||_1`` (Wang et al. 2020, Sec. 5)
    and the SCAFFOLD divisor of FedNTD's code. ``0 <= momentum < 1``.
    """
    rho = float(momentum)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"momentum must satisfy 0 <= momentum < 1, got {momentum!r}")
    if rho == 0.0:
        return float(steps)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


def normalised_steps(steps: int, momentum: float = 0.0, nesterov: bool = False) -> float:
    """FedNova's ``||a_i||_1`` of ``steps`` SGD steps (Wang et al. 2020, Sec. 5; ``0 <= momentum < 1``).

    Heavy-ball momentum: :func:`heavy_ball_steps` (``steps`` at
    ``momentum = 0``). Nesterov (PyTorch's ``SGD(nesterov=True)``, step ``g_k + rho v_k``):
    each gradient also counts once at its own step, ``steps + momentum * heavy_ball_steps``.
    The divisor of :class:`~fedreid.fl.local.fednova_ccvr.FedNovaCCVR` and of the ``fednova``
    server hook (:func:`fedreid.fl.server_hooks.fednova.local_norm`).
    """
    heavy_ball = heavy_ball_steps(steps, momentum)
    return steps + float(momentum) * heavy_ball if nesterov and momentum > 0 else heavy_ball


def one_hot_mask(labels: Tensor, num_classes: int) -> Tensor:
    """Boolean ``[B, C]`` mask, True at each sample's true class."""
    # F.one_hot itself rejects labels outside [0, num_classes)
    return F.one_hot(labels.reshape(-1).long(), num_classes).bool()


# ---------------------------------------------------------------------------
# The interface, with FedAvg's behaviour
# ---------------------------------------------------------------------------


class LocalObjective:
    """FedAvg's client (McMahan et al. 2017, Algorithm 1 ``ClientUpdate``): mean cross-entropy only.

    The base class of every method (see the module docstring for the call
    order). Subclasses override the hooks they need; each hook is cheap when
    unused.
    """

    #: Registry name (``fl.local`` config value).
    name: ClassVar[str] = "fedavg"
    #: Whether :meth:`loss` wants the local model's penultimate ``features`` (MOON).
    needs_features: ClassVar[bool] = False
    #: The typed options ``train.objective_options`` is built into (:func:`fedreid.options.from_dict`).
    Options: ClassVar[type] = NoOptions
    #: Whether the constructor takes the client's per-class training counts first (FedLMD, FedRS).
    needs_class_counts: ClassVar[bool] = False
    #: The registered server hook that is this method's server half (SCAFFOLD, FedDyn), if any;
    #: the run configures it when :meth:`uses_server_hook` says so.
    server_hook: ClassVar[Optional[str]] = None
    #: A server hook the run must configure itself for this client to make sense (FedNova's CCVR client).
    requires_hook: ClassVar[Optional[str]] = None
    #: Whether :meth:`end_round` wants a fresh pass over the client's training data: the client then
    #: calls ``end_round(model, training_batches=...)`` with a callable that returns a seeded, augmented
    #: pass of ``(images, labels)`` on the model's device, under a seeded dropout generator
    #: (FedCurv's official Fisher).
    wants_training_pass: bool = False

    @classmethod
    def uses_server_hook(cls, options: Any) -> bool:
        """Whether a run with these typed ``Options`` needs :attr:`server_hook` (MOON only with some)."""
        return cls.server_hook is not None

    def __init__(self) -> None:
        self.round_index: int = 0
        self.steps: int = 0
        self.last_terms: dict[str, Tensor] = {}
        self._in_round = False

    # -- round ---------------------------------------------------------------
    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Snapshot what the method needs from the received model (call after loading it)."""
        self.round_index = int(round_index)
        self.steps = 0
        self.last_terms = {}
        self._in_round = True

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        """Full loss of one batch: ``CE(logits, labels)`` (mean over the batch) + method terms."""
        self._check_in_round("loss")
        ce = F.cross_entropy(logits, labels.long())
        self.last_terms = {"ce": ce.detach()}
        return ce

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Between ``loss.backward()`` and ``optimizer.step()`` (gradient corrections)."""

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``; counts local steps."""
        self.steps += 1

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """Update the client state from the trained ``model``; return metadata for the Update."""
        self._check_in_round("end_round")
        self._in_round = False
        return {}

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The client's persistent method state (CPU tensors; ``torch.save``-able)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ObjectiveError(f"{self.name} keeps no client state, got keys {sorted(state)}")

    # -- internals -------------------------------------------------------------
    def _check_in_round(self, what: str) -> None:
        if not self._in_round:
            raise ObjectiveError(f"{self.name}: {what}() called outside a round; call begin_round() first")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class AnchoredObjective(LocalObjective):
    """An objective measured against where the round started: FedProx, FedDyn, SCAFFOLD, FedCurv.

    :meth:`begin_round` keeps the model's shared trainable parameters
    (``_params``, :func:`shared_parameters`: trained in place, read by the
    loss and the step hooks) and, with ``keeps_reference``, detached copies
    of the received global values on their devices (``_ref``,
    :func:`reference_point`). A subclass that needs more calls
    ``super().begin_round(...)`` first.
    """

    #: Keep ``_ref`` (FedCurv's penalty reads other clients' points, not the received one).
    keeps_reference: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._params: dict[str, nn.Parameter] = {}
        self._ref: dict[str, Tensor] = {}

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._params = shared_parameters(model, global_state)
        self._ref = reference_point(self._params, global_state) if self.keeps_reference else {}


FedAvg = LocalObjective

#: Objective classes by name (``train.objective``); the built-ins register when
#: :mod:`fedreid.fl.local.objectives` is imported.
OBJECTIVES: Registry[type[LocalObjective]] = Registry("client objective", locations=("fedreid.fl.local.objectives",))


def register_objective(cls: type[LocalObjective]) -> type[LocalObjective]:
    """Class decorator: make ``cls`` available as ``train.objective: <cls.name>``."""
    return OBJECTIVES.register(cls)


register_objective(FedAvg)


__all__ = [
    "AnchoredObjective",
    "OBJECTIVES",
    "OBJECTIVE_PAYLOAD",
    "SERVER_WEIGHTINGS",
    "FedAvg",
    "LocalObjective",
    "ObjectiveError",
    "check_choice",
    "check_positive",
    "cpu_clone",
    "add_to_gradients",
    "frozen_copy",
    "heavy_ball_divisors",
    "heavy_ball_steps",
    "kl_teacher_student",
    "masked_log_softmax",
    "masked_softmax",
    "mean_weights",
    "on_parameter",
    "one_hot_mask",
    "normalised_divisors",
    "normalised_steps",
    "param_groups_by_id",
    "reference_point",
    "register_objective",
    "representation",
    "shared_parameters",
    "StepRate",
    "step_rates",
]
