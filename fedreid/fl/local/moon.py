"""MOON, model-contrastive federated learning (Li, He, Song, CVPR 2021).

Paper, Section 3.3 (the model-contrastive loss and the local objective): with ``z = R_w(x)`` the local model's representation,
``z_glob`` the received global model's and ``z_prev`` the client's previous
local model's (both frozen)::

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    l     = l_sup(w; (x, y)) + mu * l_con

``sim`` is cosine similarity, ``l_sup`` the cross-entropy; both averaged over
the batch. Defaults ``tau = 0.5`` and ``mu = 5`` are the paper's CIFAR-10
settings (CIFAR-100 and Tiny-ImageNet use ``mu = 1``).

Facts from the official code (``QinbinLi/MOON``, ``main.py``
``train_net_fedcon``), matched here: the term is computed as a cross-entropy
over the logits ``[cos(z, z_glob), cos(z, z_prev_1), ...] / tau`` with target
0 (identical to ``l_con``); the global and previous models are frozen and in
eval mode; with ``model_buffer_size > 1`` every buffered previous model adds
a negative -- :func:`moon_contrastive_loss` accepts several, the objective keeps
one (the paper's setting). The official projection head (``pro1``) is the
representation; here it is ``model.features`` (``embed`` for
:class:`~fedreid.models.reid.ReIDModel`), whichever the model exposes.

Before a client's first round there is no previous local model. The paper does
not say what to use; here the received global model stands in, which makes
``l_con = log 2`` with a gradient that is zero up to the rounding of the
log-softmax (the round is plain FedAvg). MOON's own code (``QinbinLi/MOON``,
``main.py``) has two cases:

* round 0: the pool of previous models is empty (the copy ``old_nets =
  copy.deepcopy(nets)`` made under ``--load_first_net`` is never appended to
  ``old_nets_pool``), so the logits hold the positive column alone and the term
  is exactly 0: the same training, logged as 0 where this one logs ``log 2``;
* a client first sampled in a later round: the pool copies every party's
  network after each round, and an unsampled party's network is still its own
  independent initialisation, which becomes its negative. To reproduce that,
  ``load_state_dict({"prev": initial_state})`` before its first round.

The code base of FedLMD's tables (``Lee-Gihun/FedNTD``,
``algorithms/moon/Server.py:_init_prev_locals``) starts every client's
previous model as the run's initial global model, so a client first sampled
after round 0 has a non-zero contrastive term from its first step. That is the
option ``first_previous: initial``: the ``moon`` server hook
(:class:`fedreid.fl.server_hooks.moon.MoonHook`) keeps the initial global state
and sends it, in the objective payload (:data:`INITIAL_KEY`), to each sampled
client that has not returned an update yet. The default ``global`` needs no
server half. ``FedFTG``'s official MOON (``methods/MOON.py``) gives a client
that has not trained yet no negative at all: a term of 0, the default's
training up to rounding.

The previous model's full ``state_dict`` is client state (persisted): one
model's worth of memory per client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.local.base import (
    LocalObjective,
    ObjectiveError,
    check_choice,
    check_positive,
    cpu_clone,
    frozen_copy,
    register_objective,
    representation,
)


def moon_contrastive_loss(z: Tensor, z_glob: Tensor, z_prevs: Sequence[Tensor], tau: float = 0.5) -> Tensor:
    """``l_con`` (Section 3.3), averaged over the batch; one negative per entry of ``z_prevs``.

    ``= mean_i CE([cos(z_i, zg_i), cos(z_i, zp1_i), ...] / tau, target 0)``.
    """
    if not z_prevs:
        raise ObjectiveError("moon: at least one previous-model representation is needed")
    sims = [F.cosine_similarity(z, z_glob, dim=1)] + [F.cosine_similarity(z, zp, dim=1) for zp in z_prevs]
    logits = torch.stack(sims, dim=1) / tau
    target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return F.cross_entropy(logits, target)


#: The objective payload key of the run's initial global state (``first_previous: initial``).
INITIAL_KEY = "moon_initial"
#: What stands in for a client's previous model before it has trained (module docstring).
FIRST_PREVIOUS = ("global", "initial")


@dataclass
class MoonOptions:
    """Options of ``train.objective: moon``."""

    #: Weight of the model-contrastive term (Li, He, Song 2021, Eq. 3).
    mu: float = 5.0
    #: Temperature of the contrastive term.
    tau: float = 0.5
    #: A client's previous model before it has trained (the paper is silent):
    #: ``global``, the received model (a zero-gradient term); ``initial``, the
    #: run's initial global model, as FedNTD's code (FedLMD's tables) starts every
    #: client (``algorithms/moon/Server.py:_init_prev_locals``), sent by the
    #: ``moon`` server hook.
    first_previous: Literal["global", "initial"] = "global"


@register_objective
class Moon(LocalObjective):
    """``CE + mu * l_con``; client state: the previous local model's ``state_dict``."""

    name = "moon"
    Options: ClassVar[type] = MoonOptions
    needs_features = True

    server_hook: ClassVar[Optional[str]] = "moon"

    def __init__(self, mu: float = 5.0, tau: float = 0.5, first_previous: str = "global") -> None:
        super().__init__()
        self.mu = check_positive("moon mu", mu)
        self.tau = check_positive("moon tau", tau, allow_zero=False)
        self.first_previous = check_choice("moon first_previous", first_previous, FIRST_PREVIOUS)
        self.prev_state: Optional[dict[str, Tensor]] = None  # CPU, persisted
        self._glob: Optional[nn.Module] = None
        self._prev: Optional[nn.Module] = None

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._glob = frozen_copy(model)
        self._prev = frozen_copy(model, self.prev_state) if self.prev_state is not None else None
        if self._prev is None and self.first_previous == "initial":
            initial = (payload or {}).get(INITIAL_KEY)
            if not isinstance(initial, Mapping):
                raise ObjectiveError("moon first_previous=initial: the server sent no initial model "
                                     f"({INITIAL_KEY}) to a client that has not trained yet")
            # The initial global state holds the shared part; a private head stays the client's own.
            self._prev = frozen_copy(model, {**model.state_dict(), **initial})

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        ce = super().loss(model, images, labels, logits, features)
        z = representation(model, images) if features is None else features
        assert self._glob is not None
        with torch.no_grad():
            z_glob = representation(self._glob, images)
            z_prev = z_glob if self._prev is None else representation(self._prev, images)
        con = moon_contrastive_loss(z, z_glob, [z_prev], self.tau)
        self.last_terms["contrastive"] = con.detach()
        return ce + self.mu * con

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """Keep the trained model as next round's previous model."""
        self._check_in_round("end_round")
        self.prev_state = dict(cpu_clone(model.state_dict()))
        self._glob = self._prev = None
        return super().end_round(model)

    def state_dict(self) -> dict[str, Any]:
        return {"prev": None if self.prev_state is None else dict(cpu_clone(self.prev_state))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"prev"}
        if unknown:
            raise ObjectiveError(f"moon: unknown state keys {sorted(unknown)}")
        prev = state.get("prev")
        self.prev_state = None if prev is None else dict(cpu_clone(prev))

    @classmethod
    def uses_server_hook(cls, options: Any) -> bool:
        return getattr(options, "first_previous", "global") == "initial"

    def __repr__(self) -> str:
        return f"Moon(mu={self.mu}, tau={self.tau}, first_previous={self.first_previous!r})"


__all__ = ["FIRST_PREVIOUS", "INITIAL_KEY", "Moon", "MoonOptions", "moon_contrastive_loss"]
