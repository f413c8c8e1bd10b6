"""Where evaluation runs: the torch device, its CUDA speedups and the FAISS index's placement.

The ``resolve_*`` functions turn ``tools/eval_reid.py``'s ``--device``,
``--amp`` / ``--channels-last`` and ``--faiss-gpu`` options into decisions,
refusing what cannot apply (:class:`~fedreid.eval.errors.EvalInputError`)
instead of running silently slower. The ``onnx`` backend runs on the CPU
without torch (:func:`resolve_backend_device`); the other functions take a
``torch.device`` or a device string such as ``"cpu"``, and only
:func:`resolve_device` imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fedreid.errors import FedReIDError
from fedreid.eval.errors import EvalInputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAISS_GPU_MODES",
    "FaissGpuUnavailableError",
    "faiss_gpu_available",
    "require_faiss_gpu",
    "resolve_backend_device",
    "resolve_device",
    "resolve_speedups",
    "resolve_faiss_gpu",
]

FAISS_GPU_MODES = ("auto", "on", "off")


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU. Raises :class:`EvalInputError` when torch cannot be imported."""
    try:
        import torch
    except ImportError as exc:
        raise EvalInputError(
            f"PyTorch cannot be imported ({exc}); it runs PyTorch models and TorchScript files. Without it, "
            "index, query and serve run an ONNX file with --backend onnx (written by 'tools/eval_reid.py export "
            "--format onnx' where PyTorch is installed)"
        ) from None
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise EvalInputError(f"--device {device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None


def resolve_backend_device(device: str, backend: str) -> Any:
    """The device of feature extraction with ``backend`` (``pytorch``, ``torchscript``, ``onnx``).

    ``onnx``: the string ``"cpu"`` (ONNX Runtime runs the exported file on
    the CPU, and no torch is imported); ``device`` must be ``auto`` or
    ``cpu``, anything else is an :class:`EvalInputError`. Other backends:
    :func:`resolve_device`.
    """
    if backend != "onnx":
        return resolve_device(device)
    if device not in ("auto", "cpu"):
        raise EvalInputError(
            f"--device {device}: --backend onnx runs the exported file on the CPU (ONNX Runtime); "
            "give --device cpu or leave --device out (--faiss-gpu on still puts FAISS on a GPU)"
        )
    return "cpu"


def _device_parts(device: str | torch.device) -> tuple[str, Optional[int]]:
    """``(type, index)`` of a ``torch.device`` or a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``)."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        return kind, int(index) if index.isdigit() else None
    return device.type, device.index


def resolve_speedups(
    device: str | torch.device, amp: Optional[bool] = None, channels_last: Optional[bool] = None
) -> tuple[bool, bool]:
    """``(amp, channels_last)`` for extraction on ``device``; None means on for CUDA, off elsewhere.

    Both only speed up CUDA kernels (:func:`fedreid.eval.features.extract_features`
    ignores them elsewhere), so asking for one explicitly on another device
    is an error rather than a silently slower run.
    """
    on_cuda = _device_parts(device)[0] == "cuda"
    asked = [flag for flag, value in (("--amp", amp), ("--channels-last", channels_last)) if value]
    if asked and not on_cuda:
        raise EvalInputError(
            f"{' and '.join(asked)} only apply on a CUDA device, but the device is {device}: "
            "drop them or use --device cuda"
        )
    return (on_cuda if amp is None else bool(amp)), (on_cuda if channels_last is None else bool(channels_last))


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
    CUDA; ``on``: required (:class:`FaissGpuUnavailableError`
    naming what is missing when it cannot be); ``off``: the CPU index.
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
