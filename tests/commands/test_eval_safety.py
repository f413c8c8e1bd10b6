"""tools/eval_reid.py never loses a user's file, never runs a planted pickle, never answers silently wrong.

Each loading path (model files, feature files, index folders) is fed a pickle
whose unpickling would create a sentinel file; the tool must refuse it in one
line and the sentinel must not exist. A control shows each payload does run
when loaded unsafely, so the tests cannot pass vacuously.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import pathlib
import pickle
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from fl_helpers import write_prepared
from tool_loader import cli_error, load_tool

from fedreid.config import ModelConfig, to_dict
from fedreid.models.reid import create_reid_model, shared_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")



tool = load_tool("eval_reid", "eval_reid_tool_safety")


class Planted:
    """Unpickling this creates ``sentinel``: what a hostile file would do instead."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.sentinel),))


def _payload(model_cfg: dict, state) -> dict:
    return {"format": "fedreid.model", "model": model_cfg, "mode": "fedpav", "round": 1, "state": state}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run folder (resnet18, 32x16 input), a 6-image Market-style gallery and a prepared dataset."""
    root = tmp_path_factory.mktemp("evalsafety")
    cfg = to_dict(ModelConfig(backbone="resnet18", bottleneck_dim=16, height=32, width=16))
    model = create_reid_model("resnet18", 0, bottleneck_dim=16, seed=0)
    state = shared_state(model)
    run = root / "run"
    run.mkdir()
    torch.save(_payload(cfg, state), run / "model_final.pt")
    gallery = root / "gallery"
    gallery.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        image = rng.integers(0, 256, (32, 16, 3), dtype=np.uint8)
        assert cv2.imwrite(str(gallery / f"{i // 2 + 1:04d}_c{i % 2 + 1}s1_{i:06d}_01.png"), image)
    prepared = root / "prepared"
    write_prepared(prepared, "tiny", num_ids=1, test_ids=3, seed=3)
    return {"root": root, "run": run, "gallery": gallery, "prepared": prepared, "cfg": cfg, "state": state}


def _cli_error(argv, capsys) -> str:
    return cli_error(tool, argv, capsys)


def _snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``folder`` (links and folders by name)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _index(world, folder, *extra, model=None) -> list[str]:
    return ["index", "--model", str(model or world["run"]), "--gallery", str(world["gallery"]),
            "--index", str(folder), "--device", "cpu", *extra]


def _query(world, folder, *extra, model=None, images=None) -> list[str]:
    return ["query", "--model", str(model or world["run"]), "--index", str(folder), "--images",
            str(images or world["gallery"]), "--device", "cpu", "--top-k", "2", *extra]


@pytest.fixture(scope="module")
def index_dir(world):
    folder = world["root"] / "index"
    assert tool.main(_index(world, folder)) == 0
    return folder


#: A version-3 store's file names -> the files of the one segment of a small version-4 store.
SEGMENT_FILES = {"index.faiss": "seg-000000.faiss", "vectors.npy": "seg-000000.vectors.npy",
                 "ids.npy": "seg-000000.ids.npy", "meta.sqlite": "seg-000000.sqlite"}


def _vouch(folder: Path, name: str) -> None:
    """Rewrite header.json so its size/SHA-256 record vouches for ``name`` as it is now."""
    header = json.loads((folder / "header.json").read_text())
    data = (folder / name).read_bytes()
    header["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "header.json").write_text(json.dumps(header))


# --------------------------------------------------------------------------
# Planted pickles run nothing
# --------------------------------------------------------------------------


def _evil_model_files(world, folder: Path, sentinel: Path) -> dict[str, Path]:
    """Model files whose unsafe loading creates ``sentinel``; each checked to do so (then the sentinel removed)."""
    folder.mkdir()
    files = {}
    files["zip"] = folder / "zip.pt"
    torch.save(_payload(world["cfg"], {"x": Planted(sentinel)}), files["zip"])
    files["legacy"] = folder / "legacy.pt"
    torch.save(_payload(world["cfg"], Planted(sentinel)), files["legacy"], _use_new_zipfile_serialization=False)
    files["pickle"] = folder / "pickle.pt"
    files["pickle"].write_bytes(pickle.dumps(Planted(sentinel), protocol=4))
    files["run folder"] = folder / "run"
    files["run folder"].mkdir()
    shutil.copy(files["zip"], files["run folder"] / "model_final.pt")
    for name, path in files.items():  # control: unsafe loading does run the payload
        source = path / "model_final.pt" if path.is_dir() else path
        torch.load(source, weights_only=False) if name != "pickle" else pickle.loads(source.read_bytes())
        assert sentinel.exists(), name
        sentinel.unlink()
    return files


@pytest.mark.parametrize("command", ["evaluate", "index", "query"])
def test_a_planted_pickle_as_model_runs_nothing(world, index_dir, tmp_path, capsys, command):
    sentinel = tmp_path / "SENTINEL"
    for kind, model in _evil_model_files(world, tmp_path / "models", sentinel).items():
        argv = {
            "evaluate": ["evaluate", "--model", str(model), "--datasets", "tiny", "--prepared-root",
                         str(world["prepared"]), "--out", str(tmp_path / "eval")],
            "index": _index(world, tmp_path / "idx", model=model),
            "query": _query(world, index_dir, model=model),
        }[command]
        err = _cli_error(argv, capsys)
        assert "never loaded" in err and "expected a fedreid run folder" in err, kind
        assert "weights_only" not in err and "allow_pickle" not in err
        assert not sentinel.exists(), kind
    assert not (tmp_path / "idx").exists() and not (tmp_path / "eval").exists()


def test_a_planted_pickle_as_features_runs_nothing(tmp_path, capsys):
    sentinel = tmp_path / "SENTINEL"
    raw = tmp_path / "raw.npz"
    raw.write_bytes(pickle.dumps(Planted(sentinel), protocol=4))
    inside = tmp_path / "inside.npz"
    np.savez(inside, features=np.array([[Planted(sentinel)]], dtype=object), pids=np.zeros(1, int),
             camids=np.zeros(1, int), paths=np.array(["a.jpg"]), meta=np.array('{"num_query": 0}'))
    pickle.loads(raw.read_bytes())  # controls: unsafe loading runs the payload
    assert sentinel.exists()
    sentinel.unlink()
    np.load(inside, allow_pickle=True)["features"]
    assert sentinel.exists()
    sentinel.unlink()
    for path in (raw, inside):
        err = _cli_error(["evaluate", "--features", str(path), "--out", str(tmp_path / "eval")], capsys)
        assert str(path) in err and "is not a NumPy .npz of fedreid features" in err and "never loaded" in err
        assert "allow_pickle" not in err and not sentinel.exists()


@pytest.mark.parametrize("name", ["header.json", "index.faiss", "vectors.npy", "ids.npy", "meta.sqlite",
                                  "vectors.npy with object arrays", "ids.npy with object arrays"])
def test_a_planted_pickle_in_an_index_folder_runs_nothing(world, index_dir, tmp_path, capsys, name):
    sentinel = tmp_path / "SENTINEL"
    folder = tmp_path / "index"
    shutil.copytree(index_dir, folder)
    file = SEGMENT_FILES.get(name.split()[0], name.split()[0])
    if name.endswith("object arrays"):
        np.save(folder / file, np.array([Planted(sentinel)] * 6, dtype=object), allow_pickle=True)
        np.load(folder / file, allow_pickle=True)  # control
    else:
        (folder / file).write_bytes(pickle.dumps(Planted(sentinel), protocol=4))
        pickle.loads((folder / file).read_bytes())  # control
    assert sentinel.exists()
    sentinel.unlink()
    if file != "header.json":
        _vouch(folder, file)  # even with checksums that vouch for it, nothing parses it unsafely
    err = _cli_error(_query(world, folder), capsys)
    assert str(folder / file) in err and "allow_pickle" not in err
    assert not sentinel.exists()


# --------------------------------------------------------------------------
# Index folders: the user's files are never touched
# --------------------------------------------------------------------------


def test_index_refuses_a_folder_of_the_users_files(world, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "header.json").write_text(json.dumps({"title": "my holiday", "pages": 3}))
    (mine / "notes.txt").write_text("do not lose me")
    # Even a header that imitates an index header is not adopted while the user's other files are there.
    looks = tmp_path / "looks"
    looks.mkdir()
    (looks / "header.json").write_text(json.dumps(
        {"format": "fedreid-faiss-index", "version": 1, "metric": "inner_product", "ntotal": 1, "dim": 1,
         "files": {"index.faiss": 1}}))
    (looks / "photo.jpg").write_bytes(b"\xff\xd8 my photo")
    for folder in (mine, looks):
        before = _snapshot(folder)
        err = _cli_error(_index(world, folder), capsys)
        assert str(folder) in err and "did not write" in err and "nothing was changed" in err
        assert _snapshot(folder) == before


def test_index_refuses_the_gallery_folder_and_folders_inside_it(world, tmp_path, capsys):
    gallery = tmp_path / "gallery"
    shutil.copytree(world["gallery"], gallery)
    link = tmp_path / "link"
    link.symlink_to(gallery, target_is_directory=True)
    before = _snapshot(gallery)
    for target in (gallery, gallery / "idx", link / "idx", link):
        err = _cli_error(["index", "--model", str(world["run"]), "--gallery", str(gallery), "--index", str(target),
                          "--device", "cpu"], capsys)
        assert f"--index {target} " in err and "gallery folder" in err and "outside the gallery" in err
        assert _snapshot(gallery) == before
    # and a gallery given through the link, an index in the real folder
    err = _cli_error(["index", "--model", str(world["run"]), "--gallery", str(link), "--index", str(gallery / "i"),
                      "--device", "cpu"], capsys)
    assert "inside the gallery folder" in err and _snapshot(gallery) == before


def test_index_rebuilds_its_own_folder_and_adopts_one_of_an_earlier_version(world, index_dir, tmp_path, capsys):
    own = tmp_path / "own"
    shutil.copytree(index_dir, own)
    assert (own / ".fedreid-index.json").is_file()
    assert tool.main(_index(world, own)) == 0
    from old_index_format import save_index

    from fedreid.retrieval.exact import build_index

    old = tmp_path / "old"  # what an earlier fedreid left: no marker, a version-1 header of the earlier format
    feats = np.random.default_rng(0).standard_normal((6, 16)).astype(np.float32)
    save_index(old, build_index(feats, use_gpu=False), ids=np.arange(6), cameras=np.zeros(6), paths=["a"] * 6,
               meta={"gallery": str(world["gallery"])})
    header = json.loads((old / "header.json").read_text())
    header.update(version=1, files={k: v["bytes"] for k, v in header["files"].items()})
    (old / "header.json").write_text(json.dumps(header))
    err = _cli_error(_query(world, old), capsys)
    assert "version 1" in err and "build the index again" in err and "earlier version" in err
    assert tool.main(_index(world, old)) == 0
    header = json.loads((old / "header.json").read_text())
    assert (old / ".fedreid-index.json").is_file() and header["version"] == 4
    assert header["format"] == "fedreid-gallery-store" and not (old / "meta.npz").exists()
    assert tool.main(_query(world, old)) == 0
    capsys.readouterr()


def test_index_never_deletes_files_in_its_own_folder_or_beside_it(world, index_dir, tmp_path, capsys):
    parent = tmp_path / "indexes"
    parent.mkdir()
    own = parent / "index"
    shutil.copytree(index_dir, own)
    (own / "my-notes.txt").write_text("written into the index folder by hand")
    before = _snapshot(parent)
    err = _cli_error(_index(world, own), capsys)
    assert str(own) in err and "my-notes.txt" in err and "nothing was changed" in err
    assert _snapshot(parent) == before
    (own / "my-notes.txt").unlink()

    # Hidden siblings an interrupted build left are removed; look-alikes of the user's are not.
    for name in (".index.tmp-0123abcd", ".index.old-89abcdef"):
        shutil.copytree(index_dir, parent / name)
    (parent / ".index.tmp-00000000").mkdir()  # empty: a kill right after mkdir
    (parent / ".index.old-11111111").mkdir()
    (parent / ".index.old-11111111" / "mine.txt").write_text("not fedreid's")  # unmarked: kept
    (parent / ".index.tmp-notmine1").mkdir()  # not our name pattern: kept
    (parent / ".other.tmp-0123abcd").mkdir()  # another folder's: kept
    assert tool.main(_index(world, own)) == 0
    assert sorted(p.name for p in parent.iterdir()) == [
        ".index.old-11111111", ".index.tmp-notmine1", ".other.tmp-0123abcd", "index"]
    capsys.readouterr()


def test_a_failed_build_leaves_the_previous_index_whole(world, index_dir, tmp_path, capsys, monkeypatch):
    from fedreid.retrieval import store

    own = tmp_path / "index"
    shutil.copytree(index_dir, own)
    before = _snapshot(own)
    real = store.write_json_atomic

    def failing(path, *args, **kwargs):  # the staged store's header, its last file
        real(path, *args, **kwargs)
        Path(path).unlink()  # as if killed while the header was written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_json_atomic", failing)
    with pytest.raises(OSError, match="No space left"):
        tool.main(_index(world, own))
    assert _snapshot(own) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no staging folder left


def test_query_out_refuses_a_folder_of_the_users_files(world, index_dir, tmp_path, capsys):
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    (pictures / "0000_0001_c1s1_000000_01.png").write_bytes(b"my own picture")
    before = _snapshot(pictures)
    err = _cli_error(_query(world, index_dir, "--out", str(pictures)), capsys)
    assert str(pictures) in err and "did not write" in err
    assert _snapshot(pictures) == before
    out = tmp_path / "out"
    assert tool.main(_query(world, index_dir, "--out", str(out))) == 0
    assert tool.main(_query(world, index_dir, "--out", str(out))) == 0  # its own folder: written again
    assert len(list(out.glob("*.png"))) == 6
    capsys.readouterr()


def test_evaluate_writes_only_into_its_own_output_folders(world, tmp_path, capsys):
    base = ["evaluate", "--model", str(world["run"]), "--datasets", "tiny", "--prepared-root", str(world["prepared"]),
            "--pictures", "1"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text('{"my": "numbers"}')
    (mine / "cmc.png").write_bytes(b"my plot")
    before = _snapshot(mine)
    for argv in (base + ["--out", str(mine)], base + ["--out", str(tmp_path / "ev"), "--save-features", str(mine)]):
        err = _cli_error(argv, capsys)
        assert str(mine) in err and "did not write" in err and "nothing was changed" in err
        assert _snapshot(mine) == before
    assert not (tmp_path / "ev" / "results.json").exists()  # refused before any evaluation

    out, feats = tmp_path / "out", tmp_path / "feats"
    assert tool.main(base + ["--out", str(out), "--save-features", str(feats)]) == 0
    assert tool.main(base + ["--out", str(out), "--save-features", str(feats)]) == 0  # its own folders again
    # Folders an earlier fedreid wrote (no marker) are recognised by their contents.
    for folder in (out, feats):
        next(folder.glob(".fedreid-*.json")).unlink()
    assert tool.main(base + ["--out", str(out), "--save-features", str(feats)]) == 0
    assert (out / ".fedreid-eval.json").is_file() and (feats / ".fedreid-features.json").is_file()
    capsys.readouterr()


@pytest.fixture(scope="module")
def features(world):
    """tiny.npz: the world model's features of the prepared dataset tiny (3 queries, 6 gallery images)."""
    from fedreid.inference.dataset_features import dataset_features, save_dataset_features
    from fedreid.inference.model_io import load_model

    feats = dataset_features(load_model(world["run"]), world["prepared"], "tiny", batch_size=8)
    return save_dataset_features(world["root"] / "features", feats)


def test_evaluate_rewrites_a_report_only_in_a_fedreid_run_folder(features, tmp_path, capsys):
    from fedreid.utils.io import marker_path

    project = tmp_path / "my_project"
    project.mkdir()
    (project / "metrics.jsonl").write_text('{"round": 1, "loss": 0.3}\n')  # the user's own log
    (project / "report.md").write_text("# My thesis notes\n")
    (project / "curve_training.png").write_bytes(b"my own figure")
    before = _snapshot(project)
    argv = ["evaluate", "--features", str(features), "--out", str(project / "eval"), "--pictures", "0"]
    assert tool.main(argv) == 0
    assert f"report: not written, {project} is not a fedreid run folder" in capsys.readouterr().out
    assert {k: v for k, v in _snapshot(project).items() if not k.startswith("eval")} == before
    marker_path(project, "run").write_text('{"kind": "run"}')  # what train_fed marks its run folders with
    assert tool.main(argv) == 0
    assert (project / "report.md").read_text().startswith("# my_project")


def _with_gallery(feats, features):
    return dataclasses.replace(feats, gallery=feats.gallery._replace(features=features))


def test_a_failed_evaluation_leaves_the_previous_outputs_as_they_were(features, tmp_path, capsys, monkeypatch):
    from fedreid.eval import visualize
    from fedreid.inference.dataset_features import load_dataset_features, save_dataset_features
    from fedreid.inference.errors import EvalInputError

    out = tmp_path / "eval"
    base = ["evaluate", "--out", str(out), "--pictures", "2"]
    assert tool.main(base + ["--features", str(features)]) == 0
    before = _snapshot(out)
    feats = load_dataset_features(features)
    # The same model's features ranked otherwise (the gallery negated), then a dataset no query matches.
    second = tmp_path / "second"
    flipped = save_dataset_features(second, _with_gallery(feats, -feats.gallery.features))
    nomatch = save_dataset_features(second, dataclasses.replace(
        feats, name="nomatch", query=feats.query._replace(pids=np.full(len(feats.query.pids), 999))))
    err = _cli_error(base + ["--features", f"{flipped},{nomatch}"], capsys)
    assert "'nomatch'" in err and "has a true match" in err
    assert _snapshot(out) == before

    drawn = []

    def second_picture_fails(*args, **kwargs):
        if drawn:
            raise EvalInputError("cannot read image x.png")
        drawn.append(real(*args, **kwargs))
        return drawn[-1]

    real = visualize.draw_ranked_list
    monkeypatch.setattr(visualize, "draw_ranked_list", second_picture_fails)
    assert "cannot read image x.png" in _cli_error(base + ["--features", str(flipped)], capsys)
    assert drawn and _snapshot(out) == before  # one picture was drawn, and not where the old one lies


def test_pictures_no_longer_drawn_are_removed_and_no_other_file(features, tmp_path, capsys):
    out = tmp_path / "eval"
    pictures = out / "ranked_lists"
    argv = ["evaluate", "--features", str(features), "--out", str(out)]
    assert tool.main(argv + ["--pictures", "4"]) == 0
    assert len(list(pictures.iterdir())) == 3  # 3 queries: the best 2 and the worst 1
    (pictures / "mine.png").write_bytes(b"the user's")
    assert tool.main(argv + ["--pictures", "1"]) == 0
    listed = json.loads((out / "results.json").read_text())["pictures"]
    assert len(listed) == 1 and sorted(p.name for p in pictures.iterdir()) == sorted([Path(listed[0]).name,
                                                                                       "mine.png"])
    # An earlier fedreid listed its pictures by absolute path: read as such.
    results = json.loads((out / "results.json").read_text())
    results["pictures"] = [str((out / p).resolve()) for p in results["pictures"]]
    (out / "results.json").write_text(json.dumps(results))
    assert tool.main(argv + ["--pictures", "0"]) == 0
    assert [p.name for p in pictures.iterdir()] == ["mine.png"]
    capsys.readouterr()


# --------------------------------------------------------------------------
# The index is checked before faiss reads it, and against the query's model
# --------------------------------------------------------------------------


def test_a_damaged_index_file_is_named_before_faiss_reads_it(world, index_dir, tmp_path, capsys, monkeypatch):
    import faiss

    folder = tmp_path / "index"
    shutil.copytree(index_dir, folder)
    damaged = folder / SEGMENT_FILES["index.faiss"]
    data = bytearray(damaged.read_bytes())
    data[60] ^= 0xFF  # one flipped byte among the vectors: same size
    damaged.write_bytes(bytes(data))
    read = []
    real = faiss.read_index
    monkeypatch.setattr(faiss, "read_index", lambda p: read.append(p) or real(p))
    err = _cli_error(_query(world, folder), capsys)
    assert str(damaged) in err and "does not match the SHA-256" in err
    assert read == []


def test_query_with_another_model_is_refused_unless_allowed(world, index_dir, tmp_path, capsys):
    other = tmp_path / "other.pt"
    scaled = {k: v * 0.5 if v.is_floating_point() else v for k, v in world["state"].items()}
    torch.save(_payload(world["cfg"], scaled), other)
    taller = tmp_path / "taller.pt"
    torch.save(_payload({**world["cfg"], "height": 64}, world["state"]), taller)

    err = _cli_error(_query(world, index_dir, model=other), capsys)
    assert str(index_dir) in err and str(other) in err and "weights_sha256" in err
    assert "(index) vs" in err and "--allow-model-mismatch" in err and "height" not in err
    err = _cli_error(_query(world, index_dir, model=taller), capsys)
    assert "height 32 (index) vs 64 (model)" in err and "weights_sha256" not in err

    assert tool.main(_query(world, index_dir, "--allow-model-mismatch", model=other)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("WARNING: ") and "weights_sha256" in lines[0] and "--allow-model-mismatch" in lines[0]
    assert len(lines) == 1 + 6 * 3  # the warning, then every query's two matches

    # the same weights from another file (a checkpoint copy, the run folder) are the same model
    assert tool.main(_query(world, index_dir, model=world["run"] / "model_final.pt")) == 0
    assert "WARNING" not in capsys.readouterr().out


# --------------------------------------------------------------------------
# Degenerate features are an error, not plausible numbers from ties
# --------------------------------------------------------------------------


def _collapsed_run(world, folder: Path, bias: float) -> Path:
    """A run whose bottleneck BatchNorm maps every image to ``bias`` (zero weight)."""
    state = dict(world["state"])
    state["bottleneck.1.weight"] = torch.zeros_like(state["bottleneck.1.weight"])
    state["bottleneck.1.bias"] = torch.full_like(state["bottleneck.1.bias"], bias)
    folder.mkdir()
    torch.save(_payload(world["cfg"], state), folder / "model_final.pt")
    return folder


@pytest.mark.parametrize("bias, words", [(0.0, "are zero"), (1.0, "are identical")])
def test_a_collapsed_model_is_an_error_on_every_path(world, tmp_path, capsys, bias, words):
    run = _collapsed_run(world, tmp_path / "run", bias)
    err = _cli_error(["evaluate", "--model", str(run), "--datasets", "tiny", "--prepared-root",
                      str(world["prepared"]), "--out", str(tmp_path / "eval"), "--save-features",
                      str(tmp_path / "feats")], capsys)
    assert str(run / "model_final.pt") in err and "'tiny'" in err and words in err
    assert not list((tmp_path / "feats").glob("*.npz"))  # refused before anything was saved
    err = _cli_error(_index(world, tmp_path / "idx", model=run), capsys)
    assert str(run / "model_final.pt") in err and str(world["gallery"]) in err and words in err
    assert not (tmp_path / "idx" / "header.json").exists()


@pytest.mark.parametrize("kind", ["zero", "constant", "nan"])
def test_degenerate_feature_files_are_an_error_naming_the_file(tmp_path, capsys, kind):
    from fedreid.inference.features import save_features

    rng = np.random.default_rng(0)
    feats = rng.standard_normal((12, 8)).astype(np.float32)
    if kind == "zero":
        feats[:] = 0
    elif kind == "constant":
        feats[:] = feats[0]
    else:
        feats[7, 3] = np.nan
    pids = np.repeat(np.arange(1, 5), 3)
    path = save_features(tmp_path / f"{kind}.npz", feats, pids, np.arange(12) % 2, [f"im{i}.jpg" for i in range(12)],
                         meta={"dataset": kind, "num_query": 4})
    err = _cli_error(["evaluate", "--features", str(path), "--out", str(tmp_path / "eval")], capsys)
    assert str(path) in err
    assert {"zero": "query: all 4 feature rows are zero", "constant": "query: all 4 feature rows are identical",
            "nan": "gallery row 3 (im7.jpg) has NaN or inf"}[kind] in err
    assert not (tmp_path / "eval" / "results.json").exists()


def test_degenerate_features_in_memory_are_refused_by_evaluate_dataset():
    from fedreid.eval.protocols import evaluate_dataset
    from fedreid.inference.dataset_features import DatasetFeatures
    from fedreid.inference.features import DegenerateFeaturesError, FeatureSet

    ids = np.repeat(np.arange(1, 4), 2)
    part = FeatureSet(np.zeros((6, 4), np.float32), ids, np.arange(6) % 2, [f"{i}.jpg" for i in range(6)])
    with pytest.raises(DegenerateFeaturesError, match="dataset 'mem' \\(test source\\): query: all 6 feature rows"):
        evaluate_dataset(DatasetFeatures("mem", part, part, source="test source"))


# --------------------------------------------------------------------------
# Clear lines for files of the wrong kind
# --------------------------------------------------------------------------


def test_a_text_file_as_model_or_features_says_what_it_is_and_what_was_expected(world, tmp_path, capsys):
    text = tmp_path / "model.pt"
    text.write_text("101\n")
    err = _cli_error(_index(world, tmp_path / "idx", model=text), capsys)
    assert err == (f"error: model file {text} is not a PyTorch file: it is a text file; expected a fedreid run "
                   "folder, its model_final.pt or checkpoint.pt (a torch.save'd dict of tensors and plain values)")
    bare = tmp_path / "bare.pt"
    torch.save({"weight": torch.zeros(2)}, bare)
    err = _cli_error(_index(world, tmp_path / "idx", model=bare), capsys)
    assert "is a PyTorch file but not a fedreid model" in err and "a bare state dict carries no model config" in err
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((world["run"] / "model_final.pt").read_bytes()[:2000])
    err = _cli_error(_index(world, tmp_path / "idx", model=truncated), capsys)
    assert f"model file {truncated} is a damaged or truncated PyTorch file" in err
    notes = tmp_path / "notes.npz"
    notes.write_text("101\n")
    err = _cli_error(["evaluate", "--features", str(notes), "--out", str(tmp_path / "eval")], capsys)
    assert f"feature cache {notes} is not a NumPy .npz of fedreid features" in err and "it is a text file" in err
    assert "pickle" not in err


# --------------------------------------------------------------------------
# --skip-bad-images
# --------------------------------------------------------------------------


def test_unreadable_images_stop_the_tool_or_are_listed_with_skip_bad_images(world, tmp_path, capsys):
    gallery = tmp_path / "gallery"
    shutil.copytree(world["gallery"], gallery)
    (gallery / "0009_c1s1_000009_01.jpg").write_text("not an image")
    (gallery / "sub").mkdir()
    (gallery / "sub" / "empty.png").write_bytes(b"")
    argv = ["index", "--model", str(world["run"]), "--gallery", str(gallery), "--device", "cpu"]
    err = _cli_error(argv + ["--index", str(tmp_path / "a")], capsys)
    assert str(gallery / "0009_c1s1_000009_01.jpg") in err and "--skip-bad-images" in err
    assert not (tmp_path / "a" / "header.json").exists()

    index = tmp_path / "b"
    assert tool.main(argv + ["--index", str(index), "--skip-bad-images"]) == 0
    out = capsys.readouterr().out
    assert "indexed 6 images" in out and f"skipped 2 unreadable images: listed in {index / 'skipped.csv'}" in out
    reason = "cannot decode the image (empty, corrupt or not an image)"
    with open(index / "skipped.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["path", "reason"], [str(gallery / "0009_c1s1_000009_01.jpg"), reason],
                    [str(gallery / "sub" / "empty.png"), reason]]
    assert json.loads((index / "header.json").read_text())["meta"]["skipped"] == 2

    # query: printed without --out, skipped.csv with --out; the readable images are answered
    err = _cli_error(_query(world, index, images=gallery), capsys)
    assert "--skip-bad-images" in err
    assert tool.main(_query(world, index, "--skip-bad-images", images=gallery)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"skipped {gallery / '0009_c1s1_000009_01.jpg'}: {reason}",
                         f"skipped {gallery / 'sub' / 'empty.png'}: {reason}"]
    assert len(lines) == 2 + 6 * 3
    pictures = tmp_path / "pictures"
    assert tool.main(_query(world, index, "--skip-bad-images", "--out", str(pictures), images=gallery)) == 0
    assert (pictures / "skipped.csv").read_text() == (index / "skipped.csv").read_text()
    capsys.readouterr()

    # rebuilt from a clean gallery: the stale list goes
    assert tool.main(_index(world, index, "--skip-bad-images")) == 0
    assert not (index / "skipped.csv").exists()
    only_bad = tmp_path / "bad_only"
    only_bad.mkdir()
    (only_bad / "x.jpg").write_text("no")
    err = _cli_error(["index", "--model", str(world["run"]), "--gallery", str(only_bad), "--index",
                      str(tmp_path / "c"), "--device", "cpu", "--skip-bad-images"], capsys)
    assert f"none of the 1 images of gallery {only_bad} could be read" in err
