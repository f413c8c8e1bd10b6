"""Where the FAISS index runs: ``tools/eval_reid.py``'s ``--faiss-gpu`` option, and the GPU it uses.

:func:`resolve_faiss_gpu` turns ``--faiss-gpu`` into a decision, refusing
what cannot apply (:class:`~fedreid.inference.errors.EvalInputError`,
:class:`~fedreid.eval.retrieval.FaissGpuUnavailableError`) instead of
running silently on the CPU. Both functions take a ``torch.device`` or a
device string such as ``"cpu"`` and import no torch. The device of feature
extraction: :mod:`fedreid.inference.devices`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedreid.inference.devices import _device_parts
from fedreid.inference.errors import EvalInputError

if TYPE_CHECKING:
    import torch

__all__ = ["FAISS_GPU_MODES", "resolve_faiss_gpu"]

FAISS_GPU_MODES = ("auto", "on", "off")


def resolve_faiss_gpu(mode: str, device: str | torch.device) -> bool:
    """Whether the FAISS index goes to a GPU: ``auto`` / ``on`` / ``off``.

    ``auto``: when faiss has GPU support, sees a GPU and the tool's device is
    CUDA; ``on``: required (:class:`~fedreid.eval.retrieval.FaissGpuUnavailableError`
    naming what is missing when it cannot be); ``off``: the CPU index.
    """
    from fedreid.eval import retrieval

    if mode not in FAISS_GPU_MODES:
        raise EvalInputError(f"--faiss-gpu {mode!r}: expected one of {', '.join(FAISS_GPU_MODES)}")
    if mode == "off":
        return False
    if mode == "on":
        retrieval.require_faiss_gpu()
        return True
    return _device_parts(device)[0] == "cuda" and retrieval.faiss_gpu_available()


def _faiss_gpu_id(device: str | torch.device) -> int:
    kind, index = _device_parts(device)
    return (index or 0) if kind == "cuda" else 0
