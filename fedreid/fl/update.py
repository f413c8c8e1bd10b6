"""What a client sends back after a round: the :class:`Update`.

The same plain record travels in simulation and over the network: the
client's name, its shared parameters (BatchNorm buffers included), its sample
count and a metadata dict (CDW distance, KD features on the public set, train
loss, timings). It never carries the private identity head; the check lives in
one place, :func:`check_no_private`, and runs whenever an Update is built.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from fedreid.errors import FedReIDError
from fedreid.fl.state import has_prefix, state_nbytes


class PrivateStateError(FedReIDError, ValueError):
    """A private (identity-head) tensor was about to leave its client."""


def private_prefixes() -> tuple[str, ...]:
    """Key prefixes of the private identity head (from :mod:`fedreid.models.reid`)."""
    from fedreid.models.reid import PRIVATE_PREFIXES

    return tuple(PRIVATE_PREFIXES)


def check_no_private(
    state: Mapping[str, Tensor], *, client: str = "?", prefixes: Optional[Sequence[str]] = None
) -> None:
    """Raise :class:`PrivateStateError` if ``state`` holds a private-head key."""
    prefixes = tuple(prefixes) if prefixes is not None else private_prefixes()
    leaked = [k for k in state if has_prefix(k, prefixes)]
    if leaked:
        raise PrivateStateError(
            f"client {client!r}: private identity-head tensors must never leave the client, "
            f"but the update holds {', '.join(leaked[:4])}{' ...' if len(leaked) > 4 else ''}"
        )


@dataclass
class Update:
    """One client's contribution to one round.

    ``state``: shared tensors on CPU. ``num_samples``: the client's training
    images (FedPav weight ``n_k``). ``metadata``: JSON-like values and tensors,
    e.g. ``train_loss``, ``cdw_distance``, ``kd_features`` (``[N_public, d]``).
    ``head_shared`` is set only under ``fl.aggregation=fedavg``, where the whole
    model (head included) is averaged by definition; otherwise a head key in
    ``state`` raises :class:`PrivateStateError`.
    """

    client: str
    state: dict[str, Tensor]
    num_samples: int
    metadata: dict[str, Any] = field(default_factory=dict)
    head_shared: bool = False

    def __post_init__(self) -> None:
        if not self.head_shared:
            check_no_private(self.state, client=self.client)
        if int(self.num_samples) <= 0:
            raise ValueError(f"client {self.client!r}: an update needs num_samples > 0, got {self.num_samples}")
        bad = [k for k, v in self.state.items() if not isinstance(v, Tensor)]
        if bad:
            raise TypeError(f"client {self.client!r}: state values must be tensors ({bad[0]})")

    @property
    def nbytes(self) -> int:
        """Bytes of the shared state (the paper's communication unit)."""
        return state_nbytes(self.state)

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of tensors in the metadata (KD features, SCAFFOLD's control delta, class counts)."""
        return sum(self.metadata_nbytes_by_key().values())

    def metadata_nbytes_by_key(self) -> dict[str, int]:
        """Bytes of the tensors under each metadata key that holds any (scalars travel as JSON, not counted)."""
        return {k: tensor_nbytes(v) for k, v in self.metadata.items() if _holds_tensors(v)}

    def scalars(self) -> dict[str, Any]:
        """The metadata without tensors or tensor dicts (what gets logged)."""
        return {k: v for k, v in self.metadata.items() if not _holds_tensors(v)}


#: Metadata the server computes with (the round record's loss, CDW's weights, FedNova's steps, the
#: timings): each must be a finite real number when present; ``time_*`` keys too.
NUMBER_METADATA = frozenset({"train_loss", "train_acc", "steps", "lr", "cdw_distance", "gpu_peak_bytes"})


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _scalar_problem(value: Any) -> Optional[str]:
    """Why a metadata value's non-tensor leaves cannot go into a round record (JSON), or None.

    Leaves may be None, bools, strings and finite real numbers, in dicts and
    lists; a NaN loss or an object of another kind from a remote client is
    refused here rather than crashing the server's record or plots.
    """
    if isinstance(value, Tensor) or value is None or isinstance(value, (bool, str)):
        return None
    if isinstance(value, numbers.Real):
        return None if math.isfinite(value) else f"is {value}"
    if isinstance(value, (Mapping, list, tuple)):
        return next((p for p in map(_scalar_problem, _children(value)) if p is not None), None)
    return f"holds a {type(value).__name__}"


def check_update(update: Update, reference: Mapping[str, Tensor]) -> Optional[str]:
    """Why ``update`` must not be averaged into ``reference`` (the state it was trained from), or None.

    The shared state must hold exactly the reference's tensors with the same
    shapes and dtypes (an integer tensor where a float one belongs would be
    averaged into garbage, or cast silently), and every floating tensor in the
    state and the metadata (nested dicts and lists included) must be finite:
    one NaN averaged in poisons the global model for every client. The
    metadata's other values must be plain (None, bools, strings, finite
    numbers, in dicts and lists), and those the server computes with
    (:data:`NUMBER_METADATA`, ``time_*``) finite numbers: a remote client's
    ``train_loss`` of ``"abc"`` leaves that client out instead of stopping
    the round. Metadata a server hook needs is checked by that hook
    (``check_update``, see :mod:`fedreid.fl.server_hooks`).
    """
    missing = [k for k in reference if k not in update.state]
    extra = [k for k in update.state if k not in reference]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        return "; ".join(parts)
    for key, ref in reference.items():
        got = update.state[key]
        if tuple(got.shape) != tuple(ref.shape):
            return f"{key} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
        if got.dtype != ref.dtype:
            return f"{key} has dtype {got.dtype}, expected {ref.dtype}"
    bad = _first_non_finite(update.state)
    if bad is not None:
        return f"{bad} holds non-finite values"
    for key, value in update.metadata.items():
        if _holds_tensors(value) and not _all_finite(value):
            return f"metadata {key!r} holds non-finite values"
        problem = _scalar_problem(value)
        if problem is not None:
            return f"metadata {key!r}: {problem}"
        if (key in NUMBER_METADATA or key.startswith("time_")) and not _is_number(value):
            return f"metadata {key!r}: expected a number, got {type(value).__name__} {value!r:.40}"
    return None




def _first_non_finite(state: Mapping[str, Tensor]) -> Optional[str]:
    """The first key whose floating tensor holds a NaN or an infinity, or None; one read of the device."""
    floats = [(k, v) for k, v in state.items() if v.is_floating_point()]
    if not floats:
        return None
    if len({v.device for _, v in floats}) > 1:
        return next((k for k, v in floats if not bool(v.isfinite().all())), None)
    finite = torch.stack([v.isfinite().all() for _, v in floats]).cpu()
    if bool(finite.all()):
        return None
    return next(k for (k, _), ok in zip(floats, finite.tolist()) if not ok)


def _children(value: Any) -> Sequence[Any]:
    """The values inside a dict, list or tuple (the containers the codec carries); else none."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return value
    return ()


def _all_finite(value: Any) -> bool:
    """Every floating tensor in ``value`` (nested dicts and lists too) is finite."""
    if isinstance(value, Tensor):
        return not value.is_floating_point() or bool(value.isfinite().all())
    return all(_all_finite(v) for v in _children(value))


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    return any(_holds_tensors(v) for v in _children(value))


def tensor_nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested dicts and lists of them; other values 0)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    return sum(tensor_nbytes(v) for v in _children(value))


def to_plain(value: Any) -> Any:
    """Numbers/tensors/numpy values as plain Python (for JSON logs)."""
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


__all__ = ["Update", "PrivateStateError", "check_no_private", "check_update", "private_prefixes", "tensor_nbytes",
           "to_plain"]
