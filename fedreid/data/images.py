"""Image files as RGB arrays (OpenCV), without torch.

:func:`read_image` decodes a file with ``cv2.imdecode`` of its bytes (which
also handles non-ASCII paths), then BGR -> RGB. A file that is missing or
cannot be decoded raises :class:`ImageReadError` naming it, also when OpenCV
itself raises (``cv2.error``, e.g. a header declaring more pixels than
``CV_IO_MAX_IMAGE_PIXELS``, 2^30 by default). Below that limit there is no
pixel cap here. The training
datasets (:mod:`fedreid.data.datasets`, which re-exports both names) and the
evaluation tool's image folders (:mod:`fedreid.inference.images`) read
images here.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from fedreid.errors import FedReIDError

__all__ = ["ImageReadError", "decode_image", "opencv_refusal", "read_image"]


class ImageReadError(FedReIDError, OSError):
    """An image file is missing or cannot be decoded; the message names it."""


def opencv_refusal(exc: BaseException) -> str:
    """Why ``cv2.imdecode`` raised ``exc`` (a ``cv2.error``), in a few words without OpenCV's source location."""
    text = str(exc)
    if "CV_IO_MAX_IMAGE_PIXELS" in text or "validateInputImageSize" in text:
        return "it declares more pixels than OpenCV decodes (CV_IO_MAX_IMAGE_PIXELS, 2^30 by default)"
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = line.split(" error: ", 1)[-1]  # "OpenCV(5.0.0) /io/.../loadsave.cpp:79: error: (-215:...) ..."
    return f"OpenCV refused it ({line})" if line else "OpenCV refused it"


def read_image(path: str | Path) -> np.ndarray:
    """The image at ``path`` as an RGB uint8 ``[H, W, 3]`` array (grey images become RGB).

    Decoded by OpenCV (``IMREAD_COLOR``), which turns a JPEG by its EXIF
    orientation tag; the FedReID reference's PIL loader
    (``Image.open(f).convert("RGB")``) does not, so a phone photo with such a
    tag comes out rotated relative to the reference (the public ReID
    benchmarks carry no EXIF). An alpha channel is dropped without compositing
    (as PIL's ``convert("RGB")`` does); 16-bit images keep their high byte.
    Raises :class:`ImageReadError` naming ``path`` when the file cannot be
    read or decoded, including when OpenCV raises (``cv2.error``).
    """
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as exc:
        raise ImageReadError(f"cannot read image {path}: {exc}") from exc
    return decode_image(data, f"image {path}")


def decode_image(data: np.ndarray, what: str) -> np.ndarray:
    """Encoded image bytes (a uint8 array) as :func:`read_image` decodes a file's: RGB uint8 ``[H, W, 3]``.

    Raises :class:`ImageReadError` naming ``what`` when they cannot be decoded.
    """
    try:
        image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    except cv2.error as exc:
        raise ImageReadError(f"cannot decode {what}: {opencv_refusal(exc)}") from exc
    if image is None:
        raise ImageReadError(f"cannot decode {what} (empty, corrupt or not an image)")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
