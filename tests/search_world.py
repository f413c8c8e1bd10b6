"""The federated-search test world shared by the Flower and the site-link tests: small Flat stores of
random unit features with a model fingerprint, and the exact merge their answers must equal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from fedreid.flower.search_codec import Hit
from fedreid.retrieval.store import GalleryStore

D = 16
FP = {"weights_sha256": "ab" * 32, "backbone": "toy", "height": 32, "width": 16, "feature": "embed+flip, l2-normalised"}
SITES = ("sa", "sb", "sc")


def unit_rows(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def make_store(folder: Path, n: int, seed: int, *, fp_where: str = "meta", images: bool = False,
               site: str = "x", fingerprint: dict = FP) -> GalleryStore:
    """A Flat store of ``n`` random unit features; JPEG files (with EXIF) when ``images``, their folder recorded
    as the store's gallery root (as the index tool records it)."""
    rows = []
    for i in range(n):
        path = folder.parent / f"{folder.name}_images" / f"cam{i % 3}_{i:03d}.jpg"
        if images:
            path.parent.mkdir(parents=True, exist_ok=True)
            exif = Image.Exif()
            exif[0x010E] = "secret description"  # ImageDescription
            Image.new("RGB", (48, 96), (10 * i % 255, 80, 160)).save(path, exif=exif)
        rows.append({"path": str(path), "camera": i % 3, "site": f"{site}-{'north' if i % 2 else 'south'}",
                     "timestamp": 1000.0 + i, "identity": 500 + i})
    roots = {"gallery_roots": [os.path.realpath(folder.parent / f"{folder.name}_images")]} if images else {}
    kwargs = ({"meta": {"model_fingerprint": fingerprint, **roots}} if fp_where == "meta"
              else {"model_fingerprint": fingerprint, **({"meta": roots} if roots else {})})
    return GalleryStore.create(folder, unit_rows(n, seed), rows, **kwargs)


def exact_answer(store: GalleryStore, site: str, q: np.ndarray, k: int, **filters) -> list[tuple]:
    """(site, id, score) of the store's own top-k, pads dropped."""
    res = store.search(q[None], k, **filters)
    keep = res.ids[0] >= 0
    return [(site, int(i), float(s)) for i, s in zip(res.ids[0][keep], res.scores[0][keep])]


def exact_merge(per_site: list[list[tuple]], k: int) -> list[tuple]:
    return sorted((t for site in per_site for t in site), key=lambda t: (-t[2], t[0], t[1]))[:k]


def triples(hits) -> list[tuple]:
    return [(h.site, h.id, h.score) if isinstance(h, Hit) else (h["site"], h["id"], h["score"]) for h in hits]
