"""Image input of the evaluation tool: OpenCV's refusals become one line, or a skipped image."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from small_fixtures import png_header_only
from tiny_runs import save_tiny_run

from fedreid.inference.errors import EvalInputError
from fedreid.inference.images import decode_image_bytes, image_features
from fedreid.inference.model_io import load_model


def _model_and_images(tmp_path, count):
    """A tiny run's model and ``count`` random 80x40 PNGs with Market-style names."""
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    paths = []
    for k in range(count):
        paths.append(gallery / f"{k:04d}_c1s1_000001_00.png")
        cv2.imwrite(str(paths[-1]), np.random.default_rng(k).integers(0, 256, (80, 40, 3), dtype=np.uint8))
    return load_model(save_tiny_run(tmp_path / "run", 64, 32)), paths


def test_bytes_declaring_more_pixels_than_opencv_decodes_are_one_line():
    with pytest.raises(EvalInputError) as info:
        decode_image_bytes(png_header_only(40000, 40000), "upload 'bomb.png'")
    text = str(info.value)
    assert text.startswith("upload 'bomb.png' cannot be decoded") and "CV_IO_MAX_IMAGE_PIXELS" in text
    assert "\n" not in text


def test_an_image_opencv_refuses_is_skipped_or_one_line_naming_it(tmp_path):
    loaded, paths = _model_and_images(tmp_path, 2)
    bomb = paths[0].parent / "0009_c2s1_000001_00.png"
    bomb.write_bytes(png_header_only(40000, 40000))
    paths.insert(1, bomb)

    with pytest.raises(EvalInputError) as info:  # without --skip-bad-images: one line naming the file
        image_features(loaded, paths, batch_size=2)
    text = str(info.value)
    assert str(bomb) in text and "--skip-bad-images" in text and "\n" not in text

    skipped = []  # with --skip-bad-images: listed, the other images go on
    fs = image_features(loaded, paths, batch_size=2, skipped=skipped)
    assert fs.paths == [str(paths[0]), str(paths[2])]
    assert [s.path for s in skipped] == [str(bomb)] and "CV_IO_MAX_IMAGE_PIXELS" in skipped[0].reason


def test_a_progress_bar_counts_the_images_read_and_changes_no_feature(tmp_path, capsys, monkeypatch):
    import tqdm

    bars = []

    class Recorded(tqdm.tqdm):
        def close(self):
            if not self.disable:  # tqdm closes a bar a second time as it is collected
                bars.append((self.desc, self.n, self.total, self.unit))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    loaded, paths = _model_and_images(tmp_path, 5)
    quiet = image_features(loaded, paths, batch_size=2, where="gallery g/")
    assert capsys.readouterr().err == ""
    shown = image_features(loaded, paths, batch_size=2, where="gallery g/", progress=True)
    assert "gallery g/" in capsys.readouterr().err
    assert bars == [("gallery g/", 5, 5, "img")]  # counted in images, from batches of 2, 2 and 1
    assert np.array_equal(quiet.features, shown.features) and quiet.paths == shown.paths
