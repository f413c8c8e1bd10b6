"""The server hook interface, its registry, and what a hook is built from.

A server-side method is one :class:`ServerHook` subclass: a registry name,
a typed ``Options`` dataclass (built and checked by
:func:`fedreid.options.from_dict`, documented from its ``#:`` comments) and
any of the methods below, each a no-op by default. The server
(:class:`fedreid.fl.server.Server`) calls them, in the order the hooks were
configured, at these moments of a federated round:

=====================  ==============================================================
``begin_round``        before the clients train, with the state they will receive
``instructions``       what every sampled client is asked to do or send (``{"kd": True}``)
``client_instructions`` keys that replace those of ``instructions`` for some clients,
                       by name, knowing the round's order (FedCurv's official sums)
``required_metadata``  keys every update must carry this round (checked for you)
``check_update``       why one update's metadata is unusable, or None (the client is
                       left out of the round, not the run stopped)
``aggregate``          the new global state from the accepted updates; at most one
                       hook per run implements it (SCAFFOLD, FedDyn, FedAvgM, FedNova),
                       the others get the server's weighted average
``after_aggregate``    may train the global model in place (KD, FedFTG); returns
                       metrics for the round record
``trains_model``       whether this round's ``after_aggregate`` trains the global model
                       (``eval.before_hooks`` evaluates it before them)
``state_dict``         what persists across rounds, checkpointed with the server
=====================  ==============================================================

Registering a hook (``@register_hook``) makes it available to the config as
``fl.hooks: [{name: <name>, <option>: <value>, ...}]``; :meth:`ServerHook.build`
makes one from its options and a :class:`HookContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.update import Update
from fedreid.options import NoOptions, build_options
from fedreid.registry import Registry
from fedreid.utils.precision import FP32, Precision, resolve_precision

if TYPE_CHECKING:
    from fedreid.fl.aggregate import Aggregate


@dataclass
class HookContext:
    """What the federation knows when it builds its hooks.

    ``cfg`` is the run's :class:`~fedreid.config.Config`; ``objective`` the
    client objective's options (FedDyn's server needs the clients' alpha);
    ``public_loader(shuffle, seed)`` a loader over the unlabeled public set
    and ``public_size`` its length (None without one).
    """

    cfg: Any
    num_clients: int
    num_classes: int
    device: torch.device
    seed: int
    image_size: Optional[tuple[int, int]] = None
    image_channels: Optional[int] = None
    objective: Any = None
    public_loader: Optional[Callable[[bool, int], Any]] = None
    public_size: Optional[int] = None


def context_precision(context: HookContext) -> Precision:
    """The run's training arithmetic (``train.precision`` on ``context.device``); fp32 without a config."""
    train = getattr(context.cfg, "train", None)
    if train is None:
        return FP32
    return resolve_precision(train.precision, context.device, channels_last=train.channels_last)


@dataclass
class AggregationInput:
    """What an aggregating hook sees: the round, what the clients received, what they sent back.

    ``parameters``: the trainable parameter names of the global state (a
    server step acts on these; buffers such as BatchNorm statistics take the
    average). ``average()``: the server's own aggregation of ``updates``
    (``fl.weighting`` or CDW weights, then the ``fl.server_lr`` step), computed
    on demand.
    """

    round_index: int
    global_state: Mapping[str, Tensor]
    updates: Sequence[Update]
    parameters: list[str]
    average: Callable[[], "Aggregate"]
    num_clients: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class ServerHook:
    """A server-side method (see the module docstring); every method is a no-op here."""

    #: Registry name (``fl.hooks[].name``; the key of its record and checkpoint entries).
    name: ClassVar[str] = ""
    #: The typed options the config nests under ``fl.hooks[]``.
    Options: ClassVar[type] = NoOptions
    #: Whether the hook needs the unlabeled public set (the clients then get it too).
    needs_public_set: ClassVar[bool] = False
    #: The tasks (``reid``, ``classification``) the hook applies to.
    tasks: ClassVar[tuple[str, ...]] = ("reid", "classification")

    @classmethod
    def context_defaults(cls, context: HookContext) -> dict[str, Any]:
        """Option values taken from the federation (image size, the clients' lr) unless the config sets them."""
        return {}

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "ServerHook":
        """A hook from its ``Options`` and the federation's context; override when it needs the context."""
        return cls(options)  # type: ignore[call-arg]

    def begin_round(self, round_index: int, global_state: Mapping[str, Tensor]) -> None:
        """Before the sampled clients train; ``global_state`` is what they receive."""

    def instructions(self, round_index: int) -> dict[str, Any]:
        """Keys merged into every sampled client's instructions this round (booleans are or-ed)."""
        return {}

    def client_instructions(self, round_index: int, clients: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Keys that replace the round's instructions for some clients: ``{client name: {key: value}}``.

        ``clients``: this round's sampled clients in the order a sequential
        round trains them. Called after :meth:`instructions`.
        """
        return {}

    def required_metadata(self, round_index: int) -> tuple[str, ...]:
        """Metadata keys every update must carry this round; an update without one is left out."""
        return ()

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s metadata is unusable for this hook (wrong shape, negative counts), or None."""
        return None

    def aggregate(self, batch: AggregationInput) -> Optional["Aggregate"]:
        """The round's new global state; None leaves it to the server's weighted average."""
        return None

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        """After the new global state is loaded into ``model``; may train it in place. Returns metrics."""
        return None

    def trains_model(self, round_index: int) -> bool:
        """Whether :meth:`after_aggregate` changes the global model's weights in round ``round_index``."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What persists across rounds (CPU tensors and plain values)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"server hook {self.name!r} keeps no state, the checkpoint has {sorted(state)}")

    @classmethod
    def aggregates(cls) -> bool:
        """Whether this hook class implements :meth:`aggregate`."""
        return cls.aggregate is not ServerHook.aggregate

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def hook_problem(hook: ServerHook, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
    """Why ``update`` cannot be used by ``hook`` (missing required metadata, then ``check_update``), or None.

    The reason is prefixed with the hook's name.
    """
    missing = [key for key in hook.required_metadata(round_index) if key not in update.metadata]
    problem = f"no {missing[0]}" if missing else hook.check_update(round_index, update, model)
    return f"{hook.name}: {problem}" if problem else None


#: Server hook classes by name (``fl.hooks``); the built-ins register when
#: :mod:`fedreid.fl.server_hooks` is imported.
SERVER_HOOKS: Registry[type[ServerHook]] = Registry("server hook", locations=("fedreid.fl.server_hooks",))


def register_hook(cls: type[ServerHook]) -> type[ServerHook]:
    """Class decorator: make ``cls`` available as ``fl.hooks: [{name: cls.name}]``."""
    return SERVER_HOOKS.register(cls)


def hook_class(name: str, *, where: str = "fl.hooks") -> type[ServerHook]:
    """The registered hook ``name``; an :class:`~fedreid.registry.UnknownNameError` (a ConfigError) otherwise."""
    return SERVER_HOOKS.get(name, where=where)


def hook_options(name: str, values: Mapping[str, Any], *, where: str = "fl.hooks") -> Any:
    """The typed options of hook ``name`` from ``values`` (every key and value checked)."""
    return build_options(hook_class(name, where=where).Options, dict(values), where, f"server hook {name!r}")


__all__ = [
    "SERVER_HOOKS",
    "AggregationInput",
    "HookContext",
    "context_precision",
    "ServerHook",
    "hook_class",
    "hook_options",
    "hook_problem",
    "register_hook",
]
