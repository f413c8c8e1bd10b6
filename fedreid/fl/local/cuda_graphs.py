"""Local training's backbone replayed as a CUDA graph (``train.cuda_graphs``).

At the paper's batch of 32, a ResNet-50 training step on a large GPU is bound
by the host launching its kernels (about a thousand), not by the kernels.
A CUDA graph records the backbone's forward and backward once and then replays
each with one launch. This is PyTorch's "partial-network capture"
(:func:`torch.cuda.make_graphed_callables`). The bottleneck, the identity head,
the loss and the optimizer step stay eager: the head changes shape from client
to client, and the learning rate from epoch to epoch.

The contract:

* Only a call of ``model.backbone`` in train mode, with gradients on and a
  CUDA batch of the captured shape, layout, dtype and autocast state, replays
  the graph. Every other call (a partial batch, eval mode, ``no_grad``) runs
  the backbone's own forward.
* Capturing runs the backbone's forward and backward four times on a copy of
  the first full batch (three warm-up passes, then the capture). It restores
  every buffer afterwards (BatchNorm's running statistics and batch count) and
  leaves ``.grad`` alone (``torch.autograd.grad``), so capturing changes no
  number of the run.
* A backbone keeps its graph, and every call, client and round reuses it as
  long as its parameters and buffers are the same tensors. This holds because
  ``load_state_dict`` copies in place. If they are not the same tensors, the
  graph is captured again. Copies and pickles of the model carry no graph.
* The graph replays the kernels that the eager backbone launches, so a step's
  numbers match the eager step's (tested on CUDA in
  ``tests/fl/test_cuda_graphs.py``). A backbone with dropout would draw its
  masks from the graph's own RNG offsets, not from eager dropout's.
* A step must run the backbone once before its backward, as every
  objective here does: a second replay would overwrite the first one's
  outputs and saved activations.
* CUDA only. On other devices, and for models without a ``backbone``,
  training runs eagerly as if the option were off.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from fedreid.errors import FedReIDError

_SLOT = "_cuda_graph_slot"


class CudaGraphError(FedReIDError, RuntimeError):
    """Capturing the backbone as a CUDA graph failed; the message says what to do."""


class _Slot:
    """Holds a backbone's captured graph. Copies and pickles of the model get an empty slot."""

    def __init__(self) -> None:
        self.graph: Optional[_BackboneGraph] = None
        self.captures = 0

    def __deepcopy__(self, memo: dict) -> "_Slot":
        return _Slot()

    def __reduce__(self) -> tuple:
        return (_Slot, ())


class _Call(nn.Module):
    """``backbone``'s own forward as a module whose parameters are the backbone's.

    It calls the class's forward, not ``backbone(x)``, because that instance
    attribute is the graphed forward while training runs.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Tensor) -> Tensor:
        return type(self.backbone).forward(self.backbone, x)


def _tensors_key(module: nn.Module) -> tuple:
    """Which tensors a captured graph reads and writes (their addresses), and which parameters train."""
    return (tuple((p.data_ptr(), p.requires_grad) for p in module.parameters()),
            tuple(b.data_ptr() for b in module.buffers()))


def _input_key(x: Tensor) -> tuple:
    autocast = torch.is_autocast_enabled("cuda")
    return (tuple(x.shape), x.stride(), x.dtype, x.device, autocast,
            torch.get_autocast_dtype("cuda") if autocast else None)


class _BackboneGraph:
    """One backbone's graphed forward+backward for one input shape (see the module docstring)."""

    def __init__(self, backbone: nn.Module, sample: Tensor) -> None:
        self.tensors = _tensors_key(backbone)
        self.input = _input_key(sample)
        saved = [b.detach().clone() for b in backbone.buffers()]
        autocast = self.input[4]
        dtype = self.input[5] or torch.bfloat16
        static = sample.detach().clone()  # clone keeps the layout (channels-last)
        try:
            # make_graphed_callables refuses autocast's weight cache; a nested context without it
            with torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False):
                self.call: Callable[[Tensor], Any] = torch.cuda.make_graphed_callables(
                    _Call(backbone), (static,), allow_unused_input=True)
        except Exception as exc:  # noqa: BLE001 - any capture failure gets the same way out
            raise CudaGraphError(
                f"train.cuda_graphs: capturing {type(backbone).__name__} as a CUDA graph failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "set train.cuda_graphs=false"
            ) from exc
        finally:
            torch.cuda.synchronize(sample.device)
            with torch.no_grad():
                for buffer, value in zip(backbone.buffers(), saved):
                    buffer.copy_(value)


def graph_captures(backbone: nn.Module) -> int:
    """How many graphs were captured for ``backbone`` (this object, not its copies); for tests and benches."""
    slot = backbone.__dict__.get(_SLOT)
    return 0 if slot is None else slot.captures


@contextlib.contextmanager
def graphed_backbone(model: nn.Module, batch_size: int, enabled: bool) -> Iterator[None]:
    """Within the block, full batches through ``model.backbone`` replay its CUDA graph.

    ``batch_size`` is the size of a full batch. A graph is captured for the
    first full batch of the block, unless the backbone already holds one for
    the same tensors and input. ``enabled`` false, a model without
    ``backbone``, or a backbone off CUDA: the block changes nothing.
    """
    backbone = getattr(model, "backbone", None)
    on_cuda = backbone is not None and any(p.is_cuda for p in backbone.parameters())
    hooked = backbone is not None and bool(
        backbone._forward_hooks or backbone._forward_pre_hooks or backbone._backward_hooks)
    if not enabled or not on_cuda or hooked or "forward" in backbone.__dict__:
        yield
        return
    slot = backbone.__dict__.get(_SLOT)
    if slot is None:
        slot = _Slot()
        object.__setattr__(backbone, _SLOT, slot)
    if slot.graph is not None and slot.graph.tensors != _tensors_key(backbone):
        slot.graph = None  # the backbone's tensors were replaced: the old graph would read stale memory
    eager = type(backbone).forward.__get__(backbone)

    def forward(x: Tensor) -> Any:
        if not (backbone.training and torch.is_grad_enabled() and x.is_cuda and x.shape[0] == batch_size):
            return eager(x)
        if slot.graph is None or slot.graph.input != _input_key(x):
            slot.graph = None  # its memory pool goes before the next capture takes one
            slot.graph = _BackboneGraph(backbone, x)
            slot.captures += 1
        return slot.graph.call(x)

    object.__setattr__(backbone, "forward", forward)
    try:
        with warnings.catch_warnings():
            # The parameters' gradient accumulators are made during the capture, on its side stream
            # (they must be: accumulators on the current stream make the capture fail), so every
            # backward joins the two streams and PyTorch warns about it each time. The figures in
            # docs/benchmarks.md include that join.
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            yield
    finally:
        del backbone.__dict__["forward"]
