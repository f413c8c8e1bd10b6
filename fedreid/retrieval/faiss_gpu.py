"""Where the FAISS index runs: ``tools/eval_reid.py``'s ``--faiss-gpu`` option, and the GPU it uses.

:func:`resolve_faiss_gpu` turns ``--faiss-gpu`` into a decision, refusing
what cannot apply (:class:`~fedreid.inference.errors.EvalInputError`,
:class:`FaissGpuUnavailableError`) instead of running silently on the CPU.
The functions take a ``torch.device`` or a device string such as ``"cpu"``
and import no torch. The device of feature extraction:
:mod:`fedreid.inference.devices`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedreid.errors import FedReIDError
from fedreid.inference.devices import _device_parts
from fedreid.inference.errors import EvalInputError

if TYPE_CHECKING:
    import torch

__all__ = ["FAISS_GPU_MODES", "FaissGpuUnavailableError", "faiss_gpu_available", "require_faiss_gpu",
           "resolve_faiss_gpu"]

FAISS_GPU_MODES = ("auto", "on", "off")


class FaissGpuUnavailableError(FedReIDError, RuntimeError):
    """A GPU index was required (``use_gpu=True``) but faiss has no GPU support or sees no GPU."""


def faiss_gpu_available() -> bool:
    """True when this faiss build has GPU support and sees at least one GPU."""
    import faiss

    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def require_faiss_gpu() -> None:
    """Raise :class:`FaissGpuUnavailableError`, saying what is missing, unless a GPU index can be made."""
    import faiss

    if not faiss_gpu_available():
        why = "sees no GPU" if hasattr(faiss, "StandardGpuResources") else "has no GPU support (faiss-cpu)"
        raise FaissGpuUnavailableError(
            f"a GPU faiss index was required but this faiss build {why}; "
            "install the [gpu] extra (faiss-gpu) on a CUDA machine, or use the CPU index"
        )


def resolve_faiss_gpu(mode: str, device: str | torch.device) -> bool:
    """Whether the FAISS index goes to a GPU: ``auto`` / ``on`` / ``off``.

    ``auto``: when faiss has GPU support, sees a GPU and the tool's device is
    CUDA; ``on``: required (:class:`FaissGpuUnavailableError` naming what is
    missing when it cannot be); ``off``: the CPU index.
    """
    if mode not in FAISS_GPU_MODES:
        raise EvalInputError(f"--faiss-gpu {mode!r}: expected one of {', '.join(FAISS_GPU_MODES)}")
    if mode == "off":
        return False
    if mode == "on":
        require_faiss_gpu()
        return True
    return _device_parts(device)[0] == "cuda" and faiss_gpu_available()


def _faiss_gpu_id(device: str | torch.device) -> int:
    kind, index = _device_parts(device)
    return (index or 0) if kind == "cuda" else 0
