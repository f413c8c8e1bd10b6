"""Where feature extraction runs: the torch device and its CUDA speedups.

The ``resolve_*`` functions turn ``tools/eval_reid.py``'s ``--device`` and
``--amp`` / ``--channels-last`` options into decisions,
refusing what cannot apply (:class:`~fedreid.inference.errors.EvalInputError`)
instead of running silently slower. The ``onnx`` backend runs on the CPU
without torch (:func:`resolve_backend_device`); the other functions take a
``torch.device`` or a device string such as ``"cpu"``, and only
:func:`resolve_device` imports torch. Where the FAISS index runs
(``--faiss-gpu``): :mod:`fedreid.retrieval.faiss_gpu`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fedreid.inference.errors import EvalInputError

if TYPE_CHECKING:
    import torch

__all__ = ["resolve_backend_device", "resolve_device", "resolve_speedups"]


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU.

    Raises :class:`EvalInputError` when torch cannot be imported, for a name
    that is no device or a device type other than CPU and CUDA, and for a
    CUDA device this machine does not have.
    """
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
        resolved = torch.device(device)
    except RuntimeError:
        raise EvalInputError(f"--device {device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):  # torch knows mps, xpu, meta...: the tools run on neither
        raise EvalInputError(f"--device {device}: the tools extract on the CPU or a CUDA device; expected auto, cpu, "
                             "cuda or cuda:N")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise EvalInputError(f"--device {device}: no CUDA device is available here; give --device cpu or auto")
        if resolved.index is not None and resolved.index >= count:
            raise EvalInputError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return resolved


def resolve_backend_device(device: str, backend: str) -> Any:
    """The device of feature extraction with ``backend`` (``pytorch``, ``torchscript``, ``onnx``).

    ``onnx`` and ``torchscript``: the string ``"cpu"`` (the exported file runs
    on the CPU in float32: ONNX Runtime, or TorchScript's interpreter; no torch
    is imported for ``onnx``); ``device`` must be ``auto`` or ``cpu``, anything
    else is an :class:`EvalInputError`. ``pytorch``: :func:`resolve_device`.
    """
    if backend == "pytorch":
        return resolve_device(device)
    if device not in ("auto", "cpu"):
        raise EvalInputError(
            f"--device {device}: --backend {backend} runs the exported file on the CPU; "
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
    device: str | torch.device, amp: Optional[bool] = None, channels_last: Optional[bool] = None, *,
    backend: str = "pytorch",
) -> tuple[bool, bool]:
    """``(amp, channels_last)`` for extraction on ``device``; None means on for CUDA, off elsewhere.

    Both only speed up CUDA kernels (:func:`fedreid.inference.features.extract_features`
    ignores them elsewhere), so asking for one explicitly on another device
    is an error rather than a silently slower run; so is asking for one with
    an exported file (``backend`` ``onnx`` or ``torchscript``), which runs as
    it was exported, in float32 on the CPU.
    """
    on_cuda = _device_parts(device)[0] == "cuda"
    asked = [flag for flag, value in (("--amp", amp), ("--channels-last", channels_last)) if value]
    if asked and backend != "pytorch":
        raise EvalInputError(f"{' and '.join(asked)}: --backend {backend} runs the exported file in float32 on "
                             "the CPU; drop the flag or use --backend pytorch with the model file")
    if asked and not on_cuda:
        raise EvalInputError(
            f"{' and '.join(asked)} only {'apply' if len(asked) > 1 else 'applies'} on a CUDA device, "
            f"but the device is {device}: drop {'them' if len(asked) > 1 else 'it'} or use --device cuda"
        )
    return (on_cuda if amp is None else bool(amp)), (on_cuda if channels_last is None else bool(channels_last))
