"""tools/eval_reid.py: evaluate (model and cached features), index + query, bad inputs."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from fl_helpers import write_prepared

from fedreid.config import ConfigError, ModelConfig, dump_config, load_config, to_dict
from fedreid.data.prepared import PreparedDatasetError
from fedreid.models.reid import create_reid_model, shared_state
from fedreid.utils.cli import run_main

TOOL = Path(__file__).resolve().parents[1] / "tools" / "eval_reid.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("eval_reid_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A prepared dataset ``tiny`` (6 query ids, 2 cameras) and a run folder with model_final.pt + config.yaml."""
    root = tmp_path_factory.mktemp("evaltool")
    prepared = root / "prepared"
    write_prepared(prepared, "tiny", num_ids=1, test_ids=6, seed=3)
    write_prepared(prepared, "tiny2", num_ids=1, test_ids=4, seed=5)
    model_cfg = ModelConfig(backbone="resnet18", bottleneck_dim=32, height=32, width=16)
    model = create_reid_model("resnet18", 0, bottleneck_dim=32, seed=0)
    run = root / "run"
    run.mkdir()
    payload = {"format": "fedreid.model", "model": to_dict(model_cfg), "mode": "fedpav", "round": 2,
               "state": shared_state(model)}
    torch.save(payload, run / "model_final.pt")
    cfg = load_config(None, [f"data.prepared_root={prepared}", "data.datasets=[tiny]", "data.public_dataset=null",
                             "model.backbone=resnet18", "model.height=32", "model.width=16", "eval.batch_size=8"])
    (run / "config.yaml").write_text(dump_config(cfg))
    return {"root": root, "prepared": prepared, "run": run}


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "evaluate --model" in out and "query --model" in out


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


def test_evaluating_a_run_folder_adds_the_results_to_its_report(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    row = {"round": 1, "mode": "fedpav", "clients": ["tiny"], "train_loss": 2.0,
           "comm": {"total_bytes": 2**20, "cumulative_bytes": 2**20}}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
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

    from fedreid.eval import pipeline as pl

    loaded = pl.load_model(world["run"])
    results = pl.query_index(loaded, index, gallery, top_k=3)
    assert len(results) == 13
    unnamed = next(r for r in results if r.path.endswith("unnamed.jpg.png"))
    assert unnamed.pid == -1 and all(m["correct"] is None for m in unnamed.matches)
    for r in results:  # every gallery image finds itself (or its exact copy) first
        assert r.matches[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_checkpoint_format_loads(world, tmp_path):
    from fedreid.eval import pipeline as pl

    payload = torch.load(world["run"] / "model_final.pt", weights_only=True)
    cfg = load_config(world["run"] / "config.yaml", ["model.bottleneck_dim=32"])
    torch.save({"format": "fedreid.fl.checkpoint", "version": 1, "round": 2, "config": to_dict(cfg),
                "server": {"global_state": payload["state"]}}, tmp_path / "checkpoint.pt")
    a, b = pl.load_model(tmp_path), pl.load_model(world["run"])
    assert a.source.name == "checkpoint.pt" and b.source.name == "model_final.pt"
    x = torch.randn(2, 3, 32, 16)
    assert torch.equal(a.model.embed(x), b.model.embed(x))


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


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
    from fedreid.eval import pipeline as pl

    assert issubclass(pl.EvalInputError, ConfigError) and issubclass(PreparedDatasetError, ValueError)
    with pytest.raises(FileNotFoundError):
        pl.find_model_file(missing)
    assert pl.parse_market_name("0002_c3s1_000451_01.jpg") == (2, 2)
    assert pl.parse_market_name("-1_c1s1_x.jpg") == (-1, 0) and pl.parse_market_name("a_b.png") == (-1, -1)


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

    from fedreid.eval import pipeline as pl

    x = torch.randn(2, 3, 32, 16)
    own = pl.load_model(run, client="tiny").model.embed(x)
    assert not torch.equal(own, pl.load_model(world["run"]).model.embed(x))
    assert torch.equal(pl.load_model(run, client="tiny2").model.embed(x), pl.load_model(world["run"]).model.embed(x))
    assert tool.main(["evaluate", "--model", str(run), "--client", "tiny", "--out", str(tmp_path / "ev")]) == 0
