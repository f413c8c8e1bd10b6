"""``--backend onnx`` where PyTorch cannot be imported: index, add, remove, query, serve, help.

Each check runs ``tools/eval_reid.py`` (or the service) in a subprocess whose
first act is to put a finder on ``sys.meta_path`` that refuses ``torch`` and
``torchvision`` (ImportError, as on a machine without them), and whose last
is to assert that no torch module was imported. Its stores and rankings are
compared with the same commands run here, where torch is available, and its
features with those of the tensor pipeline the ONNX path used before it
became torch-free (``read_image`` + ``build_test_transform`` + a stacked
tensor batch into the extractor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from tiny_runs import save_tiny_run
from tool_loader import load_tool

from fedreid.data.datasets import read_image
from fedreid.data.transforms import build_test_transform
from fedreid.inference.export import export_model, load_exported_model
from fedreid.inference.model_io import load_model
from fedreid.retrieval.store import GalleryStore

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "eval_reid.py"
HEIGHT, WIDTH = 64, 32
TOKEN = "test-token-0123456789abcdef"
tool = load_tool("eval_reid", "eval_reid_tool")

NO_TORCH = """\
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "torchvision"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

sys.meta_path.insert(0, _NoTorch())
"""
NO_TORCH_END = """
_torch = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "torchvision"))
assert not _torch, f"torch was imported: {_torch[:5]}"
sys.exit(globals().get("_code", 0))
"""


def run_without_torch(body: str) -> subprocess.CompletedProcess:
    """``body`` (Python) in a fresh interpreter that cannot import torch, then a check that none was imported.

    The process exits with ``_code`` when ``body`` sets it (else 0), or 1 when torch got imported.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("FEDREID_SERVE_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", NO_TORCH + body + NO_TORCH_END], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "torch was imported" not in done.stderr, done.stderr
    return done


def tool_without_torch(argv: list[str]) -> subprocess.CompletedProcess:
    """``tools/eval_reid.py ARGV`` without torch; the process exits with the tool's exit code."""
    return run_without_torch(f"""
import runpy
sys.argv = {[str(TOOL), *argv]!r}
try:
    runpy.run_path({str(TOOL)!r}, run_name="__main__")
    _code = 0
except SystemExit as exc:
    _code = exc.code
""")


def tool_here(argv: list[str], capsys) -> str:
    """``tools/eval_reid.py ARGV`` in this process (torch available); its stdout."""
    capsys.readouterr()
    assert tool.main(argv) == 0
    return capsys.readouterr().out


def picture(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    h, w = 70 + seed % 9, 30 + seed % 5  # not the model's size: the transform resizes
    img = np.full((h, w, 3), rng.integers(40, 200, 3), dtype=np.uint8)
    cv2.rectangle(img, (w // 4, h // 6), (3 * w // 4, h // 2), [int(v) for v in rng.integers(0, 256, 3)], -1)
    cv2.rectangle(img, (w // 4, h // 2), (3 * w // 4, 7 * h // 8), [int(v) for v in rng.integers(0, 256, 3)], -1)
    return np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)


def write_pictures(folder: Path, names: list[str], first_seed: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, name in enumerate(names):
        paths.append(folder / name)
        assert cv2.imwrite(str(paths[-1]), picture(first_seed + k))
    return paths


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny resnet18 run exported to ONNX, a gallery (8 images and a corrupt one), more images, queries."""
    root = tmp_path_factory.mktemp("no_torch")
    run = save_tiny_run(root / "run", HEIGHT, WIDTH)
    onnx = export_model(load_model(run), root / "m.onnx", "onnx", (HEIGHT, WIDTH))
    gallery = write_pictures(root / "gallery", [f"{pid:04d}_c{cam}_{k:03d}.png" for k, (pid, cam) in enumerate(
        (pid, cam) for pid in range(1, 5) for cam in (1, 2))], 0)
    (root / "gallery" / "0009_c1_008.png").write_bytes(b"not a picture")
    more = write_pictures(root / "more", ["0005_c1_100.png", "0005_c2_101.png", "0006_c1_102.png"], 100)
    write_pictures(root / "query", ["0001_c2_900.png", "0003_c1_901.png", "0005_c2_902.png"], 200)
    return {"root": root, "run": run, "onnx": onnx, "gallery": gallery, "more": more}


def reference_features(onnx: Path, paths: list[Path]) -> dict[str, np.ndarray]:
    """{path: feature} as the ONNX path computed them with torch: tensor transform, stacked batch, extractor."""
    transform = build_test_transform(HEIGHT, WIDTH)
    batch = torch.stack([transform(read_image(p)) for p in paths])
    return dict(zip((str(p) for p in paths), load_exported_model(onnx).extractor(batch)))


def store_contents(folder: Path) -> tuple[np.ndarray, np.ndarray, list]:
    store = GalleryStore.open(folder)
    return store.ids.copy(), np.array(store.vectors), store.rows(store.ids)


def assert_same_stores(without: Path, here: Path) -> None:
    ids_a, vectors_a, rows_a = store_contents(without)
    ids_b, vectors_b, rows_b = store_contents(here)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_allclose(vectors_a, vectors_b, rtol=0, atol=1e-6)
    assert rows_a == rows_b
    assert (without / "skipped.csv").read_text() == (here / "skipped.csv").read_text()


def test_help_without_torch():
    for argv in ([], ["index"], ["query"], ["serve"]):
        done = tool_without_torch([*argv, "--help"])
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    assert "--backend" in done.stdout


def test_index_add_remove_and_query_match_the_torch_process(world, tmp_path, capsys):
    onnx, root = str(world["onnx"]), world["root"]
    without, here = tmp_path / "without", tmp_path / "here"

    build = ["index", "--model", onnx, "--backend", "onnx", "--gallery", str(root / "gallery"),
             "--skip-bad-images", "--site", "lobby", "--verify"]
    done = tool_without_torch([*build, "--index", str(without)])
    assert done.returncode == 0, done.stderr
    assert "indexed 8 images" in done.stdout and "skipped 1 unreadable images" in done.stdout
    tool_here([*build, "--index", str(here)], capsys)
    assert_same_stores(without, here)
    assert "0009_c1_008.png" in (without / "skipped.csv").read_text()

    # Without --skip-bad-images the corrupt file stops the build, with today's words.
    done = tool_without_torch(["index", "--model", onnx, "--backend", "onnx", "--gallery", str(root / "gallery"),
                               "--index", str(tmp_path / "refused")])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot decode image" in done.stderr and "pass --skip-bad-images" in done.stderr

    add = ["index", "--model", onnx, "--backend", "onnx", "--add", str(root / "more")]
    remove = ["index", "--remove", "0002_c1_002.png"]
    for argv in (add, remove):
        done = tool_without_torch([*argv, "--index", str(without)])
        assert done.returncode == 0, done.stderr
        tool_here([*argv, "--index", str(here)], capsys)
    assert_same_stores(without, here)

    # The features are the ones the tensor pipeline gives (same batches: the gallery's, then the added ones).
    expected = {**reference_features(world["onnx"], world["gallery"]),
                **reference_features(world["onnx"], world["more"])}
    ids, vectors, rows = store_contents(without)
    assert len(ids) == 10 and all(Path(r["path"]).name != "0002_c1_002.png" for r in rows)
    for vector, row in zip(vectors, rows):
        np.testing.assert_allclose(vector, expected[row["path"]], rtol=0, atol=1e-6)

    query = ["query", "--model", onnx, "--backend", "onnx", "--index", str(without), "--images",
             str(root / "query"), "--top-k", "3", "--cameras", "1,2"]
    done = tool_without_torch([*query, "--out", str(tmp_path / "q_without")])
    assert done.returncode == 0, done.stderr
    printed = tool_here([*query, "--out", str(tmp_path / "q_here")], capsys)
    assert done.stdout.replace(str(tmp_path / "q_without"), "OUT") == printed.replace(str(tmp_path / "q_here"), "OUT")
    assert "pictures: 3 in" in printed and len(list((tmp_path / "q_without").glob("*.png"))) == 3


def test_search_service_without_torch(world, tmp_path):
    from fedreid.retrieval.folders import build_gallery_store

    store = tmp_path / "store"
    build_gallery_store(load_exported_model(world["onnx"]), world["root"] / "gallery", store, skipped=[])
    query = world["root"] / "query" / "0003_c1_901.png"
    feature = reference_features(world["onnx"], [query])[str(query)]
    expected = GalleryStore.open(store).search(feature[None], 5).ids[0].tolist()

    body = f"""
import json, runpy
from fastapi.testclient import TestClient
from fedreid.inference.export import load_feature_model
from fedreid.retrieval.service import create_app

loaded = load_feature_model({str(world["onnx"])!r}, "onnx")
with TestClient(create_app({str(store)!r}, loaded, token={TOKEN!r})) as client:
    reply = client.post("/search", headers={{"Authorization": "Bearer {TOKEN}"}}, data={{"k": "5"}},
                        files={{"image": ("q.png", open({str(query)!r}, "rb").read(), "image/png")}})
    assert reply.status_code == 200, reply.text
    print(json.dumps([r["id"] for r in reply.json()["results"]]))

import uvicorn  # serve's start-up, up to the point where it would listen
uvicorn.run = lambda app, **kwargs: print("would listen", app.state.service.store.ntotal, kwargs["port"])
sys.argv = ["eval_reid.py", "serve", "--backend", "onnx", "--model", {str(world["onnx"])!r},
            "--index", {str(store)!r}, "--token", {TOKEN!r}, "--port", "8765"]
try:
    runpy.run_path({str(TOOL)!r}, run_name="__main__")
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
"""
    done = run_without_torch(body)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert json.loads(lines[0]) == expected and len(expected) == 5
    assert "would listen 8 8765" in lines


def test_pytorch_backend_without_torch_is_one_clear_line(world, tmp_path):
    done = tool_without_torch(["index", "--model", str(world["run"]), "--gallery", str(world["root"] / "gallery"),
                               "--index", str(tmp_path / "idx")])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: PyTorch cannot be imported") and done.stderr.count("\n") == 1
    assert "--backend onnx" in done.stderr and not (tmp_path / "idx").exists()
