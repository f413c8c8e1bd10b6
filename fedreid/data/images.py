"""Image files as RGB arrays (OpenCV), without torch.

:func:`read_image` decodes a file with ``cv2.imdecode`` of its bytes (which
also handles non-ASCII paths), then BGR -> RGB. A file that is missing or
cannot be decoded raises :class:`ImageReadError` naming it. The training
datasets (:mod:`fedreid.data.datasets`, which re-exports both names) and the
evaluation tool's image folders (:mod:`fedreid.inference.images`) read
images here.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from fedreid.errors import FedReIDError

__all__ = ["ImageReadError", "read_image"]


class ImageReadError(FedReIDError, OSError):
    """An image file is missing or cannot be decoded; the message names it."""


def read_image(path: str | Path) -> np.ndarray:
    """The image at ``path`` as an RGB uint8 ``[H, W, 3]`` array (grey images become RGB)."""
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as exc:
        raise ImageReadError(f"cannot read image {path}: {exc}") from exc
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise ImageReadError(f"cannot decode image {path} (empty, corrupt or not an image)")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
