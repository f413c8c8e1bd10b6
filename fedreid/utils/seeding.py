"""Seeds derived from names, forked torch RNG, deterministic settings.

Every random choice in a run draws from a generator seeded by
:func:`derive_seed` from the run seed plus a path of names and numbers, e.g.
``derive_seed(seed, "client", round, index, "shuffle")``. Nothing depends on
what ran before, so a resumed run redraws exactly what an uninterrupted run
draws, and no global random state is consumed or leaked.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import numpy as np
import torch

Key = Union[int, str]


def derive_seed(seed: int, *keys: Key) -> int:
    """A 63-bit seed from ``seed`` and a path of keys (strings or non-negative ints)."""
    words: list[int] = [int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF]
    for key in keys:
        if isinstance(key, str):
            words += [1, zlib.crc32(key.encode("utf-8"))]
        else:
            key = int(key)
            if key < 0:
                raise ValueError(f"derive_seed: keys must be non-negative, got {key}")
            words += [0, key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF]
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def numpy_rng(seed: int, *keys: Key) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: Key) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, *keys))
    return gen


@contextmanager
def forked_torch_rng(seed: int, device: Optional[torch.device] = None) -> Iterator[None]:
    """Run the block with torch's global RNG seeded to ``seed``; restore it after.

    Dropout and ``nn.init`` draw from the global generator; forking keeps the
    caller's state untouched so a block's randomness depends on ``seed`` only.
    """
    devices = []
    if device is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index
        devices = [index if index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def set_deterministic(enabled: bool = True) -> None:
    """Deterministic kernels (bit-identical reruns on CPU; on GPU at some speed cost)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


@contextmanager
def deterministic_mode(enabled: bool = True) -> Iterator[None]:
    """:func:`set_deterministic` for the block; the previous settings are restored after."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    set_deterministic(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic = previous[2]
        torch.backends.cudnn.benchmark = previous[3]
