"""tools/eval_reid.py index/query on a gallery store: factories, verify/tune, add, remove, filters, metadata CSV."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import sqlite3
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from tool_loader import cli_error, load_tool

from fedreid.config import ModelConfig, to_dict
from fedreid.models.reid import create_reid_model, shared_state
from fedreid.retrieval.store import GalleryStoreError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

tool = load_tool("eval_reid", "eval_reid_tool_index")

T0 = 1_700_000_000  # the gallery's modification times: T0 + i hours for image i
N_GALLERY, N_MORE = 31, 5
LINE = re.compile(
    r"^\s+(?P<rank>\d+)\s+(?P<score>-?[\d.]+)\s+(?P<path>\S+)\s+item=(?P<id>\d+) cam=(?P<cam>\S+) "
    r"site=(?P<site>\S+) time=(?P<time>\S+)(?P<mark> [+-])?$"
)


def _model_file(path: Path, seed: int) -> Path:
    cfg = to_dict(ModelConfig(backbone="test_resnet", bottleneck_dim=16, height=32, width=16))
    model = create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "fedreid.model", "model": cfg, "mode": "fedpav", "round": 1,
                "state": shared_state(model)}, path)
    return path


def _images(folder: Path, names: list[str], rng: np.random.Generator, t_start: int) -> list[Path]:
    out = []
    for k, name in enumerate(names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        assert cv2.imwrite(str(path), rng.integers(0, 256, (32, 16, 3), dtype=np.uint8))
        os.utime(path, (t_start + 3600 * k, t_start + 3600 * k))
        out.append(path)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run (tiny test_resnet), a 31-image Market-style gallery (one name twice, in sub/), 5 more images."""
    root = tmp_path_factory.mktemp("indexcli")
    rng = np.random.default_rng(0)
    names = [f"{i // 3 + 1:04d}_c{i % 3 + 1}s1_{i:06d}_01.png" for i in range(N_GALLERY - 1)] + ["sub/twin.png"]
    gallery = _images(root / "gallery", names, rng, T0)
    _images(root / "gallery", ["twin.png"], rng, T0 - 3600)  # a second twin.png, top level: 32 images in all
    more = _images(root / "more", [f"{50 + i:04d}_c{i % 2 + 1}s2_{i:06d}_01.png" for i in range(N_MORE)], rng,
                   T0 + 100 * 3600)
    run = root / "run"
    _model_file(run / "model_final.pt", seed=0)
    store = root / "store"
    assert tool.main(_index(run, store, "--gallery", root / "gallery", "--site", "north")) == 0
    return {"root": root, "run": run, "gallery": root / "gallery", "images": gallery, "more": more,
            "store": store}


def _index(run, folder, *extra) -> list[str]:
    model = ["--model", str(run)] if run is not None else []
    return ["index", *model, "--index", str(folder), "--device", "cpu", *[str(x) for x in extra]]


def _query(world, folder, images, *extra, top_k=5) -> list[str]:
    return ["query", "--model", str(world["run"]), "--index", str(folder), "--images", str(images),
            "--device", "cpu", "--top-k", str(top_k), *extra]


def _cli_error(argv, capsys) -> str:
    return cli_error(tool, argv, capsys)


def _matches(out: str) -> dict[str, list[dict]]:
    """query's printed results: {query path: [match fields]}."""
    results: dict[str, list[dict]] = {}
    current = None
    for line in out.splitlines():
        if not line.startswith(" "):
            current = results.setdefault(line, [])
            continue
        m = LINE.match(line)
        if m:
            current.append(m.groupdict())
    return results


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _copy_store(world, tmp_path) -> Path:
    folder = tmp_path / "store"
    shutil.copytree(world["store"], folder)
    return folder


def _table(folder: Path) -> list[tuple]:
    out = []
    for table in sorted(folder.glob("seg-*.sqlite")):  # one table per segment
        con = sqlite3.connect(f"file:{table}?mode=ro", uri=True)
        try:
            out += con.execute("SELECT id, path, camera, site, timestamp, identity FROM gallery ORDER BY id").fetchall()
        finally:
            con.close()
    return sorted(out)


# --------------------------------------------------------------------------
# Building: Flat is exact; other factories are verified and tuned
# --------------------------------------------------------------------------


def test_flat_store_ranks_as_exact_search(world, capsys):
    from fedreid.inference.images import image_features, list_images
    from fedreid.inference.model_io import check_index_model, load_model
    from fedreid.retrieval import GalleryStore
    from fedreid.retrieval.exact import build_index, search
    from fedreid.retrieval.folders import query_index

    store = GalleryStore.open(world["store"])
    loaded = load_model(world["run"])
    assert store.factory == "Flat" and store.ntotal == N_GALLERY + 1
    assert check_index_model(store.header, loaded, store.folder) is None  # the fingerprint where it is read
    assert store.header["meta"]["model_fingerprint"] == loaded.fingerprint
    assert store.header["meta"]["precision"] == "fp32"  # the features' arithmetic (fp16 with --amp on CUDA)

    paths = list_images(world["gallery"])
    fs = image_features(loaded, paths)
    scores, rows = search(build_index(fs.features, use_gpu=False), fs.features, 6)
    want = [[str(paths[r].resolve()) for r in row] for row in rows]
    results = query_index(loaded, world["store"], world["gallery"], top_k=6)
    assert [[m["path"] for m in r.matches] for r in results] == want
    np.testing.assert_allclose([[m["score"] for m in r.matches] for r in results], scores, atol=1e-6)

    capsys.readouterr()
    assert tool.main(_query(world, world["store"], world["images"][4], top_k=6)) == 0
    printed = _matches(capsys.readouterr().out)[str(world["images"][4])]
    assert [Path(m["path"]).resolve() for m in printed] == [Path(p) for p in want[4]]
    first = printed[0]
    assert first["rank"] == "1" and first["mark"] == " +" and first["id"] == "4"  # ids in gallery order
    assert (first["cam"], first["site"], first["time"]) == ("2", "north", "2023-11-15T02:13:20Z")


def test_a_transformed_flat_store_answers_true_scores_and_is_not_called_exact(world, tmp_path, capsys):
    """``PCA8,Flat`` is of kind flat but ranks in PCA space: query re-scores its candidates like the service."""
    from fedreid.inference.images import image_features, list_images
    from fedreid.inference.model_io import load_model
    from fedreid.retrieval import GalleryStore
    from fedreid.retrieval.folders import query_index

    folder = tmp_path / "pca"
    capsys.readouterr()
    assert tool.main(_index(world["run"], folder, "--gallery", world["gallery"], "--factory", "PCA8,Flat")) == 0
    assert "store: PCA8,Flat (the index's own search)" in capsys.readouterr().out
    store = GalleryStore.open(folder)
    assert store.kind == "flat" and not store.exact
    with pytest.raises(GalleryStoreError, match="not a bare Flat"):
        store.flat_faiss_index()
    loaded = load_model(world["run"])
    results = query_index(loaded, folder, world["root"] / "more", top_k=5)
    queries = image_features(loaded, list_images(world["root"] / "more")).features
    own = store.search(queries, 5)  # the store's own search, as the service runs it
    for q, result in enumerate(results):
        ids = [m["id"] for m in result.matches]
        assert ids == own.ids[q].tolist()
        true = store.vectors[np.searchsorted(store.ids, ids)] @ queries[q]
        np.testing.assert_allclose([m["score"] for m in result.matches], true, rtol=1e-5, atol=1e-6)


def test_ivf_factory_verify_and_tune_print_and_store_recall(world, tmp_path, capsys):
    folder = tmp_path / "ivf"
    argv = _index(world["run"], folder, "--gallery", world["gallery"], "--factory", "IVF4,Flat", "--verify",
                  "--verify-sample", "20", "--verify-k", "5", "--seed", "1")
    assert tool.main(argv) == 0
    out = capsys.readouterr().out
    assert "store: IVF4,Flat (nprobe=4), 32 items" in out
    recall = float(re.search(r"verify: recall@5 ([\d.]+) against exact search \(nprobe=4; 20 sampled items, "
                             r"seed 1\)", out).group(1))
    header = json.loads((folder / "header.json").read_text())
    assert header["kind"] == "ivf" and header["verify"]["recall"] == pytest.approx(recall, abs=5e-5)
    assert header["verify"]["sample"] == 20 and header["verify"]["k"] == 5 and header["verify"]["seed"] == 1

    assert tool.main(_index(None, folder, "--target-recall", "0.9", "--verify-sample", "20")) == 0  # no model
    out = capsys.readouterr().out
    m = re.search(r"tuned: nprobe=(\d+): recall@10 ([\d.]+) against exact search \(target 0.9, reached", out)
    assert m and float(m.group(2)) >= 0.9
    header = json.loads((folder / "header.json").read_text())
    assert header["search"] == {"nprobe": int(m.group(1))} and header["tuned"]["target_recall"] == 0.9
    assert header["verify"]["recall"] == pytest.approx(float(m.group(2)), abs=5e-5)

    err = _cli_error(_index(world["run"], tmp_path / "big", "--gallery", world["gallery"], "--factory",
                            "IVF64,Flat"), capsys)
    assert "needs at least 64 training vectors" in err and "the gallery has 32 images" in err
    assert not (tmp_path / "big").exists()  # refused from the image count, before extraction or any folder
    err = _cli_error(_index(world["run"], tmp_path / "typo", "--gallery", world["gallery"], "--factory",
                            "IVF4,Flatt"), capsys)
    assert "'IVF4,Flatt'" in err and "could not parse" in err and "such as Flat" in err
    assert not (tmp_path / "typo").exists()  # refused before any work
    err = _cli_error(_index(None, folder, "--target-recall", "1.5"), capsys)
    assert "--target-recall must be in (0, 1]" in err


def test_refine_is_stored_and_applies_to_queries(world, tmp_path, capsys):
    folder = tmp_path / "pq"
    argv = _index(world["run"], folder, "--gallery", world["gallery"], "--factory", "IVF2,PQ4x2", "--refine", "8")
    assert tool.main(argv) == 0
    assert "store: IVF2,PQ4x2 (nprobe=2, refine=8), 32 items" in capsys.readouterr().out
    assert json.loads((folder / "header.json").read_text())["search"] == {"nprobe": 2, "refine": 8}
    assert tool.main(_query(world, folder, world["gallery"] / sorted(os.listdir(world["gallery"]))[0])) == 0
    scores = [m["score"] for ms in _matches(capsys.readouterr().out).values() for m in ms]
    assert float(scores[0]) == pytest.approx(1.0, abs=1e-4)  # exact re-scoring: the image itself, at its exact score
    err = _cli_error(_index(None, folder, "--remove", "1", "--refine", "4"), capsys)
    assert "--refine R (R >= 1) applies to --gallery" in err


# --------------------------------------------------------------------------
# Updates: add, remove
# --------------------------------------------------------------------------


def test_add_in_another_precision_records_both(world, tmp_path, monkeypatch):
    from fedreid.retrieval import GalleryStore, folders

    folder = _copy_store(world, tmp_path)
    assert tool.main(_index(world["run"], folder, "--add", world["root"] / "more")) == 0
    assert GalleryStore.open(folder).header["meta"]["precision"] == "fp32"  # the same as the build's: one
    monkeypatch.setattr(folders, "extraction_precision", lambda loaded, amp: "fp16")  # as --amp on a GPU would
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(world["images"][0], extra / "0900_c1s1_000001_00.jpg")
    assert tool.main(_index(world["run"], folder, "--add", extra)) == 0
    assert GalleryStore.open(folder).header["meta"]["precision"] == "fp16, fp32"


def test_add_then_query_finds_the_new_images(world, tmp_path, capsys):
    folder = _copy_store(world, tmp_path)
    assert tool.main(_index(world["run"], folder, "--add", world["root"] / "more", "--site", "south")) == 0
    out = capsys.readouterr().out
    assert f"added {N_MORE} images of {world['root'] / 'more'} to {folder}: ids 32-36 (37 items)" in out
    query = world["more"][2]
    assert tool.main(_query(world, folder, query, top_k=3)) == 0
    first = _matches(capsys.readouterr().out)[str(query)][0]
    assert Path(first["path"]).resolve() == query.resolve() and first["id"] == "34" and first["site"] == "south"

    before = _snapshot(folder)
    err = _cli_error(_index(world["run"], folder, "--add", world["root"] / "more"), capsys)
    assert f"already holds {N_MORE} of the images" in err and str(world["more"][0].resolve()) in err
    assert "nothing was changed" in err and _snapshot(folder) == before

    # an unreadable image with --skip-bad-images: listed in the store's skipped.csv
    extra = tmp_path / "extra"
    _images(extra, ["0077_c1s1_000001_01.png"], np.random.default_rng(5), T0)
    (extra / "0078_c1s1_000002_01.jpg").write_text("not an image")
    assert tool.main(_index(world["run"], folder, "--add", extra, "--skip-bad-images")) == 0
    assert "skipped 1 unreadable images" in capsys.readouterr().out
    with open(folder / "skipped.csv", newline="") as f:
        assert [r[0] for r in csv.reader(f)] == ["path", str(extra / "0078_c1s1_000002_01.jpg")]
    assert json.loads((folder / "header.json").read_text())["meta"]["skipped"] == 1
    assert tool.main(_index(None, folder, "--remove", "0")) == 0  # later updates keep the list
    assert (folder / "skipped.csv").is_file()
    capsys.readouterr()


def test_add_with_another_model_is_refused(world, tmp_path, capsys):
    folder = _copy_store(world, tmp_path)
    other = _model_file(tmp_path / "other" / "model_final.pt", seed=7)
    before = _snapshot(folder)
    err = _cli_error(_index(other, folder, "--add", world["root"] / "more"), capsys)
    assert "was built with another model" in err and "weights_sha256" in err and str(other) in err
    assert _snapshot(folder) == before


def test_remove_by_id_path_and_name_leaves_no_trace(world, tmp_path, capsys, monkeypatch):
    from fedreid.retrieval import GalleryStore

    folder = _copy_store(world, tmp_path)
    store = GalleryStore.open(folder)
    rows = {r[0]: r[1] for r in _table(folder)}
    by_id, by_path, by_name = 5, 9, 12
    relative = 20  # given as a path relative to the working folder
    gone = [by_id, by_path, by_name, relative]
    vectors = {i: store.vectors[np.searchsorted(store.ids, i)].copy() for i in gone}
    monkeypatch.chdir(world["root"])
    argv = _index(None, folder, "--remove", str(by_id), rows[by_path], Path(rows[by_name]).name,
                  f"gallery/{Path(rows[relative]).name}")
    assert tool.main(argv) == 0
    assert capsys.readouterr().out.startswith(f"removed 4 items from {folder}: ids 5, 9, 12, 20 (28 items left)")

    store = GalleryStore.open(folder)
    assert store.ntotal == 28 and not np.isin(store.ids, gone).any()
    assert not {r[0] for r in _table(folder)} & set(gone)
    for f in folder.iterdir():  # no byte of a removed item's path or vector stays in any file
        data = f.read_bytes()
        for i in gone:
            assert Path(rows[i]).name.encode() not in data and vectors[i].tobytes() not in data, (f.name, i)
    assert tool.main(_query(world, folder, world["gallery"], top_k=30)) == 0
    printed = {m["id"] for ms in _matches(capsys.readouterr().out).values() for m in ms}
    assert len(printed) == 28 and not printed & {str(i) for i in gone}

    before = _snapshot(folder)
    err = _cli_error(_index(None, folder, "--remove", "9999", "7", "nothere.png"), capsys)
    assert "holds no item 9999, nothere.png" in err and "nothing was removed" in err
    err = _cli_error(_index(None, folder, "--remove", "twin.png"), capsys)
    assert "twin.png names 2 items" in err and "sub/twin.png" in err
    err = _cli_error(_index(world["run"], folder, "--remove", "7"), capsys)
    assert "--model does not apply to --remove" in err
    assert _snapshot(folder) == before


def test_after_a_removal_an_ivf_store_answers_each_image_with_its_own_id(world, tmp_path, capsys):
    folder = tmp_path / "ivf"
    assert tool.main(_index(world["run"], folder, "--gallery", world["gallery"], "--factory", "IVF4,Flat",
                            "--verify")) == 0
    recall = json.loads((folder / "header.json").read_text())["verify"]["recall"]
    ids_before = {Path(p).resolve(): i for i, p, *_ in _table(folder)}
    capsys.readouterr()
    assert tool.main(_index(None, folder, "--remove", "5", "--verify")) == 0
    out = capsys.readouterr().out
    assert f"verify: recall@10 {recall:.4f} against exact search (nprobe=4" in out  # unchanged (0.24 when ids shifted)
    assert tool.main(_query(world, folder, world["gallery"], top_k=100_000_000)) == 0  # k is cut to the 31 items
    printed = _matches(capsys.readouterr().out)
    assert len(printed) == N_GALLERY + 1
    for query, matches in printed.items():
        assert len(matches) == N_GALLERY
        first = matches[0]
        if ids_before[Path(query).resolve()] == 5:
            assert first["id"] != "5"
            continue
        assert Path(first["path"]).resolve() == Path(query).resolve(), query
        assert first["id"] == str(ids_before[Path(query).resolve()]) and float(first["score"]) == pytest.approx(1, abs=1e-4)


def test_an_index_of_the_earlier_format_is_not_updated(world, tmp_path, capsys):
    from old_index_format import save_index

    from fedreid.retrieval.exact import build_index

    old = tmp_path / "old"
    save_index(old, build_index(np.eye(3, dtype=np.float32), use_gpu=False), ids=[1, 2, 3], cameras=[0, 0, 0],
               paths=["a", "b", "c"])
    for argv in (_index(None, old, "--remove", "1"), _index(world["run"], old, "--add", world["root"] / "more"),
                 _query(world, old, world["more"][0])):
        err = _cli_error(argv, capsys)
        assert "built by an earlier version" in err and "rebuild with index" in err


# --------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------


def test_filters_by_camera_site_and_time(world, tmp_path, capsys):
    folder = _copy_store(world, tmp_path)
    assert tool.main(_index(world["run"], folder, "--add", world["root"] / "more", "--site", "south")) == 0
    queries = world["root"] / "more"
    capsys.readouterr()

    def run(*filters) -> list[dict]:
        assert tool.main(_query(world, folder, queries, *filters, top_k=40)) == 0
        found = _matches(capsys.readouterr().out)
        assert len(found) == N_MORE
        return [m for ms in found.values() for m in ms]

    assert {m["cam"] for m in run("--cameras", "1")} == {"1"}
    got = run("--cameras", "2,3")
    assert {m["cam"] for m in got} == {"2", "3"} and len(got) == N_MORE * (10 + 10 + 2)  # every item passing
    got = run("--sites", "south")
    assert {m["site"] for m in got} == {"south"} and {int(m["id"]) for m in got} == set(range(32, 37))
    # a window of hours 3..6 of the gallery (ISO, offset) and the same as seconds since the epoch
    iso = run("--since", "2023-11-15T03:13:20+02:00", "--until", "2023-11-15T04:13:20Z")
    seconds = run("--since", str(T0 + 3 * 3600), "--until", str(T0 + 6 * 3600))
    assert sorted({int(m["id"]) for m in iso}) == [3, 4, 5, 6] and iso == seconds
    got = run("--cameras", "1", "--sites", "north", "--until", str(T0 + 9 * 3600))
    assert sorted({int(m["id"]) for m in got}) == [0, 3, 6, 9]
    assert tool.main(_query(world, folder, world["more"][0], "--sites", "nowhere")) == 0
    assert "(no item passes the filters)" in capsys.readouterr().out

    err = _cli_error(_query(world, folder, queries, "--cameras", "a"), capsys)
    assert "--cameras (each a camera) must be an integer from -2147483648 to 2147483647, got 'a'" in err
    err = _cli_error(_query(world, folder, queries, "--cameras", ","), capsys)
    assert "--cameras expects camera numbers" in err
    err = _cli_error(_query(world, folder, queries, "--cameras", "99999999999999999999"), capsys)
    assert "--cameras (each a camera) must be an integer" in err and "'99999999999999999999'" in err
    err = _cli_error(_query(world, folder, queries, "--since", "yesterday"), capsys)
    assert "--since must be seconds since the epoch or an ISO 8601 date/time" in err and "'yesterday'" in err
    err = _cli_error(_query(world, folder, queries, "--until", "1e15"), capsys)
    assert "--until must be seconds since the epoch" in err and "from year 1 to 9999" in err
    err = _cli_error(_query(world, folder, queries, "--since", "2024-01-02", "--until", "2024-01-01"), capsys)
    assert "is after --until" in err
    err = _cli_error(_query(world, folder, queries, "--sites", "a\x1b[31mb"), capsys)
    assert "--sites (each a site) must be a name of 1 to 200 characters without control characters" in err


# --------------------------------------------------------------------------
# Metadata CSV
# --------------------------------------------------------------------------


def test_metadata_csv_overrides_the_defaults(world, tmp_path, capsys):
    images = world["images"]
    table = tmp_path / "meta.csv"
    table.write_text(
        "path,camera,site,timestamp,identity\n"
        f"{images[0].name},7,,2024-05-01T08:00:00+02:00,\n"  # relative to the gallery; empty cells keep defaults
        f"{images[1]},,east,1714550400,42\n"
        "sub/twin.png,3,,,5\n"
    )
    folder = tmp_path / "store"
    assert tool.main(_index(world["run"], folder, "--gallery", world["gallery"], "--metadata", table,
                            "--site", "north")) == 0
    rows = {Path(r[1]).relative_to(world["gallery"].resolve()).as_posix(): r[2:] for r in _table(folder)}
    assert rows[images[0].name] == (7, "north", 1714543200.0, 1)
    assert rows[images[1].name] == (2, "east", 1714550400.0, 42)
    assert rows["sub/twin.png"] == (3, "north", float(T0 + 30 * 3600), 5)
    assert rows["twin.png"] == (None, "north", float(T0 - 3600), None)  # no Market name: no camera, identity
    assert rows[images[2].name] == (3, "north", float(T0 + 2 * 3600), 1)
    capsys.readouterr()
    assert tool.main(_query(world, folder, images[1], "--sites", "east")) == 0
    assert [m["id"] for m in _matches(capsys.readouterr().out)[str(images[1])]] == ["1"]


@pytest.mark.parametrize("content, words", [
    ("path,colour\nx.png,red\n", "unknown columns ['colour']"),
    ("camera,site\n1,a\n", "no path column"),
    ("path,camera,camera\nx,1,2\n", "columns named twice ['camera']"),
    ("path,camera\n{0},1\n{1},x\n", "row 3: camera must be an integer from -2147483648 to 2147483647, got 'x'"),
    ("path,identity\n{0},1.5\n", "row 2: identity must be an integer from -2147483648 to 2147483647, got '1.5'"),
    ("path,identity\n{0},alice\n", "row 2: identity must be an integer"),
    ("path,camera\n{0},1180591620717411303424\n", "row 2: camera must be an integer"),  # 2**70
    ("path,identity\n{0},-2147483649\n", "row 2: identity must be an integer"),
    ("path,timestamp\n{0},next week\n", "row 2: timestamp must be seconds since the epoch or an ISO 8601"),
    ("path,timestamp\n{0},1e15\n", "row 2: timestamp must be seconds since the epoch"),
    ("path,timestamp\n{0},nan\n", "row 2: timestamp must be seconds since the epoch"),
    ("path,site\n{0}," + "s" * 201 + "\n", "row 2: site must be a name of 1 to 200 characters"),
    ("path,site\n{0},a\nelsewhere/nope.png,b\n", "row 3: elsewhere/nope.png is not an image of"),
    ("path,site\n{0},a\n{0},b\n", "row 3: {0} is the image of row 2 again"),
    ("path,site\n{0},a,b\n", "row 2: 3 cells for 2 columns"),
    ("", "has no header row"),
])
def test_bad_metadata_csv_is_an_error_naming_the_file_and_row(world, tmp_path, capsys, monkeypatch, content, words):
    from fedreid.retrieval import folders as folder_index

    names = [p.name for p in world["images"][:2]]
    table = tmp_path / "meta.csv"
    table.write_text(content.format(*names))
    monkeypatch.setattr(folder_index, "image_features", lambda *a, **k: pytest.fail("features were extracted"))
    err = _cli_error(_index(world["run"], tmp_path / "store", "--gallery", world["gallery"], "--metadata", table),
                     capsys)
    assert f"metadata file {table}" in err and words.format(*names) in err and "\n" not in err.strip()
    assert not (tmp_path / "store").exists()  # refused before the folder is made or any image is read


@pytest.mark.parametrize("name, words", [
    ("1180591620717411303424_c1s1_000001_01.png", "identity must be an integer"),  # 2**70 in a Market name
    ("0001_c99999999999s1_000001_01.png", "camera must be an integer"),
])
def test_an_out_of_range_file_name_value_is_refused_before_extraction(world, tmp_path, capsys, monkeypatch,
                                                                      name, words):
    from fedreid.retrieval import folders as folder_index

    folder = tmp_path / "odd"
    _images(folder, [name], np.random.default_rng(3), T0)
    monkeypatch.setattr(folder_index, "image_features", lambda *a, **k: pytest.fail("features were extracted"))
    err = _cli_error(_index(world["run"], tmp_path / "store", "--gallery", folder), capsys)
    assert name in err and words in err and "from its file name" in err
    err = _cli_error(_index(world["run"], tmp_path / "store", "--gallery", world["gallery"], "--site", " "), capsys)
    assert "--site must be a name of 1 to 200 characters" in err


def test_check_hashes_every_file_even_those_this_process_trusts(world, tmp_path, capsys):
    folder = _copy_store(world, tmp_path)
    old = 1_000_000_000  # long before any check: a verified file is then trusted while unchanged
    for p in folder.iterdir():
        os.utime(p, (old, old))
    header = json.loads((folder / "header.json").read_text())
    assert tool.main(_index(None, folder, "--check")) == 0
    out = capsys.readouterr().out.strip()
    size = sum(r["bytes"] for r in header["files"].values()) / 2**20
    assert out == (f"check: all {len(header['files'])} files of {folder} match the SHA-256 in its header.json "
                   f"({size:.1f} MiB hashed)")
    assert len(header["files"]) == 1 + 4 * len(header["segments"])

    # a flipped byte that keeps the size and the modification time: a plain reopen trusts the file, --check does not
    damaged = folder / f"{header['segments'][0]['name']}.vectors.npy"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    os.utime(damaged, (old, old))
    assert tool.main(_index(None, folder, "--verify", "--verify-sample", "5")) == 0  # (opens it: no hash)
    capsys.readouterr()
    err = _cli_error(_index(None, folder, "--check"), capsys)
    assert str(damaged) in err and "does not match the SHA-256" in err and "\n" not in err.strip()
    err = _cli_error(_index(world["run"], folder, "--check"), capsys)
    assert "--model does not apply to --verify / --target-recall / --check alone" in err
