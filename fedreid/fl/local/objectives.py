"""The client objectives by name, and one constructor.

``build_objective(name, **options)`` builds a fresh objective for one client;
the interface every objective follows is documented in
:mod:`fedreid.fl.local.base`. Each objective declares its options as a
dataclass (``cls.Options``), which ``train.objective_options`` is built into
and checked against (:func:`objective_options`). Methods and their papers:

=============  ======================================================  =========================================
name           class                                                   paper
=============  ======================================================  =========================================
fedavg         :class:`~fedreid.fl.local.base.FedAvg`                  McMahan et al., AISTATS 2017
fedprox        :class:`~fedreid.fl.local.fedprox.FedProx`              Li et al., MLSys 2020
scaffold       :class:`~fedreid.fl.local.scaffold.Scaffold`            Karimireddy et al., ICML 2020
feddyn         :class:`~fedreid.fl.local.feddyn.FedDyn`                Acar et al., ICLR 2021
moon           :class:`~fedreid.fl.local.moon.Moon`                    Li, He, Song, CVPR 2021
fedntd         :class:`~fedreid.fl.local.fedntd.FedNTD`                Lee et al., NeurIPS 2022
fedlmd         :class:`~fedreid.fl.local.fedlmd.FedLMD`                Lu et al., ACM MM 2023
fedlmd_tf      :class:`~fedreid.fl.local.fedlmd.FedLMDTf`              Lu et al., ACM MM 2023
fedgen         :class:`~fedreid.fl.local.fedgen.FedGen`                Zhu, Hong, Zhou, ICML 2021
fedrs          :class:`~fedreid.fl.local.fedrs.FedRS`                  Li & Zhan, KDD 2021
fedcurv        :class:`~fedreid.fl.local.fedcurv.FedCurv`              Shoham et al., NeurIPS-W 2019
fednova_ccvr   :class:`~fedreid.fl.local.fednova_ccvr.FedNovaCCVR`     FedNTD's code (FedNova, Wang et al. 2020)
=============  ======================================================  =========================================

A new objective is one module with a :class:`~fedreid.fl.local.base.LocalObjective`
subclass decorated with :func:`~fedreid.fl.local.base.register_objective`, imported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from fedreid.fl.local.base import OBJECTIVES, FedAvg, LocalObjective, ObjectiveError, register_objective
from fedreid.fl.local.fedcurv import FedCurv
from fedreid.fl.local.feddyn import FedDyn
from fedreid.fl.local.fedgen import FedGen
from fedreid.fl.local.fedlmd import FedLMD, FedLMDTf
from fedreid.fl.local.fednova_ccvr import FedNovaCCVR
from fedreid.fl.local.fedntd import FedNTD
from fedreid.fl.local.fedprox import FedProx
from fedreid.fl.local.fedrs import FedRS
from fedreid.fl.local.moon import Moon
from fedreid.fl.local.scaffold import Scaffold
from fedreid.options import ConfigError, build_options


def objective_class(name: str, *, where: str = "train.objective") -> type[LocalObjective]:
    """The registered objective ``name``; an :class:`~fedreid.registry.UnknownNameError` (a ConfigError) otherwise."""
    return OBJECTIVES.get(name, where=where)


def objective_options(name: str, values: Mapping[str, Any], *, where: str = "train.objective_options") -> Any:
    """The typed options of objective ``name`` built from ``values`` (every key and value checked)."""
    return build_options(objective_class(name).Options, dict(values), where, repr(name))


def build_objective(name: str, *, class_counts: Optional[Sequence[float]] = None, **options: Any) -> LocalObjective:
    """A new objective ``name`` with ``options`` (its ``Options`` fields).

    ``class_counts``: the client's training images per class, for objectives
    with ``needs_class_counts`` (FedLMD); ignored by the others.
    """
    try:
        cls = OBJECTIVES.get(name)
    except ConfigError as exc:
        raise ObjectiveError(str(exc)) from None
    try:
        values = dataclasses.asdict(objective_options(name, options, where=f"client objective {name!r}"))
    except ConfigError as exc:
        raise ObjectiveError(str(exc)) from None
    if cls.needs_class_counts:
        if class_counts is None:
            raise ObjectiveError(f"client objective {name!r} needs the client's class counts")
        return cls(class_counts, **values)  # type: ignore[call-arg]
    return cls(**values)  # type: ignore[call-arg]


#: The built-in objectives, registered by their modules (``@register_objective``).
BUILT_IN = (FedAvg, FedProx, Scaffold, FedDyn, Moon, FedNTD, FedLMD, FedLMDTf, FedGen, FedRS, FedCurv,
            FedNovaCCVR)


__all__ = ["OBJECTIVES", "build_objective", "objective_class", "objective_options", "register_objective"]
