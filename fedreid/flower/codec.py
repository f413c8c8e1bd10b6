"""The project's plain records as Flower ``RecordDict`` contents, and back.

Nothing is pickled on the wire. A value is split into a JSON document and a
flat set of tensors: every tensor inside (nested dicts and lists of them
included, e.g. SCAFFOLD's control variates or KD features) is replaced by a
``{"__tensor__": key}`` placeholder and travels in an ``ArrayRecord`` under
that key (Flower serialises arrays with ``numpy.save``: dtype and shape
survive exactly). The receiving side puts the tensors back.

* the server's request: ``payload`` (the state to train from) and
  ``instructions`` (round, cdw, kd, objective payload, ...);
* the client's reply: an :class:`fedreid.fl.update.Update` (shared state,
  sample count, metadata, ``head_shared``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping

from fedreid.errors import FedReIDError

if TYPE_CHECKING:  # torch loads when a tensor is packed or unpacked: a ClientApp answering a search query
    from torch import Tensor  # never needs it, and importing it costs a second of each query's process start

TENSOR_TAG = "__tensor__"


class CodecError(FedReIDError, ValueError):
    """A message did not hold what this side expected."""


def flatten(value: Any, prefix: str = "") -> tuple[Any, dict[str, Tensor]]:
    """``value`` with its tensors replaced by placeholders, and the tensors by key.

    A tensor's key is its path of mapping keys and list positions joined by
    ``/``, so a mapping key holding ``/`` is refused: ``{"a/b": x}`` and
    ``{"a": {"b": y}}`` would share one.
    """
    from torch import Tensor

    tensors: dict[str, Tensor] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, Tensor):
            tensors[path] = v.detach().cpu().contiguous()
            return {TENSOR_TAG: path}
        if isinstance(v, Mapping):
            for key in v:
                if not isinstance(key, str) or "/" in key:
                    raise CodecError(f"{path or 'value'}: only string keys without '/' can travel, got {key!r}")
            return {k: walk(x, f"{path}/{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}/{i}") for i, x in enumerate(v)]
        if hasattr(v, "item") and getattr(v, "shape", None) == ():  # numpy scalars
            return v.item()
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise CodecError(f"{path or 'value'}: cannot send a {type(v).__name__}")

    return walk(value, prefix), tensors


def unflatten(doc: Any, tensors: Mapping[str, Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    if isinstance(doc, dict):
        if set(doc) == {TENSOR_TAG}:
            key = doc[TENSOR_TAG]
            if not isinstance(key, str) or key not in tensors:
                raise CodecError(f"the message names tensor {key!r} but does not carry it")
            return tensors[key]
        return {k: unflatten(v, tensors) for k, v in doc.items()}
    if isinstance(doc, list):
        return [unflatten(v, tensors) for v in doc]
    return doc


def pack(**parts: Any):
    """A Flower ``RecordDict`` holding each keyword part as a JSON document and an ``ArrayRecord``."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    content = RecordDict()
    for name, value in parts.items():
        doc, tensors = flatten(value, name)
        content[f"{name}.arrays"] = ArrayRecord.from_torch_state_dict(tensors)
        content[f"{name}.json"] = ConfigRecord({"json": json.dumps(doc, allow_nan=True)})
    return content


def unpack(content, name: str) -> Any:
    """The part ``name`` of a :func:`pack`-ed ``RecordDict``.

    The bytes come from another machine: whatever they hold, the result is
    the part's value or a one-line :class:`CodecError` naming the part (and
    the tensor), never another exception (a document nested beyond Python's
    recursion limit, an array torch has no dtype for). Arrays are read by
    Flower's ``Array.numpy`` (``numpy.load`` with ``allow_pickle=False``).
    """
    try:
        text = content[f"{name}.json"]["json"]
        arrays = content[f"{name}.arrays"]
    except KeyError:
        raise CodecError(f"the message has no {name!r} part (has {', '.join(sorted(content.keys()))})") from None
    import torch

    try:
        doc = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"{name}: not a JSON document ({type(exc).__name__})") from None
    tensors = {}
    for key in arrays.keys():
        try:
            tensors[key] = torch.from_numpy(arrays[key].numpy().copy())
        except (TypeError, ValueError, OSError, EOFError) as exc:  # Flower's and numpy's words for bad bytes
            raise CodecError(f"{name}: tensor {key!r} cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        return unflatten(doc, tensors)
    except RecursionError:
        raise CodecError(f"{name}: the document is nested too deeply") from None


def update_to_plain(update) -> dict[str, Any]:
    """An :class:`~fedreid.fl.update.Update` as a plain dict for :func:`pack`."""
    return {
        "client": update.client,
        "state": OrderedDict(update.state),
        "num_samples": int(update.num_samples),
        "metadata": dict(update.metadata),
        "head_shared": bool(update.head_shared),
    }


#: The fields of :func:`update_to_plain`, and the JSON type each must have on arrival.
UPDATE_FIELDS = {"client": str, "state": dict, "num_samples": int, "metadata": dict, "head_shared": bool}


def update_from_plain(value: Any):
    """Rebuild the :class:`~fedreid.fl.update.Update` (its checks run again on this side).

    ``value`` came from another machine: it must hold exactly the fields of
    :func:`update_to_plain`, each of its type (``num_samples`` a whole number,
    not a float or a bool; ``head_shared`` a bool, not a truthy string), or a
    one-line :class:`CodecError` names the field. Nothing is coerced: a
    ``num_samples`` of 2.7 or ``Infinity`` is a malformed update, not a
    FedAvg weight of 2 or a crash of the server.
    """
    from torch import Tensor

    from fedreid.fl.update import Update

    if not isinstance(value, Mapping):
        raise CodecError(f"malformed update: expected a mapping, got a {type(value).__name__}")
    missing = [k for k in UPDATE_FIELDS if k not in value]
    unknown = sorted(str(k) for k in value if k not in UPDATE_FIELDS)
    if missing or unknown:
        raise CodecError("malformed update: " + "; ".join(
            ([f"no {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    for key, kind in UPDATE_FIELDS.items():
        got = value[key]
        if not isinstance(got, kind) or (kind is int and isinstance(got, bool)):
            raise CodecError(f"malformed update: {key}: expected {'a whole number' if kind is int else kind.__name__}, "
                             f"got {type(got).__name__} {got!r:.60}")
    bad = next((k for k, v in value["state"].items() if not isinstance(v, Tensor)), None)
    if bad is not None:
        raise CodecError(f"malformed update: state {bad!r}: expected a tensor, got {type(value['state'][bad]).__name__}")
    try:
        return Update(value["client"], OrderedDict(value["state"]), value["num_samples"], dict(value["metadata"]),
                      head_shared=value["head_shared"])
    except (TypeError, ValueError) as exc:
        raise CodecError(f"malformed update: {exc}") from None


__all__ = ["CodecError", "flatten", "unflatten", "pack", "unpack", "update_to_plain", "update_from_plain"]
