"""tools/eval_reid.py: evaluate (model and cached features), index + query, bad inputs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from tiny_runs import write_eval_world
from tool_loader import cli_error, load_tool

from fedreid.config import ConfigError, load_config, to_dict
from fedreid.data.prepared import PreparedDatasetError

tool = load_tool("eval_reid", "eval_reid_tool")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A prepared dataset ``tiny`` (6 query ids, 2 cameras) and a run folder with model_final.pt + config.yaml."""
    return write_eval_world(tmp_path_factory.mktemp("evaltool"))


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "evaluate --model" in out and "query --model" in out
    for command in ("evaluate", "index", "query", "serve", "export"):  # each command's own help teaches too
        with pytest.raises(SystemExit):
            tool.main([command, "--help"])
        out = capsys.readouterr().out
        assert f"python tools/eval_reid.py {command} " in out, command


def test_evaluate_then_rerun_from_features(world, capsys):
    run, out = world["run"], world["root"] / "eval1"
    feats_dir = world["root"] / "feats"
    code = tool.main(["evaluate", "--model", str(run), "--datasets", "tiny,tiny2", "--save-features", str(feats_dir),
                      "--out", str(out), "--pictures", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| tiny |" in printed and "| tiny2 |" in printed and "**mean**" in printed and "Rank-1" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["datasets"]) == {"tiny", "tiny2"}
    for row in results["datasets"].values():
        assert {"rank1", "rank5", "rank10", "mAP", "cmc", "num_queries", "num_gallery"} <= set(row)
        assert 0 <= row["mAP"] <= 1 and len(row["cmc"]) == 20
    assert results["datasets"]["tiny"]["num_queries"] == 6 and results["datasets"]["tiny"]["num_gallery"] == 12
    assert set(results["mean"]) == {"rank1", "rank5", "rank10", "mAP"}
    assert (out / "cmc.png").stat().st_size > 0
    pngs = sorted(p.name for p in (out / "ranked_lists").glob("*.png"))
    assert len(pngs) == 6 and sum("tiny_best" in p for p in pngs) == 2 and sum("tiny_worst" in p for p in pngs) == 1
    assert (feats_dir / "tiny.npz").is_file() and (feats_dir / "tiny2.npz").is_file()

    out2 = world["root"] / "eval2"
    code = tool.main(["evaluate", "--features", f"tiny={feats_dir / 'tiny.npz'},{feats_dir / 'tiny2.npz'}",
                      "--out", str(out2)])
    assert code == 0
    again = json.loads((out2 / "results.json").read_text())
    assert again["datasets"] == results["datasets"] and again["mean"] == results["mean"]


def test_evaluate_defaults_from_run_config_with_rerank(world, capsys):
    code = tool.main(["evaluate", "--model", str(world["run"] / "model_final.pt"), "--rerank", "--ap", "official",
                      "--pictures", "1"])
    assert code == 0
    results = json.loads((world["run"] / "eval" / "results.json").read_text())
    assert list(results["datasets"]) == ["tiny"]  # data.datasets of the run's config.yaml
    assert results["rerank"] is True and results["ap"] == "official"
    assert len(list((world["run"] / "eval" / "ranked_lists").glob("tiny_*.png"))) == 1


def _run_folder(world, folder: Path) -> Path:
    """A copy of the world's run as train_fed leaves one: marked, with a metrics.jsonl (round 2, model_final's)."""
    from fedreid.utils.io import marker_path

    shutil.copytree(world["run"], folder)
    marker_path(folder, "run").write_text('{"kind": "run"}')
    row = {"round": 2, "mode": "fedpav", "clients": ["tiny"], "train_loss": 2.0,
           "comm": {"total_bytes": 2**20, "cumulative_bytes": 2**20}}
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def test_evaluating_a_run_folder_adds_the_results_to_its_report(world, tmp_path, capsys):
    run = _run_folder(world, tmp_path / "run")
    assert tool.main(["evaluate", "--model", str(run), "--pictures", "2"]) == 0
    assert f"report: {run / 'report.md'}" in capsys.readouterr().out
    report = (run / "report.md").read_text()
    section = report[report.index("## Retrieval evaluation"):]
    assert "| tiny |" in section and "![CMC](eval/cmc.png)" in section
    links = [line[line.index("](") + 2:-1] for line in section.splitlines() if line.startswith("![")]
    assert len(links) == 3 and all((run / link).is_file() for link in links)
    assert sum(link.startswith("eval/ranked_lists/tiny_") for link in links) == 2


def _market_gallery(world, folder: Path) -> list[Path]:
    """Copy the tiny gallery under Market-style names (nested folders) plus one unnamed image."""
    from fedreid.data.prepared import load_prepared

    copied = []
    for k, rec in enumerate(load_prepared(world["prepared"], "tiny").split("gallery")):
        dst = folder / f"cam{rec.camid}" / f"{rec.pid:04d}_c{rec.camid + 1}s1_{k:06d}_01.png"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(rec.path, dst)
        copied.append(dst)
    shutil.copy(copied[0], folder / "unnamed.jpg.png")
    return copied


def test_index_and_query_round_trip(world, capsys):
    gallery, index = world["root"] / "gallery", world["root"] / "index"
    copied = _market_gallery(world, gallery)
    assert tool.main(["index", "--model", str(world["run"]), "--gallery", str(gallery), "--index", str(index)]) == 0
    assert "indexed 13 images" in capsys.readouterr().out
    query, pics = copied[3], world["root"] / "qpics"
    assert tool.main(["query", "--index", str(index), "--model", str(world["run"]), "--images", str(query),
                      "--top-k", "5", "--out", str(pics)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(query)
    rank, score, path = lines[1].split()[:3]
    assert rank == "1" and abs(float(score) - 1.0) < 1e-4 and Path(path).resolve() == query.resolve()
    assert len(lines) == 1 + 5 + 1 and lines[1].endswith(" +")
    assert len(list(pics.glob("*.png"))) == 1

    from fedreid.inference.model_io import load_model
    from fedreid.retrieval.folders import query_index

    loaded = load_model(world["run"])
    results = query_index(loaded, index, gallery, top_k=3)
    assert len(results) == 13
    unnamed = next(r for r in results if r.path.endswith("unnamed.jpg.png"))
    assert unnamed.pid == -1 and all(m["correct"] is None for m in unnamed.matches)
    for r in results:  # every gallery image finds itself (or its exact copy) first
        assert r.matches[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_checkpoint_format_loads(world, tmp_path):
    from fedreid.inference.model_io import load_model

    payload = torch.load(world["run"] / "model_final.pt", weights_only=True)
    cfg = load_config(world["run"] / "config.yaml", ["model.bottleneck_dim=32"])
    torch.save({"format": "fedreid.fl.checkpoint", "version": 1, "round": 2, "config": to_dict(cfg),
                "server": {"global_state": payload["state"]}}, tmp_path / "checkpoint.pt")
    a, b = load_model(tmp_path), load_model(world["run"])
    assert a.source.name == "checkpoint.pt" and b.source.name == "model_final.pt"
    x = torch.randn(2, 3, 32, 16)
    assert torch.equal(a.model.embed(x), b.model.embed(x))


def _cli_error(argv, capsys) -> str:
    return cli_error(tool, argv, capsys)


def test_bad_inputs_give_one_line(world, tmp_path, capsys):
    missing = tmp_path / "nope" / "model_final.pt"
    assert str(missing) in _cli_error(["evaluate", "--model", str(missing), "--datasets", "tiny"], capsys)
    err = _cli_error(["evaluate", "--model", str(world["run"]), "--datasets", "tiny,market9"], capsys)
    assert "market9" in err and str(world["prepared"] / "market9") in err
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("x")
    err = _cli_error(["index", "--model", str(world["run"]), "--gallery", str(empty), "--index", str(tmp_path / "i")],
                     capsys)
    assert str(empty) in err and "no jpg/png/bmp" in err
    err = _cli_error(["query", "--model", str(world["run"]), "--index", str(tmp_path / "noindex"),
                      "--images", str(empty)], capsys)
    assert str(tmp_path / "noindex") in err
    bad = tmp_path / "bad.pt"
    torch.save({"format": "something"}, bad)
    assert str(bad) in _cli_error(["index", "--model", str(bad), "--gallery", str(empty), "--index", "x"], capsys)
    # the error types are ones run_main prints
    from fedreid.inference.errors import EvalInputError
    from fedreid.inference.images import parse_market_name
    from fedreid.inference.model_io import find_model_file

    assert issubclass(EvalInputError, ConfigError) and issubclass(PreparedDatasetError, ValueError)
    with pytest.raises(FileNotFoundError):
        find_model_file(missing)
    assert parse_market_name("0002_c3s1_000451_01.jpg") == (2, 2)
    assert parse_market_name("-1_c1s1_x.jpg") == (-1, 0) and parse_market_name("a_b.png") == (-1, -1)


def test_local_baseline_needs_a_client(world, tmp_path, capsys):
    payload = torch.load(world["run"] / "model_final.pt", weights_only=True)
    other = {k: v * 0.9 if v.is_floating_point() else v for k, v in payload["state"].items()}
    payload.update(mode="local", client_states={"tiny": other, "tiny2": payload["state"]})
    run = tmp_path / "local"
    shutil.copytree(world["run"], run)
    torch.save(payload, run / "model_final.pt")
    err = _cli_error(["evaluate", "--model", str(run)], capsys)
    assert "local-training baseline" in err and "--client (tiny, tiny2)" in err
    assert "has no client 'x'" in _cli_error(["evaluate", "--model", str(run), "--client", "x"], capsys)
    assert "drop --client" in _cli_error(["evaluate", "--model", str(world["run"]), "--client", "tiny"], capsys)

    from fedreid.inference.model_io import load_model

    x = torch.randn(2, 3, 32, 16)
    own = load_model(run, client="tiny").model.embed(x)
    assert not torch.equal(own, load_model(world["run"]).model.embed(x))
    assert torch.equal(load_model(run, client="tiny2").model.embed(x), load_model(world["run"]).model.embed(x))
    assert tool.main(["evaluate", "--model", str(run), "--client", "tiny", "--out", str(tmp_path / "ev")]) == 0


def test_a_local_baseline_checkpoint_gives_the_clients_trained_models(world, tmp_path, capsys):
    """checkpoint.pt of fl.mode=local: the clients' own models, never the untrained global start."""
    from fedreid.inference.model_io import load_model
    from fedreid.utils.checkpoint import CHECKPOINT_FORMAT

    payload = torch.load(world["run"] / "model_final.pt", weights_only=True)
    start = payload["state"]
    trained = {k: v * 0.9 if v.is_floating_point() else v for k, v in start.items()}
    checkpoint = {"format": CHECKPOINT_FORMAT, "round": 2,
                  "config": {"task": "reid", "model": payload["model"], "fl": {"mode": "local"}},
                  "server": {"global_state": start, "local_states": {1: trained, 0: start},
                             "client_names": ["tiny", "tiny2"]}}
    run = tmp_path / "local"
    shutil.copytree(world["run"], run)  # its config.yaml names the datasets
    (run / "model_final.pt").unlink()  # an interrupted run: the checkpoint is what there is
    torch.save(checkpoint, run / "checkpoint.pt")
    x = torch.randn(2, 3, 32, 16)
    expected = load_model(world["run"]).model.embed(x)
    assert not torch.equal(load_model(run, client="tiny2").model.embed(x), expected)
    assert torch.equal(load_model(run, client="tiny").model.embed(x), expected)
    err = _cli_error(["evaluate", "--model", str(run)], capsys)
    assert "local-training baseline" in err and "--client (tiny, tiny2)" in err
    from fedreid.eval.report import _retrieval_section
    from fedreid.inference.dataset_features import load_dataset_features

    for client in ("tiny", "tiny2"):  # results.json, the features and the report name the client's model
        saved = tmp_path / f"features_{client}"
        assert tool.main(["evaluate", "--model", str(run), "--client", client, "--datasets", "tiny", "--pictures",
                          "0", "--device", "cpu", "--out", str(run / "eval"), "--save-features", str(saved)]) == 0
        assert json.loads((run / "eval" / "results.json").read_text())["model"]["client"] == client
        assert load_dataset_features(saved / "tiny.npz", "tiny").meta["client"] == client
        assert f"Model `checkpoint.pt`, client `{client}` (round 2)" in "\n".join(_retrieval_section(run))
    checkpoint["server"]["local_states"] = {}
    torch.save(checkpoint, run / "checkpoint.pt")
    assert "have not trained yet" in _cli_error(["evaluate", "--model", str(run), "--client", "tiny"], capsys)
    checkpoint["config"] = dict(checkpoint["config"], task="classification", fl={"mode": "fedpav"})
    torch.save(checkpoint, run / "checkpoint.pt")
    assert "holds a classification model, not a person re-identification model" in _cli_error(
        ["evaluate", "--model", str(run)], capsys)


def test_a_cuda_device_this_machine_lacks_is_one_line(monkeypatch):
    from fedreid.inference.devices import resolve_device
    from fedreid.inference.errors import EvalInputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EvalInputError, match="--device cuda: no CUDA device is available here"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EvalInputError, match="has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == torch.device("cuda:1")


# --------------------------------------------------------------------------
# Pictures without a query x gallery matrix (the rows of the drawn queries only)
# --------------------------------------------------------------------------


def _random_features(seed: int, n_q: int, n_g: int, *, dim: int = 8, exact: bool = False):
    """In-memory DatasetFeatures: clustered ids, 3 cameras, junk and distractors in the gallery."""
    import numpy as np

    from fedreid.inference.dataset_features import DatasetFeatures
    from fedreid.inference.features import FeatureSet

    rng = np.random.default_rng(seed)
    n_ids = max(2, n_q // 3)
    centres = rng.standard_normal((n_ids + 1, dim))
    q_pids = rng.integers(1, n_ids + 1, n_q)
    g_pids = rng.integers(-1, n_ids + 1, n_g)  # -1 junk, 0 distractors

    def feats(pids):
        x = centres[np.maximum(pids, 0)] + 0.9 * rng.standard_normal((pids.size, dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        if exact:  # quarter steps: every dot product is exact in any order, so ties are real
            x = np.round(x * 4) / 4
        return np.ascontiguousarray(x, dtype=np.float32)

    def part(pids, side):
        return FeatureSet(feats(pids), pids, rng.integers(0, 3, pids.size), [f"{side}/{i}.jpg" for i in range(pids.size)])

    return DatasetFeatures("rand", part(q_pids, "q"), part(g_pids, "g"), source="test")


@pytest.mark.parametrize("exact", [False, True])
def test_ranked_lists_equal_the_full_matrix_approach(exact):
    import numpy as np

    from fedreid.eval.metrics import gallery_masks, ranking_order
    from fedreid.eval.protocols import evaluate_dataset
    from fedreid.eval.query_picking import ranked_lists

    for seed in range(8):
        feats = _random_features(seed, 40, 150, exact=exact)
        q, g = feats.query, feats.gallery
        result, reranked = evaluate_dataset(feats)
        assert reranked is None  # no query x gallery matrix is kept (or built)
        chosen = [3, 0, 17]
        lists = ranked_lists(feats, result, pictures=5, queries=chosen, top_k=10)

        # The full-matrix way: every score, a full stable sort of every filtered row.
        sim = q.features @ g.features.T
        ap, valid = np.zeros(len(q.pids)), np.zeros(len(q.pids), bool)
        full_top = []
        for i in range(len(q.pids)):
            keep, good = gallery_masks(q.pids[i], q.camids[i], g.pids, g.camids)
            kept = np.flatnonzero(keep)
            order = kept[ranking_order(sim[i, kept])]
            full_top.append(order[:10])
            hits = good[order]
            if hits.any():
                valid[i] = True
                ap[i] = np.mean(np.cumsum(hits)[hits] / (np.flatnonzero(hits) + 1))
        ids = np.flatnonzero(valid)
        best = list(ids[np.argsort(-ap[ids], kind="stable")[:3]])
        rest = [i for i in ids if i not in best]
        worst = [rest[j] for j in np.argsort(ap[rest], kind="stable")[:2]]
        expected = [(i, "best") for i in best] + [(i, "worst") for i in worst] + [(i, "query") for i in chosen]

        assert [(r.query, r.tag) for r in lists] == expected, seed
        for r in lists:
            np.testing.assert_array_equal(r.gallery, full_top[r.query])
            np.testing.assert_array_equal(r.correct, g.pids[r.gallery] == q.pids[r.query])
            if exact:
                np.testing.assert_array_equal(r.scores, sim[r.query, r.gallery])
            else:
                np.testing.assert_allclose(r.scores, sim[r.query, r.gallery], rtol=0, atol=1e-6)


def test_evaluation_and_pictures_stay_far_below_a_score_matrix():
    import tracemalloc

    import fedreid.eval.visualize  # noqa: F401 - imported before tracing: cv2/matplotlib module memory is no score
    from fedreid.eval.protocols import evaluate_dataset
    from fedreid.eval.query_picking import ranked_lists

    n_q, n_g = 1500, 12000
    feats = _random_features(0, n_q, n_g, dim=16)
    matrix_bytes = 4 * n_q * n_g  # 72 MB
    tracemalloc.start()
    try:
        result, reranked = evaluate_dataset(feats, max_block_bytes=2 * 2**20)
        lists = ranked_lists(feats, result, pictures=6, queries=[5, 7])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reranked is None and len(lists) == 8
    assert peak < matrix_bytes / 8, f"peak {peak / 2**20:.1f} MiB vs a {matrix_bytes / 2**20:.0f} MiB matrix"


# --------------------------------------------------------------------------
# Feature files: errors, chosen queries, the CUHK03 protocol
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(world):
    """tiny.npz: the features of the tiny dataset (6 queries, 12 gallery images)."""
    from fedreid.inference.dataset_features import dataset_features, save_dataset_features
    from fedreid.inference.model_io import load_model

    feats = dataset_features(load_model(world["run"]), world["prepared"], "tiny", batch_size=8)
    return save_dataset_features(world["root"] / "cache", feats), feats


def _write_cache(path, feats, *, query_rows=None, gallery_rows=None, query_pids=None):
    from fedreid.inference.dataset_features import save_dataset_features

    def cut(fs, rows):
        return fs if rows is None else fs._replace(
            features=fs.features[rows], pids=fs.pids[rows], camids=fs.camids[rows], paths=[fs.paths[i] for i in rows]
        )

    q, g = cut(feats.query, query_rows), cut(feats.gallery, gallery_rows)
    if query_pids is not None:
        q = q._replace(pids=query_pids)
    return save_dataset_features(path.parent, dataclasses.replace(feats, name=path.stem, query=q, gallery=g))


def test_bad_feature_files_give_one_line_naming_the_file(cache, tmp_path, capsys):
    import numpy as np

    _, feats = cache
    nan = feats.query.features.copy()
    nan[2, 5] = np.nan
    path = _write_cache(tmp_path / "withnan.npz", dataclasses.replace(feats, query=feats.query._replace(features=nan)))
    err = _cli_error(["evaluate", "--features", str(path), "--out", str(tmp_path / "o")], capsys)
    assert str(path) in err and "NaN" in err and "query row 2" in err and feats.query.paths[2] in err

    empty = _write_cache(tmp_path / "nogallery.npz", feats, gallery_rows=[])
    err = _cli_error(["evaluate", "--features", str(empty), "--out", str(tmp_path / "o")], capsys)
    assert str(empty) in err and "gallery is empty" in err

    strangers = _write_cache(tmp_path / "nomatch.npz", feats, query_pids=np.full(6, 999))
    err = _cli_error(["evaluate", "--features", str(strangers), "--out", str(tmp_path / "o")], capsys)
    assert str(strangers) in err and "none of the 6 queries has a true match" in err
    assert "'nomatch'" in err  # and the dataset


def test_chosen_queries_are_drawn(cache, tmp_path, capsys):
    from fedreid.eval.query_picking import chosen_queries
    from fedreid.inference.dataset_features import DatasetFeatures
    from fedreid.inference.errors import EvalInputError

    path, feats = cache
    qpaths = feats.query.paths
    out = tmp_path / "eval"
    specs = f"4,{Path(qpaths[1]).name}"
    assert tool.main(["evaluate", "--features", str(path), "--out", str(out), "--pictures", "0",
                      "--queries", specs, "--queries", qpaths[4]]) == 0
    pngs = sorted(p.name for p in (out / "ranked_lists").glob("*.png"))
    assert pngs == ["tiny_query_q00001.png", "tiny_query_q00004.png"]  # index 4 and its path: drawn once
    results = json.loads((out / "results.json").read_text())
    assert len(results["pictures"]) == 2 and results["protocol"] == "standard"

    assert chosen_queries(feats, ["2", str(Path(qpaths[3]).resolve()), Path(qpaths[0]).name]) == [2, 3, 0]
    err = _cli_error(["evaluate", "--features", str(path), "--out", str(out), "--queries", "6"], capsys)
    assert "--queries 6" in err and "6 queries (indices 0-5)" in err
    err = _cli_error(["evaluate", "--features", str(path), "--out", str(out), "--queries", "nobody.jpg"], capsys)
    assert "--queries nobody.jpg" in err and "'tiny'" in err
    twins = DatasetFeatures("t", feats.query._replace(paths=["a/x.png", "b/x.png"] + qpaths[2:]), feats.gallery)
    with pytest.raises(EvalInputError, match="2 query images of dataset 't' have that file name"):
        chosen_queries(twins, ["x.png"])
    assert chosen_queries(twins, ["b/x.png"]) == [1]
    # the path inside the prepared dataset, as its manifest lists it (a tail of the stored path)
    stored = ["/srv/prepared/t/images/query/x.png", "/srv/prepared/t/images/extra/x.png"]
    deep = DatasetFeatures("t", feats.query._replace(paths=stored + qpaths[2:]), feats.gallery)
    assert chosen_queries(deep, ["images/query/x.png"]) == [0] and chosen_queries(deep, ["extra/x.png"]) == [1]
    with pytest.raises(EvalInputError, match="not a query index or an image"):
        chosen_queries(deep, ["images/gallery/x.png"])


def test_cuhk03_protocol(cache, tmp_path, capsys):
    import numpy as np

    from fedreid.eval.metrics import evaluate_cuhk03_single_shot

    path, feats = cache
    out = tmp_path / "eval"
    assert tool.main(["evaluate", "--features", str(path), "--out", str(out), "--protocol", "cuhk03",
                      "--seed", "7", "--pictures", "1"]) == 0
    assert "CUHK03 single-gallery-shot CMC, seed 7" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "cuhk03" and results["seed"] == 7 and results["repeats"] == 10
    q, g = feats.query, feats.gallery
    expected = evaluate_cuhk03_single_shot(q.features, g.features, q.pids, g.pids, q.camids, g.camids,
                                           rng=np.random.default_rng(7), num_repeats=10, ranks=range(1, 21))
    row = results["datasets"]["tiny"]
    assert row["rank1"] == expected["rank1"] and row["mAP"] == expected["mAP"]
    assert row["cmc"] == [expected[f"rank{k}"] for k in range(1, 21)]
    assert len(results["pictures"]) == 1

    err = _cli_error(["evaluate", "--features", str(path), "--out", str(out), "--protocol", "cuhk03", "--rerank"],
                     capsys)
    assert "--rerank" in err and "cuhk03" in err
    err = _cli_error(["evaluate", "--features", str(path), "--out", str(out), "--protocol", "cuhk03", "--ap",
                      "official"], capsys)
    assert "standard AP" in err


# --------------------------------------------------------------------------
# CUDA speedups and the FAISS GPU index: flags, defaults, errors
# --------------------------------------------------------------------------


def test_speedup_defaults_follow_the_device():
    from fedreid.inference.devices import resolve_speedups
    from fedreid.inference.errors import EvalInputError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_speedups(cuda) == (True, True)
    assert resolve_speedups(cuda, False, None) == (False, True)
    assert resolve_speedups(cpu) == (False, False)
    assert resolve_speedups(cpu, False, False) == (False, False)
    with pytest.raises(EvalInputError, match="--amp and --channels-last only apply on a CUDA device"):
        resolve_speedups(cpu, True, True)


@pytest.mark.parametrize("flip", ["true", "false"])
def test_evaluate_extracts_the_runs_own_evaluation_features(world, tmp_path, flip):
    """In each eval.precision, with and without eval.flip, the tool's features are the run's Evaluator's, bit for bit."""
    from fedreid.data.prepared import load_prepared
    from fedreid.fl.evaluation import Evaluator
    from fedreid.inference.dataset_features import load_dataset_features
    from fedreid.inference.model_io import load_model

    model = load_model(world["run"] / "model_final.pt", "cpu").model
    tools = {}
    for precision in ("fp32", "bf16"):
        override = f"eval.precision={precision}"
        cfg = load_config(world["run"] / "config.yaml", [override, f"eval.flip={flip}"])
        evaluator = Evaluator.from_config(cfg, {"tiny": load_prepared(world["prepared"], "tiny")}, "cpu", workers=0)
        run = evaluator.split_features(model, ["tiny"])
        saved = tmp_path / f"features_{precision}"
        assert tool.main(["evaluate", "--model", str(world["run"]), "--datasets", "tiny", "--pictures", "0",
                          "--device", "cpu", "--out", str(tmp_path / precision), "--save-features", str(saved),
                          override, f"eval.flip={flip}"]) == 0
        tools[precision] = load_dataset_features(saved / "tiny.npz", "tiny")
        assert tools[precision].meta["precision"] == precision
        assert tools[precision].meta["flip"] is (flip == "true")
        for split in ("query", "gallery"):
            assert torch.equal(torch.from_numpy(getattr(tools[precision], split).features), run[("tiny", split)])
    # the two arithmetics give different features, so the comparison above tells them apart
    assert not (tools["fp32"].query.features == tools["bf16"].query.features).all()


def test_evaluate_precision_on_cuda_defaults_to_the_runs_fp32():
    """On CUDA, evaluate extracts as the run evaluated (fp32, plain layout); --amp is fp16 in channels-last."""
    import argparse

    from fedreid.commands.eval_args import evaluation_precision

    cuda = torch.device("cuda")  # fp32 and fp16 resolve without asking the card anything

    def decided(configured="fp32", **flags):
        args = argparse.Namespace(**{"amp": None, "precision": None, "channels_last": None, **flags})
        p = evaluation_precision(args, configured, cuda)
        return p.name, p.device_type, p.channels_last

    assert decided() == ("fp32", "cuda", False)
    assert decided(amp=True) == ("fp16", "cuda", True)
    assert decided(precision="fp16", channels_last=False) == ("fp16", "cuda", False)
    assert decided(configured="fp16") == ("fp16", "cuda", True)
    assert decided(configured="fp16", amp=False) == ("fp32", "cuda", False)
    assert decided(channels_last=True) == ("fp32", "cuda", True)


def test_speedup_flags_reach_the_extraction(world, tmp_path, monkeypatch, capsys):
    from fedreid.inference import devices
    from fedreid.inference.features import extract_features

    seen = []
    real = extract_features

    def recording(*args, **kwargs):
        seen.append((kwargs["amp"], kwargs["channels_last"]))
        with pytest.warns(UserWarning, match="ignored: only used on CUDA") if any(seen[-1]) else nullcontext():
            return real(*args, **kwargs)

    monkeypatch.setattr("fedreid.inference.model_io.extract_features", recording)
    err = _cli_error(["index", "--model", str(world["run"]), "--gallery", ".", "--index", "x", "--device", "cpu",
                      "--channels-last"], capsys)
    assert "--channels-last only applies on a CUDA device" in err

    # What the resolution decides (on for CUDA) is what index and query's extraction gets.
    monkeypatch.setattr(devices, "resolve_speedups", lambda device, amp, cl, backend="pytorch": (True, True))
    gallery = world["root"] / "gallery_speed"
    _market_gallery(world, gallery)
    assert tool.main(["index", "--model", str(world["run"]), "--gallery", str(gallery), "--index",
                      str(tmp_path / "idx"), "--device", "cpu"]) == 0
    assert tool.main(["query", "--model", str(world["run"]), "--index", str(tmp_path / "idx"), "--images",
                      str(gallery), "--device", "cpu"]) == 0
    assert seen == [(True, True)] * 2


def test_evaluate_extracts_in_the_runs_eval_precision(world, tmp_path, monkeypatch, capsys):
    """evaluate's arithmetic: eval.precision by default (fp32: no autocast), --precision, --amp as fp16."""
    from fedreid.inference.features import extract_features

    seen = []
    real = extract_features

    def recording(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        seen.append((kwargs["amp"], kwargs["channels_last"], dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr("fedreid.inference.model_io.extract_features", recording)
    base = ["evaluate", "--model", str(world["run"]), "--datasets", "tiny", "--pictures", "0", "--device", "cpu"]
    assert tool.main(base + ["--out", str(tmp_path / "a")]) == 0
    assert seen == [(False, False, None)] * 2  # query and gallery: fp32, as the run's own evaluation
    assert "extracting features: tiny (fp32)" in capsys.readouterr().out
    fp32 = json.loads((tmp_path / "a" / "results.json").read_text())
    assert fp32["precision"] == {"tiny": "fp32"}

    seen.clear()
    assert tool.main(base + ["--out", str(tmp_path / "b"), "--precision", "bf16"]) == 0
    assert seen == [(False, False, torch.bfloat16)] * 2
    bf16 = json.loads((tmp_path / "b" / "results.json").read_text())
    assert bf16["precision"] == {"tiny": "bf16"}
    # the config's eval.precision is the default
    seen.clear()
    assert tool.main(base + ["--out", str(tmp_path / "c"), "eval.precision=bf16"]) == 0
    assert seen == [(False, False, torch.bfloat16)] * 2

    err = _cli_error(base + ["--out", str(tmp_path / "d"), "--amp"], capsys)
    assert "--amp: fp16 needs a CUDA device" in err
    err = _cli_error(base + ["--out", str(tmp_path / "d"), "eval.precision=fp16"], capsys)
    assert "eval.precision: fp16 needs a CUDA device" in err
    err = _cli_error(base + ["--out", str(tmp_path / "d"), "--amp", "--precision", "fp32"], capsys)
    assert "--amp and --precision both given" in err
    err = _cli_error(base + ["--out", str(tmp_path / "d"), "--channels-last"], capsys)
    assert "--channels-last only applies on a CUDA device" in err and "device is cpu" in err
    assert not (tmp_path / "d").exists()  # refused before any work
    seen.clear()
    assert tool.main(base + ["--out", str(tmp_path / "e"), "--no-amp"]) == 0
    assert seen == [(False, False, None)] * 2


def test_faiss_gpu_flag(world, tmp_path, monkeypatch, capsys):
    from fedreid.retrieval import exact, faiss_gpu
    from fedreid.retrieval.faiss_gpu import resolve_faiss_gpu

    gallery = world["root"] / "gallery_faiss"
    _market_gallery(world, gallery)
    index_args = ["index", "--model", str(world["run"]), "--gallery", str(gallery), "--device", "cpu"]
    query_args = ["query", "--model", str(world["run"]), "--images", str(gallery), "--device", "cpu", "--top-k", "2"]
    if not faiss_gpu.faiss_gpu_available():
        err = _cli_error(index_args + ["--index", str(tmp_path / "i0"), "--faiss-gpu", "on"], capsys)
        assert "GPU faiss index was required" in err and "faiss-gpu" in err
        assert not (tmp_path / "i0").exists()  # refused before any work

    # Plumbing, with faiss pretending to have a GPU: the decision reaches the query's search index (a Flat
    # store's; building a Flat store uses no GPU).
    placed = []
    monkeypatch.setattr(faiss_gpu, "faiss_gpu_available", lambda: True)
    monkeypatch.setattr(exact, "_maybe_to_gpu", lambda index, use_gpu, gpu_id=0: placed.append(use_gpu) or index)
    for mode, expected in (("on", True), ("off", False), ("auto", False)):  # auto: the device is the CPU
        placed.clear()
        folder = tmp_path / f"i_{mode}"
        assert tool.main(index_args + ["--index", str(folder), "--faiss-gpu", mode]) == 0
        assert tool.main(query_args + ["--index", str(folder), "--faiss-gpu", mode]) == 0
        assert placed == [expected], mode
    assert resolve_faiss_gpu("auto", torch.device("cuda")) is True
    assert resolve_faiss_gpu("auto", torch.device("cpu")) is False
    monkeypatch.setattr(faiss_gpu, "faiss_gpu_available", lambda: False)
    assert resolve_faiss_gpu("auto", torch.device("cuda")) is False
    capsys.readouterr()


def test_an_unknown_dataset_under_a_relative_root_names_the_working_directory(tmp_path, monkeypatch):
    from fedreid.data.prepared import PreparedDatasetError
    from fedreid.inference.dataset_features import resolve_datasets

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreparedDatasetError) as info:
        resolve_datasets(["msmt17"], "datasets/prepared")
    assert (f"available under datasets/prepared (relative to the working directory {tmp_path}: "
            f"{tmp_path / 'datasets/prepared'}): none") in str(info.value)
    for name in ("market1501", "msmt17"):
        (tmp_path / "datasets/prepared" / name).mkdir(parents=True)
        (tmp_path / "datasets/prepared" / name / "manifest.csv").write_text("path,pid,camid,split,source\n")
    with pytest.raises(PreparedDatasetError, match=r"unknown dataset 'market' \(did you mean market1501\?\)"):
        resolve_datasets(["market"], "datasets/prepared")


# --------------------------------------------------------------------------
# --features items, and results.json: what the features came from, links of report.md
# --------------------------------------------------------------------------


def test_two_feature_files_of_one_dataset_are_refused_naming_both(world, cache, tmp_path, capsys):
    path, _ = cache
    a, b = tmp_path / "a" / "tiny.npz", tmp_path / "b" / "tiny.npz"
    for copy in (a, b):
        copy.parent.mkdir()
        shutil.copy(path, copy)
    for items in ([f"{a},{b}"], [str(a), f"tiny={b}"]):
        argv = ["evaluate", "--out", str(tmp_path / "out")] + [x for item in items for x in ("--features", item)]
        err = _cli_error(argv, capsys)
        assert "dataset 'tiny' is given twice" in err and str(a) in err and str(b) in err
    assert not (tmp_path / "out").exists()  # refused before the output folder is made
    err = _cli_error(["evaluate", "--model", str(world["run"]), "--datasets", "tiny,tiny2,tiny",
                      "--out", str(tmp_path / "out")], capsys)
    assert "--datasets names 'tiny' twice" in err and not (tmp_path / "out").exists()


def test_feature_files_of_different_models_are_refused(cache, tmp_path, capsys):
    path, feats = cache
    other_meta = {**feats.meta, "model": str(tmp_path / "other" / "model_final.pt"),
                  "model_fingerprint": {**feats.meta["model_fingerprint"], "weights_sha256": "0" * 64}}
    other = _write_cache(tmp_path / "tiny2.npz", dataclasses.replace(feats, meta=other_meta))
    err = _cli_error(["evaluate", "--features", f"{path},{other}", "--out", str(tmp_path / "out")], capsys)
    assert str(path) in err and str(other) in err and "come from different models" in err
    assert not (tmp_path / "out").exists()


def test_a_feature_path_holding_an_equals_sign_is_a_file(cache, tmp_path, capsys):
    from fedreid.commands.eval_reid import _feature_files

    path, _ = cache
    odd = tmp_path / "runs" / "lr=0.1" / "features" / "tiny.npz"
    odd.parent.mkdir(parents=True)
    shutil.copy(path, odd)
    assert _feature_files([str(odd)]) == [(None, str(odd))]
    assert _feature_files([f"tiny={odd}"]) == [("tiny", str(odd))]
    for item in (str(odd), f"tiny={odd}"):
        out = tmp_path / f"out{len(item)}"
        assert tool.main(["evaluate", "--features", item, "--out", str(out), "--pictures", "0"]) == 0
        assert list(json.loads((out / "results.json").read_text())["datasets"]) == ["tiny"]
    missing = f"tiny={tmp_path / 'runs' / 'lr=0.2' / 'tiny.npz'}"
    err = _cli_error(["evaluate", "--features", missing, "--out", str(tmp_path / "o")], capsys)
    assert f"--features {missing}: not an existing file, nor NAME=FILE with an existing FILE" in err


def test_features_keep_their_dataset_name_and_refuse_extraction_options(cache, tmp_path, capsys):
    path, _ = cache
    out = tmp_path / "out"
    err = _cli_error(["evaluate", "--features", f"dukemtmc={path}", "--out", str(out)], capsys)
    assert str(path) in err and "dataset 'tiny', not 'dukemtmc'" in err
    for extra in (["--datasets", "tiny"], ["--prepared-root", str(tmp_path)], ["--batch-size", "4"],
                  ["--save-features", str(tmp_path / "saved")], ["--precision", "fp32"], ["--amp"],
                  ["--no-channels-last"], ["--device", "cpu"], ["--client", "a"]):
        err = _cli_error(["evaluate", "--features", str(path), "--out", str(out)] + extra, capsys)
        assert extra[0] in err and "does not apply to --features" in err, extra
    assert not out.exists() and not (tmp_path / "saved").exists()
    assert tool.main(["evaluate", "--features", str(path), "--out", str(out), "--pictures", "0"]) == 0


def _retrieval_section(report: Path) -> str:
    text = report.read_text()
    return text[text.index("## Retrieval evaluation"):]


def test_report_links_hold_from_any_working_directory_and_after_a_move(world, tmp_path, monkeypatch, capsys):
    from fedreid.eval.report import write_report
    from fedreid.utils.logging import read_metrics

    project = tmp_path / "project"
    run = _run_folder(world, project / "runs" / "r")
    monkeypatch.chdir(project)  # evaluated with a relative path from the project's root
    assert tool.main(["evaluate", "--model", "runs/r", "--pictures", "2"]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["cmc_plot"] == "cmc.png" and all(p.startswith("ranked_lists/tiny_") for p in results["pictures"])
    moved = tmp_path / "archive" / "r"
    moved.parent.mkdir()
    shutil.move(run, moved)
    monkeypatch.chdir(moved.parent)  # the report written again elsewhere (a resumed run, reproduce)
    section = _retrieval_section(write_report(moved, read_metrics(moved)))
    links = [line[line.index("](") + 2:-1] for line in section.splitlines() if line.startswith("![")]
    assert len(links) == 3 and "eval/cmc.png" in links and all((moved / link).is_file() for link in links)


def test_the_report_shows_eval_results_only_as_its_final_models(world, cache, tmp_path, capsys):
    from fedreid.eval.report import write_report
    from fedreid.utils.logging import read_metrics

    run = _run_folder(world, tmp_path / "run")
    assert tool.main(["evaluate", "--model", str(run), "--pictures", "1"]) == 0
    model = json.loads((run / "eval" / "results.json").read_text())["model"]
    assert model["file"] == "../model_final.pt" and model["round"] == 2
    assert len(model["fingerprint"]["weights_sha256"]) == 64
    section = _retrieval_section(run / "report.md")
    assert "| tiny |" in section and "Model `model_final.pt` (round 2)" in section

    # Another run's features (the same weights, another model file) evaluated into this run's eval folder.
    path, _ = cache
    assert tool.main(["evaluate", "--features", str(path), "--out", str(run / "eval"), "--pictures", "1"]) == 0
    section = _retrieval_section(run / "report.md")
    assert "is not shown: it belongs to another model or round" in section
    assert str(world["run"] / "model_final.pt") in section and "| tiny |" not in section and "![" not in section

    # The final model evaluated again, then the run resumed to a later round: the old results are not its.
    assert tool.main(["evaluate", "--model", str(run), "--pictures", "1"]) == 0
    payload = torch.load(run / "model_final.pt", weights_only=True)
    torch.save({**payload, "round": 3}, run / "model_final.pt")
    section = _retrieval_section(write_report(run, read_metrics(run)))
    assert "round 2), not to this run's final model (model_final.pt, round 3)" in section
    assert "| tiny |" not in section
