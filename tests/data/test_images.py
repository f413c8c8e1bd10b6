"""fedreid.data.images.read_image: OpenCV's own refusals are ImageReadError naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_fixtures import png_header_only

from fedreid.data.images import ImageReadError, read_image


def test_a_header_declaring_more_pixels_than_opencv_decodes_is_an_image_read_error(tmp_path: Path):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_header_only(40000, 40000))  # 1.6e9 pixels > CV_IO_MAX_IMAGE_PIXELS (2^30)
    with pytest.raises(ImageReadError) as info:
        read_image(path)
    text = str(info.value)
    assert str(path) in text and "CV_IO_MAX_IMAGE_PIXELS" in text and "\n" not in text
    assert "loadsave.cpp" not in text  # OpenCV's source location stays out of the line
    assert type(info.value.__cause__).__name__ == "error"  # the cv2.error is kept as the cause
