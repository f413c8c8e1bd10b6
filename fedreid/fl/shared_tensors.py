"""Messages between our own processes whose tensors cross in shared memory.

The client pool (:mod:`fedreid.fl.concurrent`) sends every worker the round's
payload (a ResNet-50's shared state is about 100 MB) and gets an update of
the same size back from every client. Written into a pipe, each of those
crossings costs a serialisation, the pipe's bandwidth and a copy on arrival,
and the main process does them one after another. Here a message is a small
pickle stream and one anonymous memory file (``memfd``) holding the bytes of
its CPU tensors' storages: the sender writes each storage once, the file's
descriptor crosses the socket (``SCM_RIGHTS``), and the receiver maps the
file and rebuilds each tensor as a view of its storage's region, with the
same dtype, shape, strides and offset; tensors that shared a storage share
one again, as with :func:`torch.save`. The payload is packed once a round
and its descriptor sent to each worker.

Only plain dense CPU tensors that need no grad travel this way (parameters'
data included); anything else (a CUDA tensor, a quantised or sparse one, a
tensor that requires grad) is pickled in the stream as torch pickles it,
one storage per tensor.

The receiver maps the file copy-on-write, so writing to a received tensor
never reaches the sender's memory or another receiver's. The memory file
has no name and no path: it lives until the last descriptor and mapping of
it are gone, in whichever process, so a crash leaves nothing behind. It is
not under ``/dev/shm``, so that mount's size (64 MB in a default container)
does not bound it; memory does.

Where memory files or descriptor passing do not exist (not Linux, or a
sandbox that refuses ``memfd_create``), or with ``shared=False``, the
message is :func:`torch.save` bytes, tensors included. Either way the
receiver gets equal values. Both ends must be our own
processes: the stream is unpickled in full.
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import pickle
import struct
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Optional

import torch
from torch import Tensor

#: Start of each storage's region in the memory file, in bytes (a cache line; every dtype's alignment).
ALIGNMENT = 64
_HEADER = struct.Struct("<BQQ")  # the stream's format, the memory file's size (0: none follows), its storages
_TORCH_SAVE, _PICKLE = 0, 1
_REGION = struct.Struct("<QQ")  # a storage's offset and bytes in the file


@functools.lru_cache(maxsize=None)
def shared_memory_available() -> bool:
    """Whether this process can carry tensors in memory files (Linux's ``memfd_create``, tried once).

    A kernel without the call, or a sandbox that refuses it, gets the
    :func:`torch.save` messages instead of a failing run.
    """
    if not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")):
        return False
    try:
        os.close(os.memfd_create("fedreid-probe", os.MFD_CLOEXEC))
    except OSError:
        return False
    return True


def _travels_shared(obj: Any) -> bool:
    return (
        type(obj) is Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and not obj.is_quantized
        and not obj.is_conj()
        and not obj.is_neg()
    )


class _Pickler(pickle.Pickler):
    """Pickles tensors as references to regions of one memory file (laid out as they are met)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self.regions: list[tuple[int, int]] = []  # (offset, nbytes) of each storage in the file
        self._index: dict[tuple[int, int], int] = {}
        self.size = 0

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if not _travels_shared(obj):
            return None
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.storages)
            offset = -(-self.size // ALIGNMENT) * ALIGNMENT
            self.storages.append(storage)
            self.regions.append((offset, storage.nbytes()))
            self.size = offset + storage.nbytes()
        return ("tensor", index, obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())


@dataclass
class PackedMessage:
    """A message ready to send, to one or more receivers; :meth:`close` when it has been sent.

    ``stream``: :func:`torch.save` bytes, or a pickle stream whose tensors
    refer to regions of the memory file ``fd`` (None: no tensor travels in
    one); ``size``: the file's bytes; ``regions``: each storage's offset and
    bytes in it.
    """

    stream: bytes
    format: int = _TORCH_SAVE
    fd: Optional[int] = None
    size: int = 0
    regions: list[tuple[int, int]] = field(default_factory=list)
    _closed: bool = field(default=False, repr=False)

    def send(self, conn: Connection) -> None:
        """Send to the process at the other end of ``conn`` (a socket pair, as ``Pipe(duplex=True)``)."""
        if self._closed:
            raise ValueError("a closed message cannot be sent")
        head = _HEADER.pack(self.format, self.size if self.fd is not None else 0, len(self.regions))
        conn.send_bytes(head + b"".join(_REGION.pack(*r) for r in self.regions))
        conn.send_bytes(self.stream)  # on its own: a large stream is neither joined nor sliced
        if self.fd is not None:
            send_handle(conn, self.fd, 0)  # the receiver gets its own descriptor of the same file

    def close(self) -> None:
        """Drop this side's descriptor; receivers keep the file as long as they use it."""
        if not self._closed and self.fd is not None:
            os.close(self.fd)
        self._closed = True

    def __enter__(self) -> "PackedMessage":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pack(obj: Any, *, shared: bool = True) -> PackedMessage:
    """``obj`` as a message; with ``shared`` (and where available) its CPU tensors in one memory file."""
    buffer = io.BytesIO()
    if not (shared and shared_memory_available()):
        torch.save(obj, buffer)
        return PackedMessage(buffer.getvalue())
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    if not pickler.size:  # no tensor bytes (none, or only empty ones): no file
        return PackedMessage(buffer.getvalue(), _PICKLE, regions=pickler.regions)
    fd = os.memfd_create("fedreid-message", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, pickler.size)
        with mmap.mmap(fd, pickler.size, access=mmap.ACCESS_WRITE) as view:
            for storage, (offset, nbytes) in zip(pickler.storages, pickler.regions):
                if nbytes:
                    target = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
                    target.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
                    del target  # the mapping closes only once no tensor exports it
    except BaseException:
        os.close(fd)
        raise
    return PackedMessage(buffer.getvalue(), _PICKLE, fd, pickler.size, pickler.regions)


def send(conn: Connection, obj: Any, *, shared: bool = True) -> None:
    """Pack ``obj``, send it over ``conn``, and drop this side's copy of its memory file."""
    with pack(obj, shared=shared) as message:
        message.send(conn)


class _Unpickler(pickle.Unpickler):
    """Rebuilds each storage once, as a tensor over its own region of the mapping."""

    def __init__(self, file: io.BytesIO, view: Optional[mmap.mmap], regions: list[tuple[int, int]]) -> None:
        super().__init__(file)
        self.view = view
        self.regions = regions
        self._storages: dict[int, Tensor] = {}

    def persistent_load(self, pid: Any) -> Tensor:
        kind, index, dtype, shape, stride, offset = pid
        if kind != "tensor" or not 0 <= index < len(self.regions):
            raise pickle.UnpicklingError(f"a message refers to tensor storage {index!r} it did not bring")
        storage = self._storages.get(index)
        if storage is None:
            start, nbytes = self.regions[index]
            if nbytes and self.view is None:
                raise pickle.UnpicklingError(f"a message's tensor storage {index} arrived without its memory file")
            storage = self._storages[index] = (
                torch.frombuffer(self.view, dtype=torch.uint8, count=nbytes, offset=start)
                if nbytes else torch.empty(0, dtype=torch.uint8)
            )
        return storage.view(dtype).as_strided(shape, stride, offset)


def receive(conn: Connection) -> Any:
    """The next message from ``conn``, its tensors mapped copy-on-write from the sender's memory file."""
    head = conn.recv_bytes()
    form, size, count = _HEADER.unpack_from(head)
    stream = conn.recv_bytes()
    if form == _TORCH_SAVE:  # from our own process over a private pipe, never a file
        return torch.load(io.BytesIO(stream), weights_only=False)
    regions = [_REGION.unpack_from(head, _HEADER.size + i * _REGION.size) for i in range(count)]
    view: Optional[mmap.mmap] = None
    if size:
        fd = recv_handle(conn)
        try:
            view = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
    return _Unpickler(io.BytesIO(stream), view, regions).load()


__all__ = ["ALIGNMENT", "PackedMessage", "pack", "receive", "send", "shared_memory_available"]
