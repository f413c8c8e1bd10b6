"""The search service (fedreid.retrieval.service): auth, search by upload and by item, filters, add/delete, limits."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import quote

import cv2
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tiny_runs import save_tiny_run

from fedreid.commands import eval_serve as serve_cmd
from fedreid.data.datasets import read_image
from fedreid.inference.errors import EvalInputError
from fedreid.inference.images import array_features, decode_image_bytes, image_features
from fedreid.inference.model_io import ModelMismatchError, load_model
from fedreid.retrieval import service as svc
from fedreid.retrieval.gallery_rows import GALLERY_ROOTS_KEY, gallery_roots
from fedreid.retrieval.store import GalleryStore
from fedreid.utils.io import OutputDirError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEIGHT, WIDTH = 64, 32
TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SITES = ("north", "south", "east")
T0 = 1_714_550_400.0  # 2024-05-01T08:00:00Z


def person_image(identity: int, camera: int, shot: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """A person-like RGB picture: identity-coloured top and bottom, camera-tinted background, a little noise."""
    rng = np.random.default_rng(1000 * identity + 10 * camera + shot)
    ident = np.random.default_rng(identity)
    top, bottom = ident.integers(20, 235, 3), ident.integers(20, 235, 3)
    background = np.array([90, 100, 110]) + 40 * np.array([camera % 2, (camera // 2) % 2, camera % 3 == 2])
    img = np.empty((height, width, 3), dtype=np.float64)
    img[:] = background
    x0, x1 = width // 4 + shot % 2, 3 * width // 4 + shot % 2
    img[height // 8 : height // 2, x0:x1] = top
    img[height // 2 : 7 * height // 8, x0:x1] = bottom
    img[height // 16 : height // 8, x0 + 2 : x1 - 2] = (220, 180, 150)  # a head
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_png(path: Path, rgb: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
        raise OSError(f"cv2 could not write {path}")
    return path


def save_tiny_model(run: Path, seed: int = 0) -> Path:
    return save_tiny_run(run, HEIGHT, WIDTH, seed=seed)


def build_store(folder: Path, loaded, paths: list[Path], rows: list[dict], roots: list[Path] | None = None,
                factory: str = "Flat"):
    """A store of ``paths`` whose header records ``roots`` (default: the rows' folders) as its gallery roots."""
    feats = image_features(loaded, paths, batch_size=32)
    fp = loaded.fingerprint
    roots = gallery_roots([str(Path(r["path"]).resolve()) for r in rows]) if roots is None else [str(r) for r in roots]
    return GalleryStore.create(folder, feats.features, rows, factory=factory, model_fingerprint=fp,
                               meta={"model_fingerprint": fp, "model": str(loaded.source), GALLERY_ROOTS_KEY: roots})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny resnet18 run, a 24-image gallery (8 identities x 3 cameras) and a Flat store built from it."""
    root = tmp_path_factory.mktemp("service")
    loaded = load_model(save_tiny_model(root / "run"), "cpu")
    paths, rows = [], []
    for identity in range(8):
        for camera in range(3):
            p = write_png(root / "gallery" / f"{identity:04d}_c{camera + 1}_{len(paths):03d}.png",
                          person_image(identity, camera, 0))
            paths.append(p)
            rows.append({"path": str(p), "camera": camera, "site": SITES[identity % 3],
                         "timestamp": T0 + 600 * len(rows), "identity": identity})
    build_store(root / "store", loaded, paths, rows)
    return {"root": root, "loaded": loaded, "paths": paths, "rows": rows, "store": root / "store"}


@pytest.fixture
def store_copy(world, tmp_path):
    """A private copy of the store (for tests that change it)."""
    dst = tmp_path / "store"
    shutil.copytree(world["store"], dst)
    return dst


def client_for(world, folder=None, **kwargs) -> TestClient:
    kwargs.setdefault("token", TOKEN)
    app = svc.create_app(folder or world["store"], world["loaded"], **kwargs)
    return TestClient(app)


@pytest.fixture(scope="module")
def client(world):
    with client_for(world) as c:
        yield c


def png_bytes(rgb: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    return buf.tobytes()


# --------------------------------------------------------------------------
# Shared preprocessing
# --------------------------------------------------------------------------


def test_in_memory_features_equal_file_features(world):
    path = world["paths"][5]
    from_file = image_features(world["loaded"], [path]).features
    decoded = decode_image_bytes(path.read_bytes())
    np.testing.assert_array_equal(decoded, read_image(path))
    np.testing.assert_allclose(array_features(world["loaded"], [decoded]), from_file, atol=1e-6)
    from PIL import Image

    pil = Image.open(path)  # PNG: PIL and OpenCV decode the same pixels
    np.testing.assert_allclose(array_features(world["loaded"], [pil]), from_file, atol=1e-6)
    with pytest.raises(EvalInputError, match="empty"):
        decode_image_bytes(b"")
    with pytest.raises(EvalInputError, match="cannot be decoded"):
        decode_image_bytes(b"not an image at all")


def test_pil_images_are_turned_and_scaled_as_files_are_read(world, tmp_path):
    """A PIL image's EXIF orientation and a 16-bit grey PNG's range: what OpenCV does with the file."""
    from PIL import Image

    rng = np.random.default_rng(3)
    grey16 = tmp_path / "grey16.png"
    cv2.imwrite(str(grey16), rng.integers(0, 65536, (40, 20), dtype=np.uint16))
    turned = tmp_path / "turned.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    Image.fromarray(rng.integers(0, 256, (20, 40, 3), dtype=np.uint8)).save(turned, exif=exif)
    for path in (grey16, turned):
        with Image.open(path) as pil:
            assert np.array_equal(read_image(path), np.asarray(_rgb_from_pil(pil))), path.name
            from_memory = array_features(world["loaded"], [pil])
        np.testing.assert_allclose(from_memory, image_features(world["loaded"], [path]).features, atol=1e-6)


def _rgb_from_pil(pil):
    from fedreid.inference.images import _rgb_array

    return _rgb_array(pil, 0)


# --------------------------------------------------------------------------
# Authentication and the page
# --------------------------------------------------------------------------


def test_every_api_endpoint_needs_the_token(client):
    calls = [("get", "/info"), ("post", "/search"), ("get", "/items/0"), ("get", "/items/0/image"),
             ("post", "/items"), ("delete", "/items/0")]
    for method, path in calls:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            r = getattr(client, method)(path, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert "token" in r.json()["error"] and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/info", headers=AUTH).status_code == 200
    # unknown endpoints are not revealed without the token either
    assert client.get("/docs").status_code == 401
    assert client.get("/openapi.json", headers=AUTH).status_code == 404


def test_page_and_assets_are_public(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert 'id="token"' in page.text and 'type="file"' in page.text
    assert client.get("/web/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/web/style.css").status_code == 200
    missing = client.get("/web/../service.py")
    assert missing.status_code in (401, 404) and "error" in missing.json()
    assert client.get("/web/nothing.js").json() == {"error": "no web asset 'nothing.js'"}


# --------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------


def test_search_by_upload_matches_the_store(world, client):
    path = world["paths"][7]
    r = client.post("/search", headers=AUTH, files={"image": (path.name, path.read_bytes(), "image/png")},
                    data={"k": "5"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["k"] == 5 and body["took_ms"] >= 0 and body["query"] == {"kind": "image", "name": path.name}
    feature = image_features(world["loaded"], [path]).features
    expected = GalleryStore.open(world["store"]).search(feature, 5)
    assert [x["id"] for x in body["results"]] == expected.ids[0].tolist()
    np.testing.assert_allclose([x["score"] for x in body["results"]], expected.scores[0], atol=1e-5)
    assert [x["rank"] for x in body["results"]] == [1, 2, 3, 4, 5]
    top = body["results"][0]
    assert top["id"] == 7 and top["score"] == pytest.approx(1.0, abs=1e-5)
    row = world["rows"][7]
    assert top["path"] == path.name and "/" not in top["path"]  # the file name, no server folders
    assert (top["camera"], top["site"], top["timestamp"], top["identity"]) == (
        row["camera"], row["site"], row["timestamp"], row["identity"])
    assert top["image_url"] == "/items/7/image"


def test_search_by_item_uses_the_stored_feature(world, client):
    store = GalleryStore.open(world["store"])
    r = client.post("/search", headers=AUTH, data={"item": "10", "k": "4"})
    assert r.status_code == 200, r.text
    expected = store.search(store.vectors[10:11], 4)
    assert [x["id"] for x in r.json()["results"]] == expected.ids[0].tolist()
    assert r.json()["results"][0]["id"] == 10 and r.json()["query"] == {"kind": "item", "item": 10}
    assert client.post("/search", headers=AUTH, data={"item": "999"}).status_code == 404
    # default k, and k larger than the gallery gives every item once
    assert len(client.post("/search", headers=AUTH, data={"item": "0"}).json()["results"]) == svc.DEFAULT_K
    everything = client.post("/search", headers=AUTH, data={"item": "0", "k": "100"}).json()["results"]
    assert sorted(x["id"] for x in everything) == list(range(24))


def test_the_default_k_is_cut_to_max_k(world):
    with client_for(world, max_k=5) as c:
        for files, data in (({}, {"item": "3"}),
                            ({"image": ("q.png", world["paths"][3].read_bytes(), "image/png")}, {})):
            body = c.post("/search", headers=AUTH, files=files or None, data=data).json()
            assert body["k"] == 5 and len(body["results"]) == 5, body


def test_a_compressed_store_answers_the_true_scores(world, tmp_path):
    build_store(tmp_path / "pq", world["loaded"], world["paths"], world["rows"], factory="IVF2,PQ4x4")
    vectors = np.asarray(GalleryStore.open(tmp_path / "pq").vectors)  # ids 0..23 are rows 0..23
    with client_for(world, tmp_path / "pq") as c:
        for item in (4, 10, 17):
            plain = c.post("/search", headers=AUTH, data={"item": str(item), "k": "8"}).json()["results"]
            some = c.post("/search", headers=AUTH, data={"item": str(item), "k": "8", "cameras": "0,1"}).json()["results"]
            for x in plain + some:
                assert x["score"] == pytest.approx(float(vectors[x["id"]] @ vectors[item]), abs=1e-6), (item, x)
            assert [x["score"] for x in plain] == sorted((x["score"] for x in plain), reverse=True)
            unfiltered = {x["id"]: x["score"] for x in plain}
            assert all(unfiltered[x["id"]] == x["score"] for x in some if x["id"] in unfiltered)


def test_filters_match_the_store(world, client):
    store = GalleryStore.open(world["store"])
    query = store.vectors[3:4]
    cases = [
        ({"cameras": "1"}, {"cameras": [1]}),
        ({"cameras": "0, 2"}, {"cameras": [0, 2]}),
        ({"sites": "north,east"}, {"sites": ["north", "east"]}),
        ({"since": str(T0 + 600 * 5), "until": str(T0 + 600 * 12)}, {"time_window": (T0 + 3000, T0 + 7200)}),
        ({"since": "2024-05-01T09:00", "until": "2024-05-01T10:00:00Z"}, {"time_window": (T0 + 3600, T0 + 7200)}),
        ({"until": "2024-05-01 08:30+00:00"}, {"time_window": (None, T0 + 1800)}),
        ({"cameras": "2", "sites": "south", "since": str(T0)}, {"cameras": [2], "sites": ["south"],
                                                                "time_window": (T0, None)}),
        ({"cameras": "", "sites": " "}, {}),  # empty filters are no filters
    ]
    for form, kwargs in cases:
        r = client.post("/search", headers=AUTH, data={"item": "3", "k": "24", **form})
        assert r.status_code == 200, (form, r.text)
        got = r.json()["results"]
        expected = store.search(query, 24, **kwargs)
        assert [x["id"] for x in got] == [i for i in expected.ids[0].tolist() if i >= 0], form
        assert got, form
        rows = {row["id"]: row for row in (dict(r, id=i) for i, r in enumerate(world["rows"]))}
        for x in got:
            row = rows[x["id"]]
            assert "cameras" not in kwargs or row["camera"] in kwargs["cameras"]
            assert "sites" not in kwargs or row["site"] in kwargs["sites"]
    none = client.post("/search", headers=AUTH, data={"item": "3", "cameras": "7"})
    assert none.status_code == 200 and none.json()["results"] == []


@pytest.mark.parametrize("form,status,words", [
    ({"item": "1", "k": "0"}, 422, "k must be an integer from 1 to 100"),
    ({"item": "1", "k": "abc"}, 422, "k must be an integer"),
    ({"item": "1", "k": "101"}, 422, "from 1 to 100"),
    ({"item": "1", "k": "2.5"}, 422, "k must be an integer"),
    ({"item": "1", "cameras": "front"}, 422, "cameras (each a camera) must be an integer from -2147483648"),
    ({"item": "1", "cameras": "99999999999999999999"}, 422, "cameras (each a camera) must be an integer"),
    ({"item": "1", "cameras": "1,-99999999999"}, 422, "got '-99999999999'"),
    ({"item": "1", "sites": "a," + "b" * 201}, 422, "sites (each a site) must be a name of 1 to 200 characters"),
    ({"item": "1", "since": "yesterday"}, 422, "ISO 8601"),
    ({"item": "1", "since": "nan"}, 422, "since must be seconds since the epoch"),
    ({"item": "1", "until": "1e300"}, 422, "until must be seconds since the epoch or an ISO 8601 date/time from year 1"),
    ({"item": "1", "since": "20", "until": "10"}, 422, "since <= until"),
    ({"item": "x"}, 422, "item id must be an integer"),
    ({"item": "-1"}, 422, "item id must be an integer"),
    ({"k": "3"}, 422, "either an 'image' file or an 'item' id"),
    ({"item": "1", "camera": "1"}, 422, "unknown field 'camera'"),
])
def test_bad_search_fields_are_clear_json_errors(client, form, status, words):
    r = client.post("/search", headers=AUTH, data=form)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


@pytest.mark.parametrize("text", ["1_0", "\u0661\u0660", "\uff11\uff10"])  # 10 with an underscore, Arabic, full-width
def test_ids_and_k_are_ascii_digits_only(client, text):
    r = client.get(f"/items/{quote(text)}", headers=AUTH)
    assert r.status_code == 422 and "the item id must be an integer" in r.json()["error"], r.text
    r = client.post("/search", headers=AUTH, data={"item": text})
    assert r.status_code == 422 and "the item id must be an integer" in r.json()["error"], r.text
    r = client.post("/search", headers=AUTH, data={"item": "1", "k": text})
    assert r.status_code == 422 and "k must be an integer from 1 to 100" in r.json()["error"], r.text


def test_bad_uploads_are_clear_json_errors(world, client):
    from PIL import Image

    gif = io.BytesIO()
    Image.new("RGB", (16, 32), (10, 200, 30)).save(gif, format="GIF")
    png = world["paths"][0].read_bytes()
    jpeg = cv2.imencode(".jpg", cv2.imread(str(world["paths"][0])))[1].tobytes()
    bmp = cv2.imencode(".bmp", cv2.imread(str(world["paths"][0])))[1].tobytes()
    cases = [
        ({"image": ("cut.bmp", bmp[: len(bmp) // 2], "image/bmp")}, {}, 400, "damaged or truncated BMP"),
        ({"image": ("cut.jpg", jpeg[: len(jpeg) * 2 // 3], "image/jpeg")}, {}, 400, "damaged or truncated JPEG"),
        ({"image": ("notes.txt", b"hello, not an image", "text/plain")}, {}, 400, "is not an image"),
        ({"image": ("empty.png", b"", "image/png")}, {}, 400, "is empty"),
        ({"image": ("cut.png", png[: len(png) // 3], "image/png")}, {}, 400, "damaged or truncated PNG"),
        ({"image": ("anim.gif", gif.getvalue(), "image/gif")}, {}, 400, "is a GIF image: expected a JPEG, PNG or BMP"),
        ({"image": ("q.png", png, "image/png")}, {"item": "2"}, 422, "exactly one"),
        ({"image": ("q.png", png, "image/png")}, {"k": "0"}, 422, "k must be"),
    ]
    for files, data, status, words in cases:
        r = client.post("/search", headers=AUTH, files=files, data=data)
        assert r.status_code == status, (files["image"][0], r.text)
        assert words in r.json()["error"], r.json()
    r = client.post("/search", headers=AUTH, data={"image": "a string, not a file"})
    assert r.status_code == 422 and "file upload" in r.json()["error"]
    r = client.post("/search", headers={**AUTH, "content-type": "application/json"}, content=b'{"item": 1}')
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]


def test_image_pixel_limit(world):
    big = np.full((400, 300, 3), 128, np.uint8)
    with client_for(world, max_pixels=100_000) as c:
        r = c.post("/search", headers=AUTH, files={"image": ("big.png", png_bytes(big), "image/png")})
        assert r.status_code == 400 and "400x300" not in r.json()["error"] and "300x400 pixels" in r.json()["error"]


def test_uploads_are_decoded_a_few_at_a_time_and_once(world, monkeypatch):
    from PIL import PngImagePlugin

    import fedreid.inference.images as images_mod

    decode, load = images_mod.decode_image_bytes, PngImagePlugin.PngImageFile.load
    lock, active, most, pil_loads = threading.Lock(), [0], [0], []

    def slow_decode(data, what="image"):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.2)
            return decode(data, what)
        finally:
            with lock:
                active[0] -= 1

    def counted_load(self):
        pil_loads.append(self.size)
        return load(self)

    monkeypatch.setattr(images_mod, "decode_image_bytes", slow_decode)
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", counted_load)
    query = {"image": ("q.png", world["paths"][2].read_bytes(), "image/png")}
    for limit, options in ((svc.DEFAULT_MAX_DECODES, {}), (1, {"max_decodes": 1})):
        most[0], answers = 0, []
        with client_for(world, **options) as c:
            threads = [threading.Thread(target=lambda: answers.append(c.post("/search", headers=AUTH, files=query)))
                       for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert [r.status_code for r in answers] == [200] * 6
        assert all(r.json()["results"][0]["id"] == 2 for r in answers)
        assert most[0] == limit  # the others waited their turn
    assert pil_loads == []  # OpenCV's decode is the only full one
    assert 1 <= svc.DEFAULT_MAX_DECODES <= 4
    with client_for(world, max_pixels=100_000) as c:  # the pixel limit is checked before any decode
        most[0] = 0
        big = png_bytes(np.zeros((400, 300, 3), np.uint8))
        assert c.post("/search", headers=AUTH, files={"image": ("big.png", big, "image/png")}).status_code == 400
        assert most[0] == 0 and pil_loads == []


def test_oversized_bodies_get_413_before_being_read(world):
    with client_for(world, max_upload_bytes=20_000) as c:
        blob = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
        data = png_bytes(blob)
        assert len(data) > 20_000 + svc.FORM_OVERHEAD
        r = c.post("/search", headers=AUTH, files={"image": ("big.png", data, "image/png")})
        assert r.status_code == 413 and "at most" in r.json()["error"]

        def chunks():  # no Content-Length: the streamed bytes are counted
            for _ in range(40):
                yield b"x" * 4096

        r = c.post("/search", headers={**AUTH, "content-type": "multipart/form-data; boundary=zz"}, content=chunks())
        assert r.status_code == 413 and "passed" in r.json()["error"]
        # an upload under the limit but over max_upload_bytes once the form overhead is allowed for
        mid = np.random.default_rng(1).integers(0, 255, (90, 90, 3), dtype=np.uint8)
        data = png_bytes(mid)
        assert 20_000 < len(data) < 20_000 + svc.FORM_OVERHEAD - 1000
        r = c.post("/search", headers=AUTH, files={"image": ("mid.png", data, "image/png")})
        assert r.status_code == 413 and "at most 20000" in r.json()["error"]
        # the unauthenticated are refused before any size check
        assert c.post("/search", files={"image": ("big.png", data, "image/png")}).status_code == 401


# --------------------------------------------------------------------------
# Items: metadata, images, add, delete
# --------------------------------------------------------------------------


def test_item_metadata_and_image(world, client):
    r = client.get("/items/4", headers=AUTH)
    assert r.status_code == 200
    row = world["rows"][4]
    assert r.json() == {"id": 4, "path": Path(row["path"]).name, "camera": row["camera"], "site": row["site"],
                        "timestamp": row["timestamp"], "identity": row["identity"], "image_url": "/items/4/image"}
    img = client.get("/items/4/image", headers=AUTH)
    assert img.status_code == 200 and img.headers["content-type"] == "image/png"
    assert img.content == world["paths"][4].read_bytes()
    for path in ("/items/77", "/items/77/image"):
        r = client.get(path, headers=AUTH)
        assert r.status_code == 404 and r.json() == {"error": "no item 77 in the gallery"}
    assert client.get("/items/abc", headers=AUTH).status_code == 422


def test_missing_image_file_is_a_404(world, tmp_path):
    gallery = tmp_path / "g"
    paths = [write_png(gallery / f"{i}.png", person_image(i, 0, 1)) for i in range(3)]
    rows = [{"path": str(p), "camera": 0} for p in paths]
    build_store(tmp_path / "st", world["loaded"], paths, rows)
    paths[1].unlink()
    with client_for(world, tmp_path / "st") as c:
        r = c.get("/items/1/image", headers=AUTH)
        assert r.status_code == 404 and "missing on the server" in r.json()["error"]
        assert str(gallery) not in r.json()["error"]
        assert c.get("/items/0/image", headers=AUTH).status_code == 200


def test_an_internal_error_is_logged_without_the_item_id(world, monkeypatch, caplog):
    """The 500 handler's log line writes an item route as the access log does: the id must outlive no erasure."""

    def broken_row(self, item):
        raise RuntimeError("the table could not be read")

    monkeypatch.setattr(svc._Service, "row", broken_row)
    app = svc.create_app(world["store"], world["loaded"], token=TOKEN)
    with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level("ERROR", "fedreid.retrieval.service"):
        r = c.get("/items/4", headers=AUTH)
    assert r.status_code == 500 and r.json() == {"error": "internal error (RuntimeError); see the server log"}
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "fedreid.retrieval.service"]
    assert lines == ["internal error on GET /items/{item_id}"]


def test_only_regular_files_inside_the_gallery_or_uploads_are_served(world, tmp_path):
    gallery = tmp_path / "g"
    paths = [write_png(gallery / f"{i}.png", person_image(i, 0, 1)) for i in range(5)]
    elsewhere = write_png(tmp_path / "elsewhere" / "x.png", person_image(9, 0, 1))
    rows = [{"path": str(p), "camera": 0} for p in [*paths, elsewhere]]
    build_store(tmp_path / "st", world["loaded"], [*paths, elsewhere], rows, roots=[gallery])
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    paths[0].unlink()
    paths[0].symlink_to(secret)  # a gallery file replaced by a link to a secret
    paths[1].unlink()
    paths[1].symlink_to(paths[4])  # a link to another gallery file stays inside the gallery
    paths[2].unlink()
    os.mkfifo(paths[2])  # would block a plain open()
    (gallery / "sub").mkdir()
    with client_for(world, tmp_path / "st") as c:
        for item, words in ((0, "lies outside the gallery and uploads folders"), (2, "is not a regular file"),
                            (5, "lies outside the gallery and uploads folders")):
            r = c.get(f"/items/{item}/image", headers=AUTH)
            error = r.json()["error"]
            assert r.status_code == 404 and words in error, (item, r.text)
            assert "hunter2" not in r.text and str(tmp_path) not in error and "\n" not in error
        assert c.get("/items/1/image", headers=AUTH).content == paths[4].read_bytes()
        assert c.get("/items/3/image", headers=AUTH).content == paths[3].read_bytes()
        moved = tmp_path / "moved"
        gallery.rename(moved)  # a folder on the path replaced by a link to elsewhere
        gallery.symlink_to(elsewhere.parent)
        write_png(elsewhere.parent / "3.png", person_image(3, 0, 1))  # a regular file, but not the gallery's
        r = c.get("/items/3/image", headers=AUTH)
        assert r.status_code == 404 and "outside" in r.json()["error"] and "hunter2" not in r.text


def test_added_folders_are_recorded_as_gallery_roots(world, tmp_path):
    from fedreid.retrieval.folders import add_to_gallery_store, build_gallery_store

    first = [write_png(tmp_path / "g" / f"{i:04d}_c1s1_000001_00.png", person_image(i, 0, 1)) for i in range(3)]
    more = [write_png(tmp_path / "monday" / f"{i:04d}_c2s1_000001_00.png", person_image(i, 1, 1)) for i in range(2)]
    farm = tmp_path / "links"
    farm.mkdir()
    (farm / "0100_c3s1_000001_00.png").symlink_to(write_png(tmp_path / "store-b" / "p.png", person_image(5, 2, 1)))
    build_gallery_store(world["loaded"], tmp_path / "g", tmp_path / "st")
    add_to_gallery_store(world["loaded"], tmp_path / "st", tmp_path / "monday")
    store, _ = add_to_gallery_store(world["loaded"], tmp_path / "st", farm)
    assert store.header["meta"]["gallery_roots"] == sorted(
        str((tmp_path / name).resolve()) for name in ("g", "monday", "links", "store-b"))
    with client_for(world, tmp_path / "st") as c:
        for item, path in enumerate([*first, *more, tmp_path / "store-b" / "p.png"]):
            assert c.get(f"/items/{item}/image", headers=AUTH).content == path.read_bytes(), item


def test_an_indexed_single_image_leaves_the_header_with_its_item(world, tmp_path):
    """index --gallery FILE records that file as meta.gallery; erasing its item erases the record too."""
    from fedreid.retrieval.folders import add_to_gallery_store, build_gallery_store, remove_from_gallery_store

    private = write_png(tmp_path / "alice" / "0001_c1s1_000001_01.png", person_image(1, 0, 1))
    write_png(tmp_path / "more" / "0002_c1s1_000001_01.png", person_image(2, 0, 1))
    build_gallery_store(world["loaded"], private, tmp_path / "st")
    add_to_gallery_store(world["loaded"], tmp_path / "st", tmp_path / "more")
    store, gone = remove_from_gallery_store(tmp_path / "st", ["0"])
    assert gone.tolist() == [0] and store.header["meta"]["gallery"] is None
    for f in (tmp_path / "st").iterdir():
        assert b"alice" not in f.read_bytes(), f.name


def test_a_root_whose_items_are_all_removed_leaves_the_header(world, tmp_path):
    """index --remove and DELETE /items drop a gallery root no item lies under any more; no file is served there."""
    from fedreid.retrieval.folders import add_to_gallery_store, build_gallery_store, remove_from_gallery_store

    for i in range(2):
        write_png(tmp_path / "g" / f"{i:04d}_c1s1_000001_00.png", person_image(i, 0, 1))
    odd = tmp_path / "50%_off"  # % and _ are literal in a folder name, not patterns
    kept = [write_png(odd / f"{i:04d}_c2s1_000001_00.png", person_image(i, 1, 1)) for i in range(2)]
    build_gallery_store(world["loaded"], tmp_path / "g", tmp_path / "st")
    store, _ = add_to_gallery_store(world["loaded"], tmp_path / "st", odd)
    assert store.holds_under(str(odd.resolve())) and not store.holds_under(str(tmp_path.resolve() / "5%"))
    roots = [str((tmp_path / name).resolve()) for name in ("50%_off", "g")]
    assert store.header["meta"]["gallery_roots"] == roots
    store, gone = remove_from_gallery_store(tmp_path / "st", [str(kept[0].resolve())])
    assert gone.tolist() == [2] and store.header["meta"]["gallery_roots"] == roots  # one item still lies there
    assert store.header["meta"]["gallery"] == roots[1]
    store, gone = remove_from_gallery_store(tmp_path / "st", ["0", "1"])
    assert store.header["meta"]["gallery_roots"] == roots[:1] and store.header["meta"]["gallery"] is None
    assert roots[1].encode() not in (tmp_path / "st" / "header.json").read_bytes()
    with client_for(world, tmp_path / "st") as c:
        assert c.get("/items/3/image", headers=AUTH).content == kept[1].read_bytes()
        assert c.delete("/items/3", headers=AUTH).status_code == 200
        assert c.get("/info", headers=AUTH).json()["items"] == 0
    assert GalleryStore.open(tmp_path / "st").header["meta"]["gallery_roots"] == []


def test_add_search_and_delete_an_item(world, store_copy, tmp_path):
    uploads = tmp_path / "uploads"
    new = person_image(20, 1, 0)
    with client_for(world, store_copy, uploads=uploads) as c:
        r = c.post("/items", headers=AUTH, files={"image": ("new person.png", png_bytes(new), "image/png")},
                   data={"camera": "1", "site": "west", "timestamp": "2024-05-02T12:00:00Z", "identity": "20"})
        assert r.status_code == 201, r.text
        item = r.json()
        assert item["id"] == 24 and item["camera"] == 1 and item["site"] == "west" and item["identity"] == 20
        assert item["timestamp"] == T0 + 86400 + 4 * 3600
        saved = sorted(p for p in uploads.iterdir() if not p.name.startswith("."))
        assert len(saved) == 1 and saved[0].name == item["path"] and saved[0].read_bytes() == png_bytes(new)
        assert c.get("/info", headers=AUTH).json()["items"] == 25

        found = c.post("/search", headers=AUTH, files={"image": ("q.png", png_bytes(new), "image/png")},
                       data={"k": "3"}).json()["results"]
        assert found[0]["id"] == 24 and found[0]["score"] == pytest.approx(1.0, abs=1e-5)
        assert c.get("/items/24/image", headers=AUTH).content == png_bytes(new)

        gone = c.delete("/items/24", headers=AUTH)
        assert gone.status_code == 200 and gone.json() == {"removed": 24, "file_deleted": True, "items": 24}
        assert not saved[0].exists()
        again = c.post("/search", headers=AUTH, files={"image": ("q.png", png_bytes(new), "image/png")},
                       data={"k": "24"}).json()["results"]
        assert 24 not in [x["id"] for x in again] and len(again) == 24
        assert c.get("/items/24", headers=AUTH).status_code == 404
        assert c.delete("/items/24", headers=AUTH).status_code == 404

        # a gallery item: erased from the store, its file (not the service's) left alone
        r = c.delete("/items/5", headers=AUTH)
        assert r.json() == {"removed": 5, "file_deleted": False, "items": 23}
        assert world["paths"][5].is_file()
        assert 5 not in [x["id"] for x in c.post("/search", headers=AUTH, data={"item": "6", "k": "30"}).json()["results"]]
    reopened = GalleryStore.open(store_copy)
    assert reopened.rows([5, 24]) == [None, None] and reopened.ntotal == 23


def test_an_upload_is_erased_after_a_restart_with_another_or_no_uploads_folder(world, store_copy, tmp_path):
    uploads = tmp_path / "uploads"
    with client_for(world, store_copy, uploads=uploads) as c:
        new = [c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(40 + i, 1, 0)),
                                                              "image/png")}).json()["id"] for i in range(3)]

    def saved() -> list[str]:
        return sorted(p.name for p in uploads.iterdir() if not p.name.startswith("."))

    assert len(saved()) == 3
    with client_for(world, store_copy) as c:  # restarted without --uploads
        assert c.delete(f"/items/{new[0]}", headers=AUTH).json() == {"removed": new[0], "file_deleted": True,
                                                                     "items": 26}
    assert len(saved()) == 2
    with client_for(world, store_copy, uploads=tmp_path / "fresh") as c:  # restarted with another uploads folder
        assert c.delete(f"/items/{new[1]}", headers=AUTH).json()["file_deleted"] is True
    assert len(saved()) == 1

    # files the service did not write are never deleted: a look-alike name outside an uploads folder, a file
    # dropped into the uploads folder by hand
    lookalike = write_png(tmp_path / "mine" / f"{'ab' * 16}.png", person_image(50, 0, 0))
    dropped = write_png(uploads / "holiday.png", person_image(51, 0, 0))
    store = GalleryStore.open(store_copy)
    features = image_features(world["loaded"], [lookalike, dropped]).features
    others = [int(i) for i in store.add(features, [{"path": str(p)} for p in (lookalike, dropped)])]
    with client_for(world, store_copy, uploads=uploads) as c:
        for item in others:
            assert c.delete(f"/items/{item}", headers=AUTH).json()["file_deleted"] is False, item
        assert c.delete(f"/items/{new[2]}", headers=AUTH).json()["file_deleted"] is True
    assert lookalike.is_file() and dropped.is_file() and saved() == ["holiday.png"]


#: ``POST /items`` in its own process, SIGKILLed between writing the upload's file and the store's save.
KILLED_ADD = """
import os, signal, sys
from pathlib import Path
from fastapi.testclient import TestClient
from fedreid.inference.model_io import load_model
from fedreid.retrieval import service as svc
from fedreid.retrieval.store import GalleryStore
store, run, uploads, image = sys.argv[1:5]
app = svc.create_app(store, load_model(run, "cpu"), token=None, insecure_local=True, uploads=uploads)
GalleryStore.add = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
TestClient(app, base_url="http://127.0.0.1").post("/items", files={"image": ("p.png", Path(image).read_bytes(),
                                                                             "image/png")})
raise SystemExit("not killed")
"""


def test_uploads_a_killed_add_or_removal_left_are_deleted_at_the_next_update_or_start(world, store_copy, tmp_path,
                                                                                      monkeypatch):
    import signal
    import subprocess
    import sys

    uploads = tmp_path / "uploads"
    with client_for(world, store_copy, uploads=uploads) as c:
        ids = [c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(60 + i, 1, 0)),
                                                                "image/png")}).json()["id"] for i in range(2)]
    store = GalleryStore.open(store_copy)
    kept, erased = (Path(row["path"]) for row in store.rows(ids))
    assert kept.parent == erased.parent == uploads.resolve() and kept.is_file() and erased.is_file()

    # the user's files in and beside the uploads folder, none of them the service's uploads; the look-alikes
    # outside it (a file, a link's target) are what a sweep that trusted names alone would delete
    outside = tmp_path / "mine"
    lookalike = write_png(outside / f"{'ab' * 16}.png", person_image(70, 0, 0))
    linked = write_png(outside / "target.png", person_image(71, 0, 0))
    mine = [write_png(uploads / "holiday.png", person_image(72, 0, 0)), uploads / "notes.txt", uploads / f"{'cd' * 16}.png"]
    mine[1].write_text("mine")
    mine[2].mkdir()
    link = uploads / f"{'ef' * 16}.png"
    link.symlink_to(linked)

    with client_for(world, store_copy, uploads=uploads) as c:
        # a removal killed after the store's save, before the file's deletion
        with monkeypatch.context() as m:
            m.setattr(svc, "_delete_upload_file", lambda path, *args: False)
            assert c.delete(f"/items/{ids[1]}", headers=AUTH).json()["file_deleted"] is False
        assert erased.is_file()
        # the next update of the running service deletes it
        added = c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(62, 1, 0)), "image/png")})
        assert added.status_code == 201, added.text
        assert not erased.exists() and kept.is_file()
    third = uploads / added.json()["path"]

    # an add killed between writing its file and the store's save, and one killed while writing its file
    image = write_png(tmp_path / "new.png", person_image(63, 1, 0))
    before = {p.name for p in uploads.iterdir()}
    done = subprocess.run([sys.executable, "-c", KILLED_ADD, str(store_copy), str(world["root"] / "run"),
                           str(uploads), str(image)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    left = [uploads / name for name in {p.name for p in uploads.iterdir()} - before]
    assert len(left) == 1 and left[0].read_bytes() == image.read_bytes()
    temporary = uploads / f".{'12' * 16}.jpg.a1b2c3d_.tmp"
    temporary.write_bytes(b"half an image")
    assert GalleryStore.open(store_copy).ntotal == 24 + 2

    with client_for(world, store_copy, uploads=uploads) as c:  # the restart deletes both
        assert c.get("/info", headers=AUTH).json()["items"] == 26
    assert not left[0].exists() and not temporary.exists()
    assert kept.read_bytes() == png_bytes(person_image(60, 1, 0)) and third.read_bytes() == png_bytes(person_image(62, 1, 0))
    assert mine[0].is_file() and mine[1].read_text() == "mine" and mine[2].is_dir() and link.is_symlink()
    assert linked.is_file() and lookalike.is_file() and (uploads / ".fedreid-uploads.json").is_file()
    assert sorted(p.name for p in uploads.iterdir()) == sorted(
        [".fedreid-uploads.json", kept.name, third.name, *(p.name for p in mine), link.name])


def test_a_sweep_keeps_uploads_held_under_a_moved_folder_or_too_many_to_be_leftovers(world, store_copy, tmp_path):
    uploads = tmp_path / "uploads"
    with client_for(world, store_copy, uploads=uploads) as c:
        for i in range(2):
            c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(80 + i, 1, 0)), "image/png")})
    moved = tmp_path / "moved"
    uploads.rename(moved)
    saved = sorted(p.name for p in moved.iterdir() if not p.name.startswith("."))
    assert len(saved) == 2
    with client_for(world, store_copy, uploads=moved) as c:  # the store still names the folder's earlier path
        assert c.post("/search", headers=AUTH, data={"item": "0", "k": "3"}).status_code == 200
        assert c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(82, 1, 0)),
                                                              "image/png")}).status_code == 201
    assert set(saved) < {p.name for p in moved.iterdir()}

    # more uploads than kills leave (say, the store replaced by an older copy): none is deleted, and a warning
    foreign = [write_png(moved / f"{i:032x}.png", person_image(90 + i, 0, 0)) for i in range(svc.SWEEP_LIMIT + 1)]
    warnings: list[str] = []
    with client_for(world, store_copy, uploads=moved, warn=warnings.append) as c:
        assert c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(83, 1, 0)),
                                                              "image/png")}).status_code == 201
    assert all(p.is_file() for p in foreign)
    assert len(warnings) == 1 and f"holds {len(saved) + svc.SWEEP_LIMIT + 1} uploads that store" in warnings[0], warnings
    assert "none was deleted" in warnings[0]


def test_an_upload_records_its_precision_as_index_add_does(world, tmp_path):
    from fedreid.retrieval.folders import add_to_gallery_store, build_gallery_store

    new = write_png(tmp_path / "new" / "0020_c1_900.png", person_image(20, 1, 0))
    gallery = world["root"] / "gallery"
    for amp, built in ((True, "fp16"), (False, "fp32")):  # amp: as `index` on CUDA records it
        store = tmp_path / f"store_{built}"
        if amp:
            with pytest.warns(UserWarning, match="amp ignored"):  # on the CPU; the header records it all the same
                build_gallery_store(world["loaded"], gallery, store, amp=amp)
        else:
            build_gallery_store(world["loaded"], gallery, store, amp=amp)
        assert GalleryStore.open(store).header["meta"]["precision"] == built
        shutil.copytree(store, tmp_path / f"added_{built}")
        add_to_gallery_store(world["loaded"], tmp_path / f"added_{built}", new.parent)  # `index --add` of fp32 features
        expected = GalleryStore.open(tmp_path / f"added_{built}").header["meta"]["precision"]
        with client_for(world, store, uploads=tmp_path / f"up_{built}") as c:
            r = c.post("/items", headers=AUTH, files={"image": ("p.png", new.read_bytes(), "image/png")})
            assert r.status_code == 201, r.text
        assert GalleryStore.open(store).header["meta"]["precision"] == expected == {"fp16": "fp16, fp32",
                                                                                     "fp32": "fp32"}[built]


def test_add_needs_an_uploads_folder_and_a_good_image(world, store_copy, tmp_path):
    with client_for(world, store_copy) as c:
        r = c.post("/items", headers=AUTH, files={"image": ("a.png", png_bytes(person_image(1, 1, 1)), "image/png")})
        assert r.status_code == 403 and "--uploads" in r.json()["error"]
    uploads = tmp_path / "up"
    with client_for(world, store_copy, uploads=uploads) as c:
        for files, data, words in [
            ({"image": ("a.txt", b"text", "text/plain")}, {}, "not an image"),
            ({"image": ("a.png", png_bytes(person_image(1, 1, 1)), "image/png")}, {"camera": "left"}, "camera must be"),
            ({"image": ("a.png", png_bytes(person_image(1, 1, 1)), "image/png")}, {"path": "/etc/x"}, "unknown field"),
        ]:
            r = c.post("/items", headers=AUTH, files=files, data=data)
            assert r.status_code in (400, 422) and words in r.json()["error"]
        assert c.post("/items", headers=AUTH, data={"camera": "1"}).status_code == 422
        image = {"image": ("a.png", png_bytes(person_image(1, 1, 1)), "image/png")}
        for data, words in [
            ({"timestamp": "1e15"}, "timestamp must be seconds since the epoch or an ISO 8601 date/time from year 1"),
            ({"timestamp": "10000-01-01"}, "timestamp must be seconds since the epoch"),
            ({"identity": "alice"}, "identity must be an integer from -2147483648 to 2147483647, got 'alice'"),
            ({"identity": str(2**70)}, "identity must be an integer"),
            ({"camera": str(2**70)}, "camera must be an integer"),
            ({"site": "s" * 201}, "site must be a name of 1 to 200 characters"),
            ({"site": "north\nsouth"}, "without control characters"),
        ]:
            r = c.post("/items", headers=AUTH, files=image, data=data)
            assert r.status_code == 422 and words in r.json()["error"], (data, r.text)
            assert "\n" not in r.json()["error"]
        assert c.get("/info", headers=AUTH).json()["items"] == 24
    assert [p for p in uploads.iterdir() if not p.name.startswith(".fedreid")] == []


def test_an_update_by_another_process_is_picked_up_or_refused(world, store_copy, tmp_path):
    new = person_image(30, 2, 0)
    query = {"image": ("q.png", png_bytes(new), "image/png")}
    with client_for(world, store_copy) as c:
        assert c.get("/info", headers=AUTH).json()["items"] == 24
        outside = GalleryStore.open(store_copy)  # as `index --add` / `--remove` in another process would
        extra = write_png(tmp_path / "extra" / "0030_c3_900.png", new)
        feats = image_features(world["loaded"], [extra], batch_size=1).features
        outside.add(feats, [{"path": str(extra), "camera": 2, "site": "west"}])
        outside.remove([3])
        assert c.get("/info", headers=AUTH).json()["items"] == 24
        found = c.post("/search", headers=AUTH, files=query, data={"k": "30"}).json()["results"]
        assert found[0]["id"] == 24 and found[0]["path"] == extra.name and 3 not in [x["id"] for x in found]
        assert c.get("/items/3", headers=AUTH).status_code == 404
        assert c.delete("/items/24", headers=AUTH).json()["items"] == 23  # the service writes the reopened store

        other = load_model(save_tiny_model(tmp_path / "other", seed=1), "cpu")
        build_store(store_copy, other, world["paths"], world["rows"])  # rebuilt from another model
        r = c.post("/search", headers=AUTH, files=query, data={"k": "3"})
        assert r.status_code == 503 and "another model" in r.json()["error"]


def _outside_rows(tag: str, n: int = 1) -> list[dict]:
    return [{"path": f"/elsewhere/{tag}_{i}.png", "camera": 1} for i in range(n)]


def _unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_a_search_reads_one_save_while_another_process_saves(world, store_copy, monkeypatch):
    """The table is read after another process's save replaced it (a removal of a hit): the search is repeated."""
    rows_of = GalleryStore.rows
    removed: list[int] = []

    def rows_after_a_removal(self, ids):
        if not removed and len(ids) > 1:
            removed.append(int(ids[1]))
            GalleryStore.open(store_copy).remove([removed[0]])  # as `index --remove` in another process
        return rows_of(self, ids)

    with client_for(world, store_copy) as c:
        monkeypatch.setattr(GalleryStore, "rows", rows_after_a_removal)
        r = c.post("/search", headers=AUTH, data={"item": "0", "k": "5"})
        assert r.status_code == 200, r.text
        got = [x["id"] for x in r.json()["results"]]
        assert removed and len(got) == 5 and removed[0] not in got and got[0] == 0


def test_a_search_between_the_two_renames_of_a_save_is_repeated(world, store_copy, monkeypatch):
    """SQLite finds no store folder (another process's save is between its renames): no 500, the search is repeated."""
    rows_of = GalleryStore.rows
    aside = store_copy.with_name(".store.old-test")
    feature = _unit_rows(1, GalleryStore.open(store_copy).dim, 3)
    calls: list[int] = []

    def rows_mid_swap(self, ids):
        calls.append(len(ids))
        if len(calls) > 1:
            return rows_of(self, ids)
        os.replace(store_copy, aside)
        try:
            return rows_of(self, ids)
        finally:
            os.replace(aside, store_copy)
            GalleryStore.open(store_copy).add(feature, _outside_rows("mid"))  # the save completes: a new version

    with client_for(world, store_copy) as c:
        monkeypatch.setattr(GalleryStore, "rows", rows_mid_swap)
        r = c.post("/search", headers=AUTH, data={"item": "0", "k": "30"})
        assert r.status_code == 200, r.text
        assert len(calls) == 2 and sorted(x["id"] for x in r.json()["results"]) == list(range(25))


def test_a_reopen_that_meets_the_next_save_is_repeated_and_errors_name_no_server_folder(world, store_copy, tmp_path,
                                                                                        monkeypatch):
    from fedreid.retrieval import store as store_module

    check_file = store_module._check_file
    outside = GalleryStore.open(store_copy)
    dim = outside.dim
    with client_for(world, store_copy) as c:
        outside.add(_unit_rows(1, dim, 1), _outside_rows("first"))  # the service must reopen the store
        saved_again: list[bool] = []

        def check_during_the_next_save(folder, name, header):
            if not saved_again:  # a second save lands after the service read the first one's header
                saved_again.append(True)
                outside.add(_unit_rows(1, dim, 2), _outside_rows("second"))
            return check_file(folder, name, header)

        monkeypatch.setattr(store_module, "_check_file", check_during_the_next_save)
        r = c.post("/search", headers=AUTH, data={"item": "25", "k": "3"})
        assert r.status_code == 200 and r.json()["results"][0]["id"] == 25, r.text
        monkeypatch.setattr(store_module, "_check_file", check_file)

        outside.add(_unit_rows(1, dim, 4), _outside_rows("third"))
        vectors = store_copy / outside.segments[-1].files["vectors"]  # the third add's segment (seg-<n>.vectors.npy)
        data = bytearray(vectors.read_bytes())
        data[-1] ^= 0xFF
        vectors.write_bytes(bytes(data))  # now damaged for good: a 503 that names no server folder
        r = c.post("/search", headers=AUTH, data={"item": "0", "k": "3"})
        error = r.json()["error"]
        assert r.status_code == 503 and "vectors.npy" in error and "header.json" in error, error
        assert str(tmp_path) not in error and "\n" not in error


def test_uploads_are_not_refused_while_another_process_updates_the_store(world, store_copy, tmp_path):
    """A second process adds and removes items all along: every upload and search still succeeds."""
    import subprocess
    import sys

    done, ready = tmp_path / "stop", tmp_path / "ready"
    outside = subprocess.Popen([sys.executable, "-c", f"""
import numpy as np, pathlib, time
from fedreid.retrieval.store import GalleryStore, GalleryStoreError
folder, stop = pathlib.Path({str(store_copy)!r}), pathlib.Path({str(done)!r})

def reopen():
    while True:
        try:
            return GalleryStore.open(folder)
        except (GalleryStoreError, OSError):  # opened while the service saved: as a user would, try again
            pass

store, cycles, rng = reopen(), 0, np.random.default_rng(0)
while not stop.exists():
    x = rng.standard_normal((1, store.dim)).astype(np.float32)
    try:
        new = store.add(x / np.linalg.norm(x), [{{"path": f"/elsewhere/o{{cycles}}.png"}}])
        store.remove(new)
        cycles += 1
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(0.01)  # a tight loop would starve the service's polling wait for the update lock
    except GalleryStoreError:  # the service saved meanwhile: as a user would, open it again
        store = reopen()
print(cycles)
"""], stdout=subprocess.PIPE, text=True)
    failures: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and outside.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the outside updater did not start"
        with client_for(world, store_copy, uploads=tmp_path / "up") as c:
            def searcher() -> None:
                for i in range(12):
                    r = c.post("/search", headers=AUTH, data={"item": str(i), "k": "5"})
                    if r.status_code != 200 or len(r.json()["results"]) != 5:
                        failures.append(f"search {r.status_code} {r.text}")

            thread = threading.Thread(target=searcher)
            thread.start()
            for i in range(12):
                image = {"image": ("n.png", png_bytes(person_image(40 + i, i % 3, 0)), "image/png")}
                r = c.post("/items", headers=AUTH, files=image)
                if r.status_code != 201:
                    failures.append(f"upload {r.status_code} {r.text}")
                elif i % 2 and c.delete(f"/items/{r.json()['id']}", headers=AUTH).status_code != 200:
                    failures.append("delete failed")
            thread.join()
    finally:
        done.touch()
        cycles = int(outside.communicate(timeout=120)[0])
    assert failures == [] and cycles > 0
    final = GalleryStore.open(store_copy)
    assert sum(not r["path"].startswith("/elsewhere/") for r in final.rows(final.ids)) == 24 + 6


def test_uploads_folder_must_be_the_services_own(world, store_copy, tmp_path):
    with pytest.raises(svc.ServiceError, match="must not contain one another"):
        client_for(world, store_copy, uploads=store_copy / "up")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(OutputDirError, match="holiday.jpg"):
        client_for(world, store_copy, uploads=foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["holiday.jpg"]


def test_an_uploads_folder_serves_one_store_only(world, store_copy, tmp_path):
    """A sweep deletes the uploads its store does not hold: another store's uploads must never be in its folder."""
    from fedreid.utils.io import marker_path

    uploads = tmp_path / "uploads"
    with client_for(world, store_copy, uploads=uploads) as c:
        added = c.post("/items", headers=AUTH, files={"image": ("p.png", png_bytes(person_image(70, 1, 0)),
                                                                "image/png")}).json()
    marker = marker_path(uploads, svc.UPLOADS_KIND)
    assert json.loads(marker.read_text())[svc.UPLOADS_STORE_KEY] == os.path.realpath(store_copy)
    other = tmp_path / "other_store"
    shutil.copytree(world["store"], other)  # a store that does not hold that upload
    before = {p.name: p.read_bytes() for p in uploads.iterdir()}
    with pytest.raises(svc.ServiceError) as refused:
        client_for(world, other, uploads=uploads)
    assert str(uploads) in str(refused.value) and os.path.realpath(store_copy) in str(refused.value)
    assert "give each store its own uploads folder" in str(refused.value)
    assert {p.name: p.read_bytes() for p in uploads.iterdir()} == before  # the upload and the marker untouched
    assert (uploads / Path(added["path"]).name).is_file()

    # a marker of an earlier version names no store: the first start binds it; removing the entry rebinds
    record = json.loads(marker.read_text())
    del record[svc.UPLOADS_STORE_KEY]
    marker.write_text(json.dumps(record))
    with client_for(world, store_copy, uploads=uploads):
        pass
    assert json.loads(marker.read_text())[svc.UPLOADS_STORE_KEY] == os.path.realpath(store_copy)


def test_searches_run_while_items_are_added_and_removed(world, store_copy, tmp_path):
    errors: list[str] = []
    with client_for(world, store_copy, uploads=tmp_path / "up") as c:
        def searcher(seed: int) -> None:
            for i in range(6):
                r = c.post("/search", headers=AUTH, data={"item": str((seed + i) % 20), "k": "5"})
                if r.status_code != 200 or len(r.json()["results"]) != 5:
                    errors.append(r.text)

        def writer() -> None:
            for i in range(3):
                r = c.post("/items", headers=AUTH,
                           files={"image": ("n.png", png_bytes(person_image(30 + i, 0, 0)), "image/png")})
                if r.status_code != 201:
                    errors.append(r.text)
                    continue
                if c.delete(f"/items/{r.json()['id']}", headers=AUTH).status_code != 200:
                    errors.append("delete failed")

        threads = [threading.Thread(target=searcher, args=(s,)) for s in range(4)] + [threading.Thread(target=writer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert c.get("/info", headers=AUTH).json()["items"] == 24


# --------------------------------------------------------------------------
# Starting
# --------------------------------------------------------------------------


def test_start_is_refused_without_a_token_unless_insecure_local(world):
    with pytest.raises(svc.ServiceError, match="no token"):
        svc.create_app(world["store"], world["loaded"], token=None)
    with pytest.raises(svc.ServiceError, match="at least 16"):
        svc.create_app(world["store"], world["loaded"], token="short")
    assert svc.check_serve_security("127.0.0.1", None, True) is None
    assert svc.check_serve_security("localhost", None, True) is None
    assert svc.check_serve_security("::1", None, True) is None
    assert svc.check_serve_security("0.0.0.0", TOKEN, False) == TOKEN
    for host in ("0.0.0.0", "192.168.1.5", "example.org", "::"):
        with pytest.raises(svc.ServiceError, match="loopback"):
            svc.check_serve_security(host, None, True)
    with pytest.raises(svc.ServiceError, match="no token"):
        svc.check_serve_security("127.0.0.1", None, False)
    with pytest.raises(svc.ServiceError, match="drop it"):
        svc.check_serve_security("127.0.0.1", TOKEN, True)
    with pytest.raises(svc.ServiceError, match="blanks"):
        svc.check_serve_security("127.0.0.1", f" {TOKEN}", False)
    # insecure-local: no authentication at all (for requests to a loopback name)
    with TestClient(svc.create_app(world["store"], world["loaded"], token=None, insecure_local=True),
                    base_url="http://127.0.0.1:8000") as c:
        assert c.post("/search", data={"item": "1", "k": "2"}).status_code == 200


def test_insecure_local_answers_only_requests_for_a_loopback_name(world, store_copy):
    app = svc.create_app(store_copy, world["loaded"], token=None, insecure_local=True)
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        r = c.get("/items/0/image", headers={"Host": "rebind.attacker.example"})  # DNS rebinding
        assert r.status_code == 421 and r.headers["x-content-type-options"] == "nosniff"
        error = r.json()["error"]
        assert "'rebind.attacker.example' is not a loopback name" in error and "\n" not in error
        for host in ("rebind.attacker.example:8000", "127.0.0.1.nip.io:8000", "localhost.attacker.example",
                     "10.0.0.1:8000", "0.0.0.0:8000", "user@127.0.0.1:8000", "127.0.0.1:80x", "[::2]:8000"):
            for method, path in (("get", "/items/0"), ("get", "/"), ("delete", "/items/0"), ("get", "/info")):
                r = getattr(c, method)(path, headers={"Host": host})
                assert r.status_code == 421, (host, method, path, r.status_code)
        assert GalleryStore.open(store_copy).ntotal == 24  # nothing was erased
        for host in ("127.0.0.1:8000", "127.0.0.1", "localhost:8000", "LocalHost", "[::1]:8000", "127.0.0.2:8000"):
            assert c.get("/items/0", headers={"Host": host}).status_code == 200, host
        assert c.get("/items/0/image").content == world["paths"][0].read_bytes()


def test_cross_origin_changes_are_refused_with_or_without_a_token(world, store_copy, tmp_path):
    image = {"image": ("a.png", png_bytes(person_image(21, 1, 0)), "image/png")}
    foreign = ("http://evil.example", "null", "http://127.0.0.1:9999", "http://127.0.0.1",
               "http://localhost:8000", "http://127.0.0.1:8000.evil.example", "file://")
    with client_for(world, store_copy, uploads=tmp_path / "up") as c:
        for origin in ("http://evil.example", "null", "http://testserver:8080"):
            with_origin = {**AUTH, "Origin": origin}
            r = c.post("/items", headers=with_origin, files=image)
            assert r.status_code == 403 and "cross-origin POST refused" in r.json()["error"], (origin, r.text)
            assert c.delete("/items/0", headers=with_origin).status_code == 403
            assert c.post("/search", headers=with_origin, data={"item": "1"}).status_code == 403
            assert c.get("/items/0", headers=with_origin).status_code == 200  # reads are not refused by Origin
        assert c.get("/info", headers=AUTH).json()["items"] == 24
        assert c.post("/search", headers={**AUTH, "Origin": "http://testserver"}, data={"item": "1"}).status_code == 200
        assert c.post("/search", headers=AUTH, data={"item": "1"}).status_code == 200  # no Origin: curl, scripts
    app = svc.create_app(store_copy, world["loaded"], token=None, insecure_local=True, uploads=tmp_path / "up")
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        for origin in foreign:
            r = c.post("/items", headers={"Origin": origin}, files=image)
            assert r.status_code == 403 and "cross-origin" in r.json()["error"], (origin, r.text)
            assert c.delete("/items/0", headers={"Origin": origin}).status_code == 403
        assert c.get("/info").json()["items"] == 24
        r = c.post("/items", headers={"Origin": "http://127.0.0.1:8000"}, files=image)  # the service's own page
        assert r.status_code == 201, r.text
        assert c.delete(f"/items/{r.json()['id']}", headers={"Origin": "http://127.0.0.1:8000"}).status_code == 200


def _serve_args(world, **over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_serve_arguments(parser)
    args = parser.parse_args(["--model", str(world["root"] / "run"), "--index", str(world["store"])])
    for key, value in over.items():
        setattr(args, key, value)
    return args


def test_run_serve_refuses_before_loading_anything(world, monkeypatch, tmp_path):
    monkeypatch.delenv(svc.TOKEN_ENV, raising=False)

    def no_load(args, device):
        raise AssertionError("the model must not be loaded before the security checks")

    with pytest.raises(svc.ServiceError, match="no token"):
        serve_cmd.run_serve(_serve_args(world), load=no_load)
    with pytest.raises(svc.ServiceError, match="loopback"):
        serve_cmd.run_serve(_serve_args(world, host="0.0.0.0", insecure_local=True), load=no_load)
    with pytest.raises(svc.ServiceError, match="at least 16"):
        serve_cmd.run_serve(_serve_args(world, token="abc"), load=no_load)
    monkeypatch.setenv(svc.TOKEN_ENV, "abc")  # the environment's token is checked the same way
    with pytest.raises(svc.ServiceError, match="at least 16"):
        serve_cmd.run_serve(_serve_args(world), load=no_load)
    token_file = tmp_path / "token"
    token_file.write_text("tiny\n")
    with pytest.raises(svc.ServiceError, match="at least 16"):
        serve_cmd.run_serve(_serve_args(world, token_file=str(token_file)), load=no_load)
    with pytest.raises(svc.ServiceError, match="not both"):
        serve_cmd.run_serve(_serve_args(world, token=TOKEN, token_file=str(token_file)), load=no_load)


@pytest.mark.parametrize("option,value,words", [
    ("max_upload_mb", float("inf"), "--max-upload-mb must be a finite number of MiB of at least one byte"),
    ("max_upload_mb", 1e-9, "--max-upload-mb must be a finite number of MiB of at least one byte"),
    ("max_k", 0, "--max-k must be an integer >= 1, got 0"),
    ("max_pixels", 0, "--max-pixels must be an integer >= 1, got 0"),
    ("max_decodes", 0, "--max-decodes must be an integer >= 1, got 0"),
])
def test_bad_serve_limits_are_refused_before_the_model_loads(world, option, value, words):
    def no_load(args, device):
        raise AssertionError("the model must not be loaded before the options are checked")

    with pytest.raises(svc.ServiceError) as refused:
        serve_cmd.run_serve(_serve_args(world, token=TOKEN, **{option: value}), load=no_load)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_serve_passes_max_decodes_to_the_service(world, monkeypatch):
    """--max-decodes N: the service decodes at most N uploads at once (its semaphore holds N)."""
    served = []
    monkeypatch.setattr(serve_cmd, "run_server", lambda app, **kw: served.append(app))
    loaded = load_model(world["root"] / "run", "cpu")
    args = _serve_args(world, token=TOKEN, max_decodes=3, device="cpu")
    assert serve_cmd.run_serve(args, load=lambda a, device: loaded) == 0
    semaphore = served[0].state.service.decodes
    assert [semaphore.acquire(blocking=False) for _ in range(4)] == [True, True, True, False]
    parser = argparse.ArgumentParser()
    serve_cmd.add_serve_arguments(parser)
    assert parser.parse_args(["--model", "m", "--index", "i"]).max_decodes == svc.DEFAULT_MAX_DECODES


def test_a_store_of_another_model_is_refused(world, tmp_path):
    other = load_model(save_tiny_model(tmp_path / "other", seed=1), "cpu")
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        svc.create_app(world["store"], other, token=TOKEN)
    warnings: list[str] = []
    app = svc.create_app(world["store"], other, token=TOKEN, allow_model_mismatch=True, warn=warnings.append)
    assert app.state.service.store.ntotal == 24 and "another model" in warnings[0]


def test_another_models_features_are_never_added(world, store_copy, tmp_path):
    """--allow-model-mismatch lets another model search; POST /items stays refused, and nothing is kept."""
    other = load_model(save_tiny_model(tmp_path / "other", seed=1), "cpu")
    header = (store_copy / "header.json").read_bytes()
    app = svc.create_app(store_copy, other, token=TOKEN, allow_model_mismatch=True, warn=lambda _: None,
                         uploads=tmp_path / "up")
    uploads = sorted((tmp_path / "up").iterdir())  # the folder's own marker
    with TestClient(app) as c:
        image = world["paths"][0].read_bytes()
        assert c.post("/search", headers=AUTH, files={"image": ("q.png", image, "image/png")}).status_code == 200
        r = c.post("/items", headers=AUTH, files={"image": ("new.png", image, "image/png")})
    assert r.status_code == 409 and "store's own model" in r.json()["error"]
    assert (store_copy / "header.json").read_bytes() == header
    assert sorted((tmp_path / "up").iterdir()) == uploads, "the upload is not kept"


def test_exported_onnx_model_serves_the_same_way(world, tmp_path):
    pytest.importorskip("onnxruntime")
    from fedreid.inference.export import export_model, load_exported_model

    onnx = load_exported_model(export_model(world["loaded"], tmp_path / "m.onnx", "onnx", (HEIGHT, WIDTH)))
    paths = world["paths"][:9]
    build_store(tmp_path / "st", onnx, paths, world["rows"][:9])
    with TestClient(svc.create_app(tmp_path / "st", onnx, token=TOKEN)) as c:
        r = c.post("/search", headers=AUTH, files={"image": ("q.png", paths[4].read_bytes(), "image/png")},
                   data={"k": "3"})
        assert r.status_code == 200 and r.json()["results"][0]["id"] == 4
        assert c.get("/info", headers=AUTH).json()["model"]["backend"] == "onnx"
    # the PyTorch model of the exported weights computes the same features: it serves that store too
    with TestClient(svc.create_app(tmp_path / "st", world["loaded"], token=TOKEN)) as c:
        r = c.post("/search", headers=AUTH, files={"image": ("q.png", paths[4].read_bytes(), "image/png")},
                   data={"k": "3"})
        assert r.status_code == 200 and r.json()["results"][0]["id"] == 4
    other = load_model(save_tiny_model(tmp_path / "other", seed=1), "cpu")
    with pytest.raises(ModelMismatchError, match="weights_sha256"):  # another model still is refused
        svc.create_app(tmp_path / "st", other, token=TOKEN)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_eval_reid_serve_runs_the_service_in_its_own_process(world, tmp_path):
    """``tools/eval_reid.py serve`` as a user starts it: a token file, a real port, a search over HTTP."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    tool = Path(__file__).resolve().parents[2] / "tools" / "eval_reid.py"
    env = {k: v for k, v in os.environ.items() if k != svc.TOKEN_ENV}
    proc = subprocess.Popen(
        [sys.executable, str(tool), "serve", "--model", str(world["root"] / "run"), "--index", str(world["store"]),
         "--port", str(port), "--token-file", str(token_file), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        base, info = f"http://127.0.0.1:{port}", None
        deadline = time.monotonic() + 120
        while info is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                info = httpx.get(f"{base}/info", headers=AUTH, timeout=5)
            except httpx.TransportError:
                time.sleep(0.5)
        assert info is not None and info.status_code == 200 and info.json()["items"] == 24
        assert httpx.get(f"{base}/info", timeout=5).status_code == 401
        found = httpx.post(f"{base}/search", data={"item": "5", "k": "3"}, headers=AUTH, timeout=30).json()
        assert [r["rank"] for r in found["results"]] == [1, 2, 3] and found["results"][0]["id"] == 5
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert f"at http://127.0.0.1:{port}/" in out
