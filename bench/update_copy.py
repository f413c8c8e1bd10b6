"""A client's update crossing from the GPU to the host: three ways, on ResNet-50's shared state.

``Client`` hands the server its trained shared state as CPU tensors
(``fedreid.fl.state.host_state``). This times, as the median of repeated
copies of ResNet-50's shared state (325 tensors, about 94 MiB) from a CUDA
device, with each copy freed before the next as a client worker frees its
update once sent:

* ``per tensor``: one ``.cpu()`` a tensor (``clone_state``);
* ``pageable``: one concatenation per dtype, copied to a new pageable buffer;
* ``pinned``: the same into page-locked memory from torch's caching host
  allocator, without blocking, then one synchronisation (``host_state``).

and then rounds of 9 copies held together until the round ends, as the
main process holds a sequential round's updates (round 1 allocates, the
next rounds may reuse). It also checks that the three give the same
tensors. CUDA only.

    python bench/update_copy.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.fl.state import clone_state, host_state  # noqa: E402
from fedreid.models.reid import create_reid_model, shared_state  # noqa: E402


def pageable(state):
    by_dtype: dict = {}
    for key, value in state.items():
        by_dtype.setdefault(value.dtype, []).append(key)
    out = {}
    for keys in by_dtype.values():
        flat = torch.cat([state[k].reshape(-1) for k in keys]).cpu()
        for key, piece in zip(keys, flat.split([state[k].numel() for k in keys])):
            out[key] = piece.view(state[key].shape)
    return OrderedDict((k, out[k]) for k in state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("update_copy: needs a CUDA device")
        return 0
    device = torch.device("cuda")
    model = create_reid_model("resnet50", 751, pretrained=None, seed=0).to(device)
    state = shared_state(model)
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    ways = {"per tensor": clone_state, "pageable": pageable, "pinned": host_state}
    reference = clone_state(state)
    for name, copy in ways.items():
        got = copy(state)
        assert all(torch.equal(got[k], reference[k]) for k in reference), name
    print(f"{torch.cuda.get_device_name(device)}: ResNet-50 shared state, {len(state)} tensors, {mib:.1f} MiB")
    for name, copy in ways.items():
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = copy(state)
            times.append(time.perf_counter() - t0)
            del out
        print(f"  {name:<11} median {statistics.median(times) * 1e3:7.1f} ms   "
              f"({mib / 1024 / statistics.median(times):.1f} GiB/s; runs "
              + ", ".join(f"{t * 1e3:.1f}" for t in times) + ")")
    print("  rounds of 9 updates held together (ms a copy: round 1, then the median of rounds 2-4)")
    for name, copy in ways.items():
        per_round = []
        for _ in range(4):
            held = []
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(9):
                held.append(copy(state))
            per_round.append((time.perf_counter() - t0) / 9)
            del held
        print(f"  {name:<11} {per_round[0] * 1e3:7.1f} ms, then {statistics.median(per_round[1:]) * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
