"""``SegmentLoader``: several datasets through one loader, each batched as its own in-order loader would be."""

import os
import pickle

import pytest
import torch
from torch.utils.data import Dataset

from fedreid.data.datasets import SegmentLoader, make_loader


class Numbers(Dataset):
    """Items ``offset + i``, with the process that made them."""

    def __init__(self, offset: int, n: int) -> None:
        self.offset, self.n = offset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"value": self.offset + i, "pid": os.getpid()}


SEGMENTS = {"a": Numbers(0, 5), "b": Numbers(100, 3), "c": Numbers(200, 7)}


def values(loader) -> list[list[int]]:
    return [batch["value"].tolist() for batch in loader]


def own_loader_batches(keys, batch_size: int) -> list[list[int]]:
    """What a fresh in-order loader per segment gives, one segment after the other."""
    return [b for key in keys for b in values(make_loader(SEGMENTS[key], batch_size, shuffle=False, seed=0))]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_segment_is_batched_from_its_own_start_in_the_order_asked(workers):
    loader = SegmentLoader(SEGMENTS, 2, num_workers=workers)
    for keys in (["a", "b", "c"], ["c", "a"], ["b"]):
        batches = values(loader.read(keys))
        assert batches == own_loader_batches(keys, 2)
        # no batch spans two segments: every batch's values share their hundreds
        assert all(len({v // 100 for v in batch}) == 1 for batch in batches)
        assert len(loader.read(keys)) == len(batches)
    assert [loader.size(k) for k in "abc"] == [5, 3, 7]


def test_the_workers_start_once_and_serve_every_pass():
    loader = SegmentLoader(SEGMENTS, 4, num_workers=2)
    first = {pid for batch in loader.read(["a", "b", "c"]) for pid in batch["pid"].tolist()}
    later = {pid for batch in loader.read(["c"]) for pid in batch["pid"].tolist()}
    assert os.getpid() not in first and later <= first
    fresh = SegmentLoader(SEGMENTS, 4, num_workers=2, persistent=False)
    one = {pid for batch in fresh.read(["a"]) for pid in batch["pid"].tolist()}
    two = {pid for batch in fresh.read(["a"]) for pid in batch["pid"].tolist()}
    assert one.isdisjoint(two)  # without persistence each pass starts new workers


def test_an_abandoned_pass_does_not_leak_into_the_next():
    loader = SegmentLoader(SEGMENTS, 2, num_workers=2)
    next(iter(loader.read(["c", "a"])))
    assert values(loader.read(["b"])) == own_loader_batches(["b"], 2)


def test_unknown_segments_are_named():
    with pytest.raises(KeyError, match="'d'"):
        SegmentLoader(SEGMENTS, 2).read(["a", "d"])
    with pytest.raises(ValueError, match="batch_size"):
        SegmentLoader(SEGMENTS, 0)


def test_a_copy_travels_without_the_workers_and_starts_its_own():
    loader = SegmentLoader(SEGMENTS, 3, num_workers=2)
    used = {pid for batch in loader.read(["a"]) for pid in batch["pid"].tolist()}
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._loader is None
    batches = list(copy.read(["a", "b"]))
    assert [b["value"].tolist() for b in batches] == own_loader_batches(["a", "b"], 3)
    assert used.isdisjoint(pid for b in batches for pid in b["pid"].tolist())
    assert torch.is_tensor(batches[0]["value"])
