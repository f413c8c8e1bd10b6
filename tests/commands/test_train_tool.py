"""tools/train_fed.py: a short run, its printed rounds and report, a resume, bad arguments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fl_helpers import write_world
from tool_loader import load_tool

from fedreid.config import ConfigError
from fedreid.utils.logging import read_metrics

tool = load_tool("train_fed", "train_fed_tool")


def _overrides(root: Path) -> list[str]:
    return [
        f"data.prepared_root={root}", "data.datasets=[dsa,dsb]", "data.public_dataset=null",
        "model.backbone=test_resnet", "model.bottleneck_dim=16", "model.height=32", "model.width=16",
        "train.batch_size=4", "eval.every=2", "eval.batch_size=8", "run.device=cpu", "run.tensorboard=false",
    ]


def test_run_then_resume_to_more_rounds(tmp_path, capsys):
    root = write_world(tmp_path / "prepared")
    run = tmp_path / "run"
    assert tool.main(["--out", str(run), "--rounds", "2", *_overrides(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    rounds = [line for line in out if line.startswith("round ")]
    assert rounds[0].startswith("round 1/2  loss ") and "Rank-1" not in rounds[0]
    assert rounds[1].startswith("round 2/2  loss ") and "mean Rank-1 " in rounds[1] and "mAP " in rounds[1]
    assert any(line.startswith("| **mean** |") for line in out)
    assert out[-1] == f"report: {run / 'report.md'}"
    assert "## Paper convention" in (run / "report.md").read_text()
    assert (run / "model_final.pt").is_file()

    assert tool.main(["--resume", str(run), "--rounds", "3"]) == 0
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    assert "round 3/3  loss " in capsys.readouterr().out
    # log.txt: both starts, each under its header, with what they printed
    log = (run / "log.txt").read_text()
    assert log.count("\nfedreid ") == 2 and "(git " in log and "torch " in log and "command: " in log
    assert "round 1/2  loss " in log and "round 3/3  loss " in log and f"report: {run / 'report.md'}" in log
    assert tool.main(["--resume", str(run)]) == 0  # finished: it says so instead of printing nothing new
    assert f"{run} had already finished its 3 rounds: nothing trained" in capsys.readouterr().out
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    # fewer rounds than done: refused before config.yaml could be rewritten to contradict the checkpoint
    config = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"^fl.rounds=2: the run has already completed 3 rounds"):
        tool.main(["--resume", str(run), "--rounds", "2"])
    # a resume stays in its folder, and one key set two ways is refused: nothing written
    with pytest.raises(ConfigError, match=rf"^--out does not go with --resume: the run continues in its own folder {run}"):
        tool.main(["--resume", str(run), "--out", str(tmp_path / "elsewhere")])
    with pytest.raises(ConfigError, match=r"^'run.out_dir=/tmp/elsewhere' does not go with --resume"):
        tool.main(["--resume", str(run), "run.out_dir=/tmp/elsewhere", "--rounds", "4"])
    with pytest.raises(ConfigError, match=r"^the override 'fl.rounds=5' and a command-line option \(fl.rounds=4\) "
                                          r"both set fl.rounds: give it once"):
        tool.main(["--resume", str(run), "--rounds", "4", "fl.rounds=5"])
    assert (run / "config.yaml").read_text() == config and [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    assert not (tmp_path / "elsewhere").exists()


def test_round_line_formats_evaluated_rounds():
    record = {"round": 4, "train_loss": 1.23456, "time": {"round": 12.34},
              "eval": {"a": {"rank1": 0.5, "mAP": 0.25}, "b": {"rank1": 0.7, "mAP": 0.35}}}
    assert tool.round_line(record, 10) == "round 4/10  loss 1.235  mean Rank-1 60.0%  mAP 30.0%  12.3 s"


def test_resume_refuses_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--resume uses the run's own config.yaml"):
        tool.main(["--resume", str(tmp_path), "--config", "x.yaml"])


def test_overrides_between_flags_and_an_unknown_backbone(tmp_path, capsys):
    from fedreid.config import load_config
    from fedreid.utils.cli import run_main

    root = write_world(tmp_path / "prepared")
    run = tmp_path / "run"
    # overrides on both sides of a flag (argparse alone stops at the first flag)
    assert tool.main(["fl.rounds=1", "--no-progress", "seed=2", "--out", str(run), *_overrides(root)]) == 0
    cfg = load_config(run / "config.yaml")
    assert cfg.seed == 2 and cfg.fl.rounds == 1
    capsys.readouterr()
    typo = tmp_path / "typo"
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(["--out", str(typo), *_overrides(root), "model.backbone=resnt50"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: model.backbone: unknown backbone 'resnt50'") and "close names: resnet50" in err
    assert not typo.exists()  # refused before any folder was made
    with pytest.raises(ConfigError, match=r"^the override 'run.out_dir=other' and a command-line option"):
        tool.main(["--out", str(typo), "run.out_dir=other", *_overrides(root)])
    assert not typo.exists() and not Path("other").exists()
    assert tool.main(["--out", str(typo), "--rounds", "1", "fl.rounds=1", *_overrides(root)]) == 0  # agreeing: fine


def test_a_run_without_its_inputs_names_every_one_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from fedreid.utils.cli import run_main

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # no datasets/ and no weights/ here
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(["--config", str(repo / "configs/fedreid/fedpav_kd.yaml"), "--out", "X",
                                    "--no-progress"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    names = ["msmt17", "dukemtmc", "market1501", "cuhk03np", "prid2011", "cuhk01", "viper", "3dpes", "ilids",
             "cuhk02 (the public set for KD)"]
    assert all(n in err for n in names) and "2 input(s)" in err
    assert "weights/resnet50-0676ba61.pth" in err and f"relative to the working directory {tmp_path}" in err
    assert "datasets/README.md" in err
    assert not (tmp_path / "X").exists()


@pytest.mark.parametrize("raised, ending", [
    (ConfigError("fl.rounds: expected >= 1"), "error: fl.rounds: expected >= 1\n"),
    (KeyboardInterrupt(), "interrupted\n"),
    (RuntimeError("boom"), "RuntimeError: boom\n"),
])
def test_the_error_that_ends_a_run_is_in_its_log(tmp_path, raised, ending):
    from fedreid.utils.run_log import OutputLog

    log = OutputLog()
    with pytest.raises(type(raised)), log:
        log.start(tmp_path / "log.txt", "header\n")
        print("round 1/2  loss 1.000")
        raise raised
    text = (tmp_path / "log.txt").read_text()
    assert text.startswith("header\nround 1/2  loss 1.000\n") and text.endswith(ending)
    assert ("Traceback" in text) == isinstance(raised, RuntimeError)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_late_config_errors_are_refused_before_the_run_folder_exists(tmp_path):
    root = write_world(tmp_path / "prepared")
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="run.device: 'cuda' was asked for but no CUDA device is available"):
        tool.main(["--out", str(run), "--rounds", "1", *_overrides(root), "run.device=cuda"])
    assert not run.exists()
    with pytest.raises(ConfigError, match="fl.clients_per_round=100 but classification.num_clients=10"):
        tool.main(["--config", str(Path(__file__).parents[2] / "configs/classification/digits_fedavg.yaml"), "--out", str(run),
                   "fl.clients_per_round=100"])
    assert not run.exists()


@pytest.mark.parametrize("override, fragment", [
    ("train.batch_size=100", "client 'dsa' has 12 training images, fewer than train.batch_size=100"),
    ("eval.datasets=[dsa,dsc]", "prepared datasets missing under data.prepared_root="),
    ("fl.clients_per_round=5", "fl.clients_per_round"),
])
def test_a_config_the_federation_refuses_leaves_no_run_folder(tmp_path, override, fragment):
    from fedreid.errors import FedReIDError

    root = write_world(tmp_path / "prepared")
    run = tmp_path / "run"
    with pytest.raises(FedReIDError, match=re.escape(fragment)):
        tool.main(["--out", str(run), "--rounds", "1", *_overrides(root), override, "--no-progress"])
    assert not run.exists()
