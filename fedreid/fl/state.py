"""Parameter dicts: shared/private split, weighted averages, byte counts.

A *state* is an ordered ``{name: tensor}`` dict, the same keys as a model's
``state_dict()`` (parameters and buffers). The identity head's keys start with
one of the private prefixes (``classifier.`` in :mod:`fedreid.models.reid`);
everything else is shared, BatchNorm running statistics included.

This module holds the one averaging loop of the project
(:func:`weighted_average`); FedPav, FedAvg, CDW and every BN policy call it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Literal, Mapping, Sequence

import torch
from torch import Tensor

from fedreid.errors import FedReIDError

State = "OrderedDict[str, Tensor]"

#: Buffers of BatchNorm layers (``running_*`` are statistics, the counter is an integer).
BN_STAT_SUFFIXES: tuple[str, ...] = ("running_mean", "running_var")
BN_COUNTER_SUFFIX = "num_batches_tracked"

BNPolicy = Literal["average", "first", "local"]
BN_POLICIES: tuple[str, ...] = ("average", "first", "local")


class StateError(FedReIDError, ValueError):
    """States that cannot be combined (different keys or shapes); names the key."""


def clone_state(state: Mapping[str, Tensor], device: str | torch.device = "cpu") -> "OrderedDict[str, Tensor]":
    """Detached copies on ``device`` (CPU by default), in the same key order."""
    return OrderedDict((k, v.detach().to(device, copy=True)) for k, v in state.items())


def host_state(state: Mapping[str, Tensor]) -> "OrderedDict[str, Tensor]":
    """Detached CPU copies of ``state``, as :func:`clone_state`, in fewer transfers.

    A state that lies on one CUDA device crosses to the host in one copy per
    dtype, because hundreds of small device-to-host copies cost more than
    their bytes (docs/benchmarks.md, section (b)). The copies land in
    page-locked memory from torch's caching host allocator: a fresh pageable
    buffer of a ResNet-50's size is new pages every time, and faulting them
    in cost more than the copy (``bench/update_copy.py``); a pinned block is
    reused once the update that held it is freed. Each copy is then a
    contiguous view into its dtype's buffer, with the same values and shape
    as the tensor it copies. Any other state goes through :func:`clone_state`.
    """
    devices = {v.device for v in state.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return clone_state(state)
    device = next(iter(devices))
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, value in state.items():
        by_dtype.setdefault(value.dtype, []).append(key)
    copies: dict[str, Tensor] = {}
    for keys in by_dtype.values():
        flat = torch.cat([state[k].detach().reshape(-1) for k in keys])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat, non_blocking=True)
        for key, piece in zip(keys, host.split([state[k].numel() for k in keys])):
            copies[key] = piece.view(state[key].shape)
    torch.cuda.current_stream(device).synchronize()  # the non-blocking copies have landed
    return OrderedDict((k, copies[k]) for k in state)


def has_prefix(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p.rstrip(".") or key.startswith(p) for p in prefixes)


def split_state(
    state: Mapping[str, Tensor], private_prefixes: Sequence[str]
) -> tuple["OrderedDict[str, Tensor]", "OrderedDict[str, Tensor]"]:
    """``(shared, private)``: private keys start with one of ``private_prefixes``."""
    shared, private = OrderedDict(), OrderedDict()
    for key, value in state.items():
        (private if has_prefix(key, private_prefixes) else shared)[key] = value
    return shared, private


def is_bn_stat(key: str) -> bool:
    """A BatchNorm running mean/variance buffer."""
    return key.rsplit(".", 1)[-1] in BN_STAT_SUFFIXES


def is_bn_buffer(key: str) -> bool:
    """A BatchNorm running statistic or its ``num_batches_tracked`` counter."""
    return is_bn_stat(key) or key.rsplit(".", 1)[-1] == BN_COUNTER_SUFFIX


def bn_buffers(state: Mapping[str, Tensor]) -> "OrderedDict[str, Tensor]":
    return OrderedDict((k, v) for k, v in state.items() if is_bn_buffer(k))


def state_nbytes(state: Mapping[str, Tensor]) -> int:
    """Bytes of the tensors' data (what a transfer of the state costs, without framing)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """``w_k / sum(w)``; every weight must be finite and >= 0 and the sum > 0."""
    ws = [float(w) for w in weights]
    if not ws:
        raise StateError("no weights to normalise")
    if any(not (w >= 0) or w == float("inf") for w in ws):
        raise StateError(f"aggregation weights must be finite and >= 0, got {ws}")
    total = sum(ws)
    if total <= 0:
        raise StateError(f"aggregation weights sum to {total}; at least one must be positive")
    return [w / total for w in ws]


def weighted_average(
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    bn: BNPolicy = "average",
) -> "OrderedDict[str, Tensor]":
    """The weighted average ``sum_k w_k x_k / sum_k w_k`` of every floating tensor.

    ``bn`` decides BatchNorm running statistics (keys ending in
    ``running_mean``/``running_var``):

    * ``average``: averaged with the same weights as the parameters;
    * ``first``: copied from ``states[0]``. This is what the reference code
      does: ``server.py`` ``aggregate_models`` starts from ``deepcopy`` of the
      first client's model and ``add_model`` then mixes only
      ``named_parameters()``, so every buffer stays the first client's. The
      first client is the first of the round's ``random.sample`` order.
    * ``local``: averaged like ``average`` for the server's own model; the
      clients keep their own statistics when they load it (see
      :class:`fedreid.fl.client.Client`).

    Integer tensors (``num_batches_tracked``) cannot be averaged: they are
    taken from ``states[0]`` under ``first`` (as the reference) and are the
    maximum over clients otherwise. The counter only matters for BatchNorm
    layers built with ``momentum=None``; the ReID model uses the default
    momentum, for which it is bookkeeping.

    The sum is accumulated in float64 in client order and cast back, so the
    result does not depend on how the weights were scaled.
    """
    if bn not in BN_POLICIES:
        raise StateError(f"unknown BatchNorm policy {bn!r}; choose one of {', '.join(BN_POLICIES)}")
    if len(states) != len(weights):
        raise StateError(f"{len(states)} states but {len(weights)} weights")
    ws = normalize_weights(weights)
    first = states[0]
    keys = list(first.keys())
    for i, st in enumerate(states[1:], start=1):
        if list(st.keys()) != keys:
            missing = sorted(set(keys) - set(st))
            extra = sorted(set(st) - set(keys))
            raise StateError(
                f"state {i} has different keys than state 0"
                f"{' (missing ' + ', '.join(missing[:3]) + ')' if missing else ''}"
                f"{' (extra ' + ', '.join(extra[:3]) + ')' if extra else ''}"
            )
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for key in keys:
        ref = first[key]
        for i, st in enumerate(states[1:], start=1):
            if st[key].shape != ref.shape:
                raise StateError(
                    f"{key}: shape {tuple(st[key].shape)} in state {i} differs from "
                    f"{tuple(ref.shape)} in state 0"
                )
        if not torch.is_floating_point(ref):
            if bn == "first":
                out[key] = ref.detach().clone()
            else:
                out[key] = torch.stack([st[key].detach() for st in states]).amax(dim=0).to(ref.dtype)
            continue
        if bn == "first" and is_bn_stat(key):
            out[key] = ref.detach().clone()
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for w, st in zip(ws, states):
            acc.add_(st[key].detach().to(torch.float64), alpha=w)
        out[key] = acc.to(ref.dtype)
    return out


def states_equal(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    """Same keys, shapes, dtypes and values (bit for bit)."""
    if list(a.keys()) != list(b.keys()):
        return False
    return all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
