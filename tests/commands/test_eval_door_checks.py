"""tools/eval_reid.py evaluate checks every option at the door: a refused call extracts nothing and leaves nothing behind.

Also: a broken model file is named before the datasets, feature files that
record no model are named in a WARNING, and queries without a true match are
counted under the table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tiny_runs import write_eval_world
from tool_loader import cli_error, load_tool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

tool = load_tool("eval_reid", "eval_reid_tool_door")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Prepared datasets ``tiny`` (6 queries) and ``tiny2``, a run folder, and the features of both."""
    from fedreid.inference.dataset_features import dataset_features, save_dataset_features
    from fedreid.inference.model_io import load_model

    made = write_eval_world(tmp_path_factory.mktemp("evaldoor"))
    root, prepared, run = made["root"], made["prepared"], made["run"]
    loaded = load_model(run)
    feats = {name: dataset_features(loaded, prepared, name, batch_size=8) for name in ("tiny", "tiny2")}
    caches = {name: save_dataset_features(root / "features", f) for name, f in feats.items()}
    return {"root": root, "prepared": prepared, "run": run, "feats": feats, "caches": caches}


@pytest.fixture
def extractions(monkeypatch):
    """The datasets the tool extracts features of (the real extraction, counted)."""
    done: list[str] = []
    real = tool.dataset_features

    def counted(loaded, root, name, **kwargs):
        done.append(name)
        return real(loaded, root, name, **kwargs)

    monkeypatch.setattr(tool, "dataset_features", counted)
    return done


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------
# F2: option conflicts are refused before any folder is made and any feature extracted
# --------------------------------------------------------------------------

CONFLICTS = [
    (["--protocol", "cuhk03", "--ap", "official"], ["--protocol cuhk03", "--ap official"]),
    (["--protocol", "cuhk03", "--rerank"], ["--rerank", "--protocol cuhk03"]),
    (["--queries", "99"], ["--queries 99", "6 queries (indices 0-5)"]),
    (["--queries", "2,nobody.jpg"], ["--queries nobody.jpg", "'tiny'"]),
]


@pytest.mark.parametrize("extra,words", CONFLICTS, ids=["ap", "rerank", "query-index", "query-name"])
def test_option_conflicts_with_a_model_are_refused_before_extraction_and_folders(
    world, tmp_path, capsys, extractions, extra, words
):
    out, saved = tmp_path / "eval", tmp_path / "features"
    err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny,tiny2",
                           "--out", str(out), "--save-features", str(saved)] + extra, capsys)
    assert all(w in err for w in words), err
    assert extractions == [] and not out.exists() and not saved.exists()


@pytest.mark.parametrize("extra,words", CONFLICTS, ids=["ap", "rerank", "query-index", "query-name"])
def test_option_conflicts_with_feature_files_leave_no_output_folder(world, tmp_path, capsys, extra, words):
    out = tmp_path / "eval"
    err = cli_error(tool, ["evaluate", "--features", str(world["caches"]["tiny"]), "--out", str(out)] + extra, capsys)
    assert all(w in err for w in words), err
    assert not out.exists()


def test_a_rerank_too_large_for_memory_is_refused_from_the_manifest_counts(world, tmp_path, capsys, extractions,
                                                                           monkeypatch):
    import fedreid.eval.rerank as rerank

    sizes = []

    def estimate(n_query, n_gallery, k1=20, k2=6):
        sizes.append((n_query, n_gallery))
        return 5 * 2**30 if n_gallery == world["feats"]["tiny2"].gallery.features.shape[0] else 1

    monkeypatch.setattr(rerank, "estimate_rerank_bytes", estimate)
    out, saved = tmp_path / "eval", tmp_path / "features"
    err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny,tiny2", "--rerank",
                           "--out", str(out), "--save-features", str(saved)], capsys)
    assert err.startswith("error: --rerank on tiny2: k-reciprocal re-ranking of ") and "5.00 GiB" in err
    assert "above --rerank-memory 4 GiB; raise it where" in err
    assert err.rstrip().endswith("evaluate tiny2 without --rerank")
    assert extractions == [] and not out.exists() and not saved.exists()
    expected = [(f.query.features.shape[0], f.gallery.features.shape[0]) for f in world["feats"].values()]
    assert sizes == expected  # the manifests' counts are those the extraction gives
    err = cli_error(tool, ["evaluate", "--features", str(world["caches"]["tiny2"]), "--rerank", "--out", str(out)],
                    capsys)
    assert "--rerank on tiny2: " in err and not out.exists()
    err = cli_error(tool, ["evaluate", "--features", str(world["caches"]["tiny2"]), "--rerank-memory", "8",
                           "--out", str(out)], capsys)
    assert "--rerank-memory applies to --rerank only" in err and not out.exists()


def test_rerank_memory_raises_the_limit_of_the_door_and_of_the_re_ranking(world, tmp_path, monkeypatch):
    import fedreid.eval.rerank as rerank

    limits = []
    real = rerank.k_reciprocal_rerank

    def recorded(qf, gf, **kwargs):
        limits.append(kwargs.get("max_bytes"))
        return real(qf, gf, **kwargs)

    monkeypatch.setattr(rerank, "estimate_rerank_bytes", lambda n_query, n_gallery, k1=20, k2=6: 5 * 2**30)
    monkeypatch.setattr(rerank, "k_reciprocal_rerank", recorded)
    out = tmp_path / "eval"
    assert tool.main(["evaluate", "--features", str(world["caches"]["tiny2"]), "--rerank", "--rerank-memory", "6",
                      "--pictures", "0", "--out", str(out)]) == 0
    assert limits == [6 * 2**30]  # 5 GiB needed fits 6: evaluated, with that limit
    assert json.loads((out / "results.json").read_text())["rerank"] is True


def test_a_query_image_of_the_manifest_is_accepted_before_extraction(world, tmp_path, extractions):
    out = tmp_path / "eval"
    image = world["feats"]["tiny2"].query.paths[1]  # a path of tiny2's query manifest only
    assert tool.main(["evaluate", "--model", str(world["run"]), "--datasets", "tiny,tiny2", "--out", str(out),
                      "--pictures", "0", "--queries", f"3,{image}"]) == 0
    assert extractions == ["tiny", "tiny2"]
    drawn = sorted(p.name for p in (out / "ranked_lists").glob("*.png"))
    assert drawn == ["tiny2_query_q00001.png", "tiny2_query_q00003.png", "tiny_query_q00003.png"]


def test_out_and_save_features_in_the_same_folder_are_refused_naming_both(world, tmp_path, capsys, extractions):
    same = tmp_path / "same"
    for second in (str(same), str(tmp_path / "x" / ".." / "same")):
        err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny",
                               "--out", str(same), "--save-features", second], capsys)
        assert "--out and --save-features name the same folder" in err and str(same) in err
        assert extractions == [] and not same.exists()


def test_a_refused_save_features_folder_puts_out_back_as_it_was(world, tmp_path, capsys, extractions):
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    empty, marked = tmp_path / "empty", tmp_path / "marked"
    empty.mkdir()
    assert tool.main(["evaluate", "--features", str(world["caches"]["tiny"]), "--out", str(marked),
                      "--pictures", "0"]) == 0
    before = _tree(marked)
    capsys.readouterr()
    for out in (tmp_path / "new" / "deeper" / "eval", empty, marked):
        err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny",
                               "--out", str(out), "--save-features", str(users)], capsys)
        assert str(users) in err and "--save-features" in err and "notes.txt" in err
    assert extractions == []
    assert not (tmp_path / "new").exists()  # the folders the claim of --out made are gone again
    assert empty.is_dir() and list(empty.iterdir()) == []  # its marker is gone, the folder stays
    assert _tree(marked) == before  # a folder that was marked keeps its marker and results
    assert _tree(users) == {"notes.txt": b"mine"}


@pytest.mark.parametrize("setting,words", [
    ("model.height=128", "model.height is 128 (override model.height) but the model file"),
    ("model.bottleneck_dim=64", "model.bottleneck_dim is 64 (override model.bottleneck_dim)"),
    ("model.backbone=mobilenetv2_100", "model.backbone is 'mobilenetv2_100' (override model.backbone)"),
])
def test_a_model_setting_the_model_file_contradicts_is_refused_at_the_door(world, tmp_path, capsys, extractions,
                                                                         setting, words):
    out = tmp_path / "eval"
    err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny", "--out", str(out),
                           setting], capsys)
    assert words in err and "the model file decides the architecture and the input size" in err
    assert extractions == [] and not out.exists()


def test_a_config_file_whose_model_section_contradicts_the_model_file_is_named(world, tmp_path, capsys, extractions):
    config = tmp_path / "other.yaml"
    config.write_text(f"data:\n  prepared_root: {world['prepared']}\nmodel:\n  backbone: resnet18\n  width: 64\n")
    err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--config", str(config), "--datasets", "tiny",
                           "--out", str(tmp_path / "eval")], capsys)
    assert f"model.width is 64 (config file {config}) but the model file" in err and extractions == []
    config.write_text(f"data:\n  prepared_root: {world['prepared']}\nmodel:\n  backbone: resnet18\n  width: 16\n")
    assert tool.main(["evaluate", "--model", str(world["run"]), "--config", str(config), "--datasets", "tiny",
                      "--out", str(tmp_path / "eval"), "--pictures", "0", "--device", "cpu"]) == 0


def test_a_damaged_image_met_while_extracting_leaves_out_as_it_was(world, tmp_path, capsys, monkeypatch):
    from fedreid.data.images import ImageReadError

    def damaged(*args, **kwargs):
        raise ImageReadError("image /data/x.jpg is damaged")

    monkeypatch.setattr(tool, "dataset_features", damaged)
    out = tmp_path / "new" / "eval"
    err = cli_error(tool, ["evaluate", "--model", str(world["run"]), "--datasets", "tiny", "--out", str(out)], capsys)
    assert "damaged" in err and not (tmp_path / "new").exists()


# --------------------------------------------------------------------------
# F3: a broken model file is the model file's problem, whatever the datasets
# --------------------------------------------------------------------------


def test_a_broken_model_file_without_a_run_config_is_named_before_the_datasets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no datasets/prepared here: the default datasets do not exist
    junk = tmp_path / "junk.pt"
    junk.write_text("not a model\n")
    err = cli_error(tool, ["evaluate", "--model", str(junk)], capsys)
    assert f"model file {junk} is not a PyTorch file: it is a text file" in err
    assert "dataset" not in err.split(";")[0]


# --------------------------------------------------------------------------
# F4: feature files that record no model are named in a WARNING and in results.json
# --------------------------------------------------------------------------


def _without_model(world, folder: Path, name: str) -> Path:
    from fedreid.inference.dataset_features import save_dataset_features

    feats = world["feats"][name]
    meta = {k: v for k, v in feats.meta.items() if k not in ("model", "round", "model_fingerprint")}
    folder.mkdir(exist_ok=True)
    return save_dataset_features(folder, dataclasses.replace(feats, meta=meta))


def test_feature_files_that_record_no_model_are_named_in_one_warning(world, tmp_path, capsys):
    known = world["caches"]["tiny"]
    unknown = _without_model(world, tmp_path / "old", "tiny2")
    out = tmp_path / "mixed"
    assert tool.main(["evaluate", "--features", f"{known},{unknown}", "--out", str(out), "--pictures", "0"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and str(unknown) in warnings[0] and str(known) not in warnings[0]
    assert "cannot be checked to come from one model" in warnings[0]
    results = json.loads((out / "results.json").read_text())
    assert results["model"] is None and results["unrecorded_model"] == ["tiny2"]
    assert "mean" in results  # evaluated, as before: only named

    # one model's files, or a single file that names none: nothing to warn about
    for files, unrecorded in (([known, world["caches"]["tiny2"]], []), ([unknown], [])):
        out = tmp_path / f"out{len(files)}"
        assert tool.main(["evaluate", "--features", ",".join(map(str, files)), "--out", str(out),
                          "--pictures", "0"]) == 0
        assert "WARNING" not in capsys.readouterr().out
        assert json.loads((out / "results.json").read_text())["unrecorded_model"] == unrecorded


def test_feature_files_of_different_models_stay_refused(world, tmp_path, capsys):
    feats = world["feats"]["tiny2"]
    other = {**feats.meta, "model": str(tmp_path / "other.pt"),
             "model_fingerprint": {**feats.meta["model_fingerprint"], "weights_sha256": "0" * 64}}
    from fedreid.inference.dataset_features import save_dataset_features

    path = save_dataset_features(tmp_path / "other", dataclasses.replace(feats, meta=other))
    err = cli_error(tool, ["evaluate", "--features", f"{world['caches']['tiny']},{path}",
                           "--out", str(tmp_path / "o")], capsys)
    assert "come from different models" in err and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------
# F5: queries without a true match are counted under the table
# --------------------------------------------------------------------------


@pytest.mark.parametrize("ap,how", [("standard", "left out of Rank-k and mAP"), ("official", "scored 0 in Rank-k and mAP")])
def test_queries_without_a_match_are_counted_under_the_table(world, tmp_path, capsys, ap, how):
    from fedreid.eval.metrics import evaluate
    from fedreid.inference.dataset_features import save_dataset_features

    feats = world["feats"]["tiny"]
    pids = feats.query.pids.copy()
    pids[[1, 4]] = 999  # no gallery image of theirs
    strangers = dataclasses.replace(feats, query=feats.query._replace(pids=pids))
    path = save_dataset_features(tmp_path / "feats", strangers)
    out = tmp_path / "eval"
    assert tool.main(["evaluate", "--features", str(path), "--out", str(out), "--ap", ap, "--pictures", "0"]) == 0
    printed = capsys.readouterr().out
    assert f"queries without a true match: tiny 2 of 6 ({how})" in printed
    row = json.loads((out / "results.json").read_text())["datasets"]["tiny"]
    q, g = strangers.query, strangers.gallery
    expected = evaluate(q.features, g.features, q.pids, g.pids, q.camids, g.camids, ap=ap)
    assert row["mAP"] == expected["mAP"] and row["rank1"] == expected["rank1"]  # the numbers are unchanged
    assert f"| tiny | {100 * row['rank1']:.1f} |" in printed

    assert tool.main(["evaluate", "--features", str(world["caches"]["tiny"]), "--out", str(tmp_path / "e2"),
                      "--ap", ap, "--pictures", "0"]) == 0
    assert "without a true match" not in capsys.readouterr().out  # every query has one: no line
