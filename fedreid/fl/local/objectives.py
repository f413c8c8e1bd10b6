"""The client objectives by name, and one constructor.

``build_objective(name, **options)`` builds a fresh objective for one client;
the interface every objective follows is documented in
:mod:`fedreid.fl.local.base`. Methods and their papers:

=============  ==============================================  =================================
name           class                                           paper
=============  ==============================================  =================================
fedavg         :class:`~fedreid.fl.local.base.FedAvg`          McMahan et al., AISTATS 2017
fedprox        :class:`~fedreid.fl.local.fedprox.FedProx`      Li et al., MLSys 2020
scaffold       :class:`~fedreid.fl.local.scaffold.Scaffold`    Karimireddy et al., ICML 2020
feddyn         :class:`~fedreid.fl.local.feddyn.FedDyn`        Acar et al., ICLR 2021
moon           :class:`~fedreid.fl.local.moon.Moon`            Li, He, Song, CVPR 2021
fedntd         :class:`~fedreid.fl.local.fedntd.FedNTD`        Lee et al., NeurIPS 2022
fedlmd         :class:`~fedreid.fl.local.fedlmd.FedLMD`        Lu et al., ACM MM 2023
fedlmd_tf      :class:`~fedreid.fl.local.fedlmd.FedLMDTf`      Lu et al., ACM MM 2023
=============  ==============================================  =================================
"""

from __future__ import annotations

from typing import Any

from fedreid.fl.local.base import FedAvg, LocalObjective, ObjectiveError
from fedreid.fl.local.feddyn import FedDyn
from fedreid.fl.local.fedlmd import FedLMD, FedLMDTf
from fedreid.fl.local.fedntd import FedNTD
from fedreid.fl.local.fedprox import FedProx
from fedreid.fl.local.moon import Moon
from fedreid.fl.local.scaffold import Scaffold

#: Objective classes by registry name.
OBJECTIVES: dict[str, type[LocalObjective]] = {
    cls.name: cls for cls in (FedAvg, FedProx, Scaffold, FedDyn, Moon, FedNTD, FedLMD, FedLMDTf)
}


def build_objective(name: str, **options: Any) -> LocalObjective:
    """A new objective ``name`` with ``options`` (its constructor's keyword arguments)."""
    try:
        cls = OBJECTIVES[name]
    except KeyError:
        raise ObjectiveError(f"unknown client objective {name!r}; choose one of {', '.join(OBJECTIVES)}") from None
    try:
        return cls(**options)
    except TypeError as exc:  # a wrong option name: say which method and what it takes
        raise ObjectiveError(f"client objective {name!r}: {exc}") from None


__all__ = ["OBJECTIVES", "build_objective"]
