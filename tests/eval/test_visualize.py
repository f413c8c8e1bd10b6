"""Ranked-list pictures and CMC plots, on images made here."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from fedreid.eval.metrics import evaluate
from fedreid.eval.visualize import (
    BORDER,
    CORRECT_BGR,
    QUERY_BGR,
    UNKNOWN_BGR,
    WRONG_BGR,
    canvas_shape,
    draw_ranked_list,
    filtered_top_k,
    plot_cmc,
    tile_box,
)

FILL_BGR = (200, 120, 40)


def solid_images(folder, n, height=40, width=20):
    paths = []
    for i in range(n + 1):
        path = folder / f"img{i}.png"
        cv2.imwrite(str(path), np.full((height, width, 3), FILL_BGR, np.uint8))
        paths.append(path)
    return paths[0], paths[1:]


def test_ranked_list_picture_has_the_layout_and_border_colours(tmp_path):
    query, gallery = solid_images(tmp_path, 5)
    flags = [True, False, None, True, False]  # None: identity unknown
    size = (32, 16)
    scores = [0.9, 0.8, 0.7, 0.6, 0.5]
    out = draw_ranked_list(query, gallery, flags, scores, tmp_path / "out" / "rank.png", size=size, top_k=4)
    image = cv2.imread(str(out))
    assert image.shape == canvas_shape(4, size)
    for position, expected in enumerate([QUERY_BGR, CORRECT_BGR, WRONG_BGR, UNKNOWN_BGR, CORRECT_BGR]):
        x0, y0, x1, y1 = tile_box(position, size)
        assert tuple(image[y0, x0]) == expected  # frame corner
        assert tuple(image[y1 - 1, (x0 + x1) // 2]) == expected  # bottom edge
        assert tuple(image[y0 + BORDER + 2, x0 + BORDER + 2]) == FILL_BGR  # the image inside
        assert y1 - y0 == size[0] + 2 * BORDER and x1 - x0 == size[1] + 2 * BORDER
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank.png"]  # nothing temporary left


def test_ranked_list_shorter_than_top_k_and_errors(tmp_path):
    query, gallery = solid_images(tmp_path, 2)
    out = draw_ranked_list(query, gallery, [True, False], [0.5, 0.4], tmp_path / "short.png")
    assert cv2.imread(str(out)).shape == canvas_shape(2)
    expected = r"mismatched lengths \(gallery_paths: 2, correct_flags: 1, scores: 2\)"
    with pytest.raises(ValueError, match=expected):
        draw_ranked_list(query, gallery, [True], [0.5, 0.4], tmp_path / "x.png")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        draw_ranked_list(tmp_path / "missing.png", gallery, [True, False], [0.5, 0.4], tmp_path / "x.png")


def test_filtered_top_k_follows_the_metrics_filter_and_tie_rule():
    # Query pid 1 in camera 0. Gallery: junk, same-camera match (removed),
    # a distractor, a tie between a negative (index 3) and a match (index 4).
    scores = np.array([0.99, 0.95, 0.9, 0.5, 0.5, 0.1])
    g_pids = np.array([-1, 1, 0, 2, 1, 1])
    g_cams = np.array([1, 0, 1, 1, 1, 2])
    idx, correct = filtered_top_k(scores, 1, 0, g_pids, g_cams, k=3)
    assert idx.tolist() == [2, 3, 4] and correct.tolist() == [False, False, True]
    # The same ranking gives evaluate()'s first-match rank.
    r = evaluate(np.ones((1, 1), np.float32), scores[:, None].astype(np.float32), [1], g_pids, [0], g_cams)
    assert r["rank1"] == 0.0 and r["rank5"] == 1.0
    all_idx, all_correct = filtered_top_k(scores, 1, 0, g_pids, g_cams, k=10)
    assert all_idx.tolist() == [2, 3, 4, 5] and all_correct.sum() == 2


def test_plot_cmc_writes_a_png_of_the_requested_size(tmp_path):
    curves = {"FedPav": np.linspace(0.6, 0.95, 20), "local": np.linspace(0.3, 0.8, 20)}
    out = plot_cmc(curves, tmp_path / "cmc.png", figsize=(4, 3), dpi=50)
    image = cv2.imread(str(out))
    assert image.shape == (150, 200, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["cmc.png"]
    with pytest.raises(ValueError, match="fractions in"):
        plot_cmc({"bad": [10.0, 20.0]}, tmp_path / "bad.png")
    with pytest.raises(ValueError, match="at least one curve"):
        plot_cmc({}, tmp_path / "none.png")
