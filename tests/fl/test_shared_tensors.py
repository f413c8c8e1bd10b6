"""fedreid.fl.shared_tensors: messages whose CPU tensors cross in an anonymous memory file."""

import gc
import multiprocessing
import os
from collections import OrderedDict

import pytest
import torch

from fedreid.fl.shared_tensors import ALIGNMENT, pack, receive, send, shared_memory_available

needs_memfd = pytest.mark.skipif(not shared_memory_available(), reason="memory files are Linux-only")


def memory_files() -> list[str]:
    """This process's open descriptors and mappings of our messages' memory files."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "fedreid-message" in target:
            found.append(f"fd {fd}")
    with open("/proc/self/maps") as maps:
        found += [line.strip() for line in maps if "fedreid-message" in line]
    return found


def sample() -> dict:
    flat = torch.arange(24, dtype=torch.float32)
    return {
        "state": OrderedDict([("conv.weight", torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(0))),
                              ("bn.num_batches_tracked", torch.tensor(7)),
                              ("half", torch.linspace(0, 1, 5, dtype=torch.bfloat16))]),
        "views": [flat[3:9], flat[::4], flat.view(4, 6).t()],  # one storage, three layouts
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 5),
        "param": torch.nn.Parameter(torch.ones(2, 2)),  # rebuilt as a Parameter around its plain data
        "leaf": torch.full((3,), 2.0, requires_grad=True),  # requires grad: pickled in the stream
        "meta": {"round": 3, "loss": 0.25, "name": "client000"},
    }


def assert_same(got: dict, sent: dict) -> None:
    for key, value in sent["state"].items():
        assert got["state"][key].dtype == value.dtype and torch.equal(got["state"][key], value)
    assert list(got["state"]) == list(sent["state"])
    for g, s in zip(got["views"], sent["views"]):
        assert g.shape == s.shape and g.stride() == s.stride() and torch.equal(g, s)
    assert torch.equal(got["mask"], sent["mask"]) and got["empty"].shape == (0, 5)
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    assert torch.equal(got["param"].detach(), sent["param"].detach())
    assert got["leaf"].requires_grad and torch.equal(got["leaf"].detach(), sent["leaf"].detach())
    assert got["meta"] == sent["meta"]


@pytest.mark.parametrize("shared", [True, False])
def test_a_message_arrives_with_equal_values_dtypes_and_layouts(shared):
    a, b = multiprocessing.Pipe(duplex=True)
    sent = sample()
    send(a, sent, shared=shared)
    got = receive(b)
    assert_same(got, sent)
    views = got["views"]
    # the views of one storage share one again, at the sender's offsets
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert [v.storage_offset() for v in views] == [3, 0, 0]


@needs_memfd
def test_tensors_cross_in_one_memory_file_that_leaves_nothing_behind():
    a, b = multiprocessing.Pipe(duplex=True)
    sent = sample()
    message = pack(sent)
    # each storage is a region of the file, the parameter's data included (it is rebuilt as a Parameter)
    assert message.fd is not None and len(message.regions) == 7
    assert all(offset % ALIGNMENT == 0 for offset, _ in message.regions)
    assert message.size == message.regions[-1][0] + message.regions[-1][1]
    message.send(a)
    message.close()
    got = receive(b)
    assert_same(got, sent)
    assert memory_files()  # the receiver's mapping holds the file while its tensors live
    del got
    gc.collect()
    assert memory_files() == []


@needs_memfd
def test_writing_a_received_tensor_reaches_neither_the_sender_nor_another_receiver():
    a1, b1 = multiprocessing.Pipe(duplex=True)
    a2, b2 = multiprocessing.Pipe(duplex=True)
    payload = {"w": torch.zeros(1000)}
    with pack(payload) as message:  # one payload, packed once, sent to two receivers
        message.send(a1)
        message.send(a2)
    first, second = receive(b1), receive(b2)
    first["w"].add_(1)
    assert torch.equal(payload["w"], torch.zeros(1000))
    assert torch.equal(second["w"], torch.zeros(1000)) and torch.equal(first["w"], torch.ones(1000))


def test_a_closed_message_cannot_be_sent():
    a, _ = multiprocessing.Pipe(duplex=True)
    message = pack({"w": torch.ones(3)})
    message.close()
    with pytest.raises(ValueError, match="closed message"):
        message.send(a)


def _echo(conn) -> None:
    got = receive(conn)
    got["w"].mul_(2)
    send(conn, {"w": got["w"], "pid": os.getpid()})


@needs_memfd
def test_a_round_trip_through_a_spawned_process():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_echo, args=(child,))
    proc.start()
    child.close()
    w = torch.arange(300_000, dtype=torch.float32)
    send(parent, {"w": w})
    back = receive(parent)
    proc.join(30)
    assert proc.exitcode == 0 and back["pid"] == proc.pid
    assert torch.equal(back["w"], w * 2) and torch.equal(w, torch.arange(300_000, dtype=torch.float32))


def test_a_message_of_empty_tensors_needs_no_memory_file():
    a, b = multiprocessing.Pipe(duplex=True)
    message = pack({"e": torch.empty(0, 3), "n": 4})
    assert message.fd is None and message.regions == [(0, 0)]
    with message:
        message.send(a)
    got = receive(b)
    assert got["e"].shape == (0, 3) and got["n"] == 4


def test_where_memory_files_are_refused_messages_fall_back_to_torch_save(monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "memfd_create", refuse, raising=False)
    shared_memory_available.cache_clear()
    try:
        assert not shared_memory_available()
        a, b = multiprocessing.Pipe(duplex=True)
        sent = sample()
        message = pack(sent)
        assert message.fd is None and message.regions == []
        with message:
            message.send(a)
        assert_same(receive(b), sent)
    finally:
        shared_memory_available.cache_clear()
