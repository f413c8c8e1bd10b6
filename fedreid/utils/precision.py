"""Training arithmetic: autocast dtype, gradient scaling, memory layout (``train.precision``).

One :class:`Precision` per run, resolved from the config and the device by
:func:`resolve_precision`, is what every training path consults (local
training, CDW, KD teachers and student, the server's generators and
distillation)::

    precision = resolve_precision("auto", device)          # bf16 on a recent CUDA card, fp32 elsewhere
    model = precision.prepare_model(model)                # channels-last on CUDA
    scaler = precision.grad_scaler()                      # fp16 only; None otherwise
    with precision.autocast():
        loss = criterion(model(precision.prepare_input(x)), y)
    precision.backward(loss, scaler)
    precision.step(optimizer, scaler)

What stays fp32 whatever the setting: parameters and optimizer state
(autocast only changes the dtype of the operations inside it), hence the
aggregation, checkpoints and every value read off a model for the server
(the CDW distance and KD features are cast to fp32 before use).

``fp32`` runs no autocast and touches no layout, so its numbers are exactly
those of code that never heard of this module. ``bf16`` also runs on the
CPU (slowly), which is how CPU tests cover the mixed-precision path.
``fp16`` needs CUDA: its gradients are scaled (:class:`torch.amp.GradScaler`)
and unscaled before anything reads them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Iterator, Mapping, Optional

import torch
from torch import nn

from fedreid.errors import FedReIDError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(FedReIDError, ValueError):
    """``train.precision`` or ``eval.precision`` cannot run on this device; the message names which and why."""


@dataclass(frozen=True)
class Precision:
    """The arithmetic of a run's training steps (see the module docstring).

    ``name``: the resolved setting (``fp32``, ``bf16`` or ``fp16``; never
    ``auto``). ``device_type``: ``cpu`` or ``cuda``. ``channels_last``: conv
    nets and their inputs use the channels-last layout (CUDA only).
    """

    name: str = "fp32"
    device_type: str = "cpu"
    channels_last: bool = False

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype, ``None`` for fp32."""
        return _DTYPES.get(self.name)

    @property
    def mixed(self) -> bool:
        return self.dtype is not None

    def autocast(self) -> ContextManager:
        """Autocast to the run's dtype on its device; a no-op for fp32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> Optional["torch.amp.GradScaler"]:
        """A fresh gradient scaler for fp16, ``None`` otherwise (bf16 has fp32's range)."""
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type)

    def for_extraction(self) -> "Precision":
        """This precision for feature extraction: channels-last only with a mixed dtype.

        fp32 then leaves the layout alone, so its features are a plain
        forward's (evaluation's protocol); bf16/fp16 also go channels-last
        where the layout applies (CUDA).
        """
        return replace(self, channels_last=self.channels_last and self.mixed)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """``model`` in the run's memory layout (in place; channels-last for conv nets on CUDA)."""
        if self.channels_last and _has_conv(model):
            model.to(memory_format=torch.channels_last)
        return model

    def prepare_input(self, images: torch.Tensor) -> torch.Tensor:
        """A 4-D image batch in the run's memory layout."""
        if self.channels_last and images.dim() == 4:
            return images.contiguous(memory_format=torch.channels_last)
        return images

    @staticmethod
    def backward(loss: torch.Tensor, scaler: Optional["torch.amp.GradScaler"]) -> None:
        """``loss.backward()``, through the scaler when there is one."""
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()

    @staticmethod
    def unscale(optimizer: torch.optim.Optimizer, scaler: Optional["torch.amp.GradScaler"]) -> None:
        """Make the gradients true gradients before anything reads or changes them (clipping, SCAFFOLD)."""
        if scaler is not None:
            scaler.unscale_(optimizer)

    @staticmethod
    def step(optimizer: torch.optim.Optimizer, scaler: Optional["torch.amp.GradScaler"]) -> None:
        """``optimizer.step()``; with a scaler, skipped on inf/NaN gradients and the scale updated."""
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()


FP32 = Precision()


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def resolve_precision(name: str, device: torch.device | str, *, channels_last: bool = True,
                      field: str = "train.precision") -> Precision:
    """The :class:`Precision` of ``train.precision=name`` (or the option ``field``) on ``device``.

    ``auto``: bf16 on a CUDA device that supports it, fp32 elsewhere. ``fp16``
    on the CPU raises :class:`PrecisionError` (CPU autocast has no fp16
    GradScaler path worth running); so does ``bf16`` on a CUDA card without
    bf16. ``channels_last`` applies on CUDA only: on the CPU the layout stays
    as it is, so CPU numbers do not move. Errors name ``field``.
    """
    device = torch.device(device)
    if name not in PRECISIONS:
        raise PrecisionError(f"{field}: expected one of {', '.join(PRECISIONS)}, got {name!r}")
    cuda = device.type == "cuda"
    if name == "auto":
        name = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and not cuda:
        raise PrecisionError(f"{field}: fp16 needs a CUDA device (use bf16 or fp32 on the CPU)")
    if name == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise PrecisionError(f"{field}: this CUDA card has no bf16; use fp16 or fp32")
    return Precision(name=name, device_type=device.type, channels_last=bool(channels_last and cuda))


def _per_backend_api() -> bool:
    """Whether this torch (>= 2.9) has per-backend fp32 precision fields beside its legacy switches."""
    return hasattr(torch.backends.mkldnn, "matmul") and hasattr(torch.backends.mkldnn.matmul, "fp32_precision")


#: oneDNN's fp32 precision fields (torch >= 2.9), which no legacy switch keeps in agreement.
_ONEDNN_FIELDS: tuple[str, ...] = ("mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
#: All of torch >= 2.9's fp32 precision fields, the generic one ("") first: a field left "none" follows its parent.
_FIELDS: tuple[str, ...] = ("", "cuda.matmul", "cudnn.conv", "cudnn.rnn", *_ONEDNN_FIELDS)


def _field(path: str) -> Any:
    """The ``torch.backends`` object whose ``fp32_precision`` is field ``path``."""
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def fp32_settings() -> dict[str, Any]:
    """This process's fp32 arithmetic settings (TF32 and the like), for :func:`adopt_fp32_settings`.

    Read and written through the switches that keep torch's legacy and
    per-backend fields in agreement (``allow_tf32`` of cuBLAS and cuDNN). On
    torch >= 2.9 the process-wide ``torch.set_float32_matmul_precision`` is
    never used: it also sets oneDNN's matmul, so a later ``allow_tf32 = False``
    left CUDA's and oneDNN's disagreeing, and torch then refuses the
    process-wide reading (``get_float32_matmul_precision`` raises). oneDNN's
    matmul, convolution and RNN fields are read and written on their own
    there instead. Where the user's own settings made torch refuse the
    legacy readings too (the generic ``torch.backends.fp32_precision`` set,
    say), every per-backend field is read as it stands.
    """
    if _per_backend_api():
        try:
            cuda_tf32, cudnn_tf32 = bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32)
        except RuntimeError:  # torch refuses the legacy readings once its per-backend fields were set apart
            return {"fields": {path: _field(path).fp32_precision for path in _FIELDS}}
        return {"cuda_matmul_tf32": cuda_tf32, "cudnn_tf32": cudnn_tf32,
                "fields": {path: _field(path).fp32_precision for path in _ONEDNN_FIELDS}}
    return {"cuda_matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_precision": torch.get_float32_matmul_precision()}


def adopt_fp32_settings(settings: Mapping[str, Any]) -> None:
    """Set what :func:`fp32_settings` returned (in this or another process of the same torch)."""
    for path, value in settings.get("fields", {}).items():  # the generic field first, then what overrides it
        _field(path).fp32_precision = value
    if "cuda_matmul_tf32" not in settings:  # every field was read as it stood
        return
    if "matmul_precision" in settings:
        torch.set_float32_matmul_precision(settings["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = bool(settings["cuda_matmul_tf32"])
    torch.backends.cudnn.allow_tf32 = bool(settings["cudnn_tf32"])


@contextlib.contextmanager
def full_fp32_matmul() -> Iterator[None]:
    """Torch fp32 matmuls in full precision inside, whatever ``train.tf32`` set; put back on exit."""
    saved = fp32_settings()
    torch.backends.cuda.matmul.allow_tf32 = False
    if _per_backend_api():
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        adopt_fp32_settings(saved)


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on CUDA (``train.tf32``)."""
    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    torch.backends.cudnn.allow_tf32 = bool(enabled)


__all__ = [
    "FP32", "PRECISIONS", "Precision", "PrecisionError", "adopt_fp32_settings", "fp32_settings",
    "full_fp32_matmul", "resolve_precision", "set_tf32",
]
