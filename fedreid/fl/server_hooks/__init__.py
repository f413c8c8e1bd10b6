"""Server hooks: the server side of federated methods (see :mod:`fedreid.fl.server_hooks.base`).

Importing this package registers the built-in hooks:

==========  =====================================================  =====================================
name        class                                                  paper
==========  =====================================================  =====================================
kd          :class:`~fedreid.fl.server_hooks.kd.KDHook`            Zhuang et al. 2020 (FedReID), Alg. 2
scaffold    :class:`~fedreid.fl.server_hooks.objectives.ScaffoldHook`  Karimireddy et al. 2020, Alg. 1
feddyn      :class:`~fedreid.fl.server_hooks.objectives.FedDynHook`    Acar et al. 2021, Alg. 1
fedftg      :class:`~fedreid.fl.server_hooks.fedftg.FedFTGHook`    Zhang et al. 2022, Alg. 1-2
fedavgm     :class:`~fedreid.fl.server_hooks.fedavgm.FedAvgMHook`  Hsu, Qi, Brown 2019, Sec. 3
fednova     :class:`~fedreid.fl.server_hooks.fednova.FedNovaHook`  Wang et al. 2020, Sec. 4-5
feddf       :class:`~fedreid.fl.server_hooks.feddf.FedDFHook`      Lin et al. 2020, Alg. 1 (data-free)
fedgen      :class:`~fedreid.fl.server_hooks.fedgen.FedGenHook`    Zhu, Hong, Zhou 2021, Alg. 1
fedcurv     :class:`~fedreid.fl.server_hooks.fedcurv.FedCurvHook`  Shoham et al. 2019 (FedCurv sums)
moon        :class:`~fedreid.fl.server_hooks.moon.MoonHook`        FedNTD's MOON (the initial model)
==========  =====================================================  =====================================

A new hook is one module with a :class:`~fedreid.fl.server_hooks.base.ServerHook`
subclass decorated with ``@register_hook``, imported here.
"""

from __future__ import annotations

from fedreid.fl.server_hooks.base import (
    SERVER_HOOKS,
    AggregationInput,
    HookContext,
    ServerHook,
    hook_class,
    hook_options,
    hook_problem,
    register_hook,
)
from fedreid.fl.server_hooks.fedavgm import FedAvgMHook
from fedreid.fl.server_hooks.fedcurv import FedCurvHook
from fedreid.fl.server_hooks.feddf import FedDFHook
from fedreid.fl.server_hooks.fedftg import FedFTGHook
from fedreid.fl.server_hooks.fedgen import FedGenHook
from fedreid.fl.server_hooks.fednova import FedNovaHook
from fedreid.fl.server_hooks.kd import KDHook
from fedreid.fl.server_hooks.moon import MoonHook
from fedreid.fl.server_hooks.objectives import FedDynHook, ScaffoldHook

__all__ = [
    "SERVER_HOOKS",
    "AggregationInput",
    "FedAvgMHook",
    "FedCurvHook",
    "FedDFHook",
    "FedDynHook",
    "FedFTGHook",
    "FedGenHook",
    "FedNovaHook",
    "HookContext",
    "KDHook",
    "MoonHook",
    "ScaffoldHook",
    "ServerHook",
    "hook_class",
    "hook_options",
    "hook_problem",
    "register_hook",
]
