"""What a run promises: never overwrite a user's folder, never resume on changed data, say when numbers drift."""

from __future__ import annotations

import csv
import hashlib
import logging
import shutil
from pathlib import Path

import pytest
import torch
from fl_helpers import write_world
from tool_loader import load_tool

from fedreid.fl.simulation import DataChangedError, data_changes
from fedreid.utils.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from fedreid.utils.cli import run_main
from fedreid.utils.io import OutputDirError, marker_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")



tool = load_tool("train_fed", "train_fed_tool_guarantees")


def _overrides(root: Path) -> list[str]:
    return [
        f"data.prepared_root={root}", "data.datasets=[dsa,dsb]", "data.public_dataset=null",
        "model.backbone=test_resnet", "model.bottleneck_dim=16", "model.height=32", "model.width=16",
        "train.batch_size=4", "eval.every=1", "eval.batch_size=8", "run.device=cpu", "run.tensorboard=false",
    ]


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def one_round(tmp_path_factory):
    """A prepared world and a finished one-round run in it (copied by each test that changes either)."""
    base = tmp_path_factory.mktemp("guarantees")
    root = write_world(base / "prepared")
    run = base / "run"
    assert tool.main(["--out", str(run), "--rounds", "1", "--no-progress", *_overrides(root)]) == 0
    return root, run


def _rewrite_checkpoint(path: Path, change) -> None:
    ckpt = load_checkpoint(path)
    change(ckpt)
    for key in ("format", "version"):  # save_checkpoint adds them
        ckpt.pop(key)
    save_checkpoint(path, ckpt)


def _copy(one_round, tmp_path) -> tuple[Path, Path]:
    """A copy of the world and of the run, the run reading the copied world."""
    root, run = one_round
    new_root, new_run = tmp_path / "prepared", tmp_path / "run"
    shutil.copytree(root, new_root)
    shutil.copytree(run, new_run)
    config = new_run / "config.yaml"
    config.write_text(config.read_text().replace(str(root), str(new_root)))
    _rewrite_checkpoint(checkpoint_path(new_run),
                        lambda ckpt: ckpt["config"]["data"].update(prepared_root=str(new_root)))
    return new_root, new_run


# ------------------------------------------------------------------------- output folders


def test_out_refuses_a_folder_of_user_files_and_changes_nothing(one_round, tmp_path, capsys):
    root, _ = one_round
    user = tmp_path / "mine"
    user.mkdir()
    (user / "report.md").write_text("my notes")
    (user / "config.yaml").write_text("seed: 1  # my experiment\n")
    before = _digest(user)
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(["--out", str(user), "--rounds", "1", "--no-progress", *_overrides(root)]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert f"{user} holds files train_fed did not write (config.yaml, report.md)" in err
    assert _digest(user) == before and sorted(p.name for p in user.iterdir()) == ["config.yaml", "report.md"]
    with pytest.raises(OutputDirError):  # --resume of such a folder too
        tool.main(["--resume", str(user)])
    assert _digest(user) == before


def test_a_run_folder_is_marked_and_one_of_an_earlier_version_is_adopted(one_round, tmp_path):
    root, run = _copy(one_round, tmp_path)
    marker = marker_path(run, "run")
    assert marker.is_file()
    marker.unlink()  # as written before runs were marked: its valid checkpoint makes it ours
    assert tool.main(["--resume", str(run), "--rounds", "2", "--no-progress"]) == 0
    assert marker.is_file() and load_checkpoint(checkpoint_path(run))["round"] == 2


# ------------------------------------------------------------------------ data fingerprints


def _drop_training_rows(dataset: Path, count: int) -> None:
    with (dataset / "manifest.csv").open() as fh:
        rows = list(csv.reader(fh))
    train = [i for i, r in enumerate(rows) if r[3] == "train"][-count:]
    rows = [r for i, r in enumerate(rows) if i not in train]
    with (dataset / "manifest.csv").open("w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)


def test_resume_refuses_changed_training_data_naming_the_client(one_round, tmp_path, capsys):
    root, run = _copy(one_round, tmp_path)
    ckpt = load_checkpoint(checkpoint_path(run))
    assert ckpt["data"]["clients"]["dsa"]["images"] == 12
    _drop_training_rows(root / "dsa", 2)
    before = _digest(run)
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: tool.main(["--resume", str(run), "--rounds", "2", "--no-progress"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "client dsa: 12 training images at checkpoint, 10 now" in err and "dsb" not in err
    assert _digest(run) == before  # nothing was trained or rewritten


def test_data_changes_name_every_kind_of_change():
    fp = {"images": 4, "sha256": "a"}
    saved = {"clients": {"a": fp, "b": fp, "c": fp}, "eval": {"a": fp}}
    now = {"clients": {"a": fp, "b": {"images": 4, "sha256": "b"}, "d": fp}, "eval": {"a": {"images": 3, "sha256": "c"}}}
    assert data_changes(saved, now) == [
        "client b: 4 training images at checkpoint and now, but not the same ones "
        "(files, identities, labels or their order differ)",
        "client c: in the checkpoint, not in the data now",
        "client d: not in the checkpoint, in the data now",
        "evaluation set a: 4 images at checkpoint, 3 now",
    ]
    assert data_changes(saved, saved) == []


def test_a_classification_client_fingerprint_covers_its_images():
    import numpy as np

    from fedreid.data.classification import ArrayDataset
    from fedreid.fl.classification import array_fingerprint

    data = ArrayDataset("toy", np.zeros((6, 4, 4), np.uint8), np.array([0, 1, 0, 1, 0, 1]), ["a", "b"])
    same = array_fingerprint(data, np.array([0, 2, 4]))
    data.images[2, 0, 0] = 1
    assert array_fingerprint(data, np.array([0, 2, 4])) != same
    assert array_fingerprint(data, np.array([0, 4, 2])) != array_fingerprint(data, np.array([0, 2, 4]))


def test_a_checkpoint_without_fingerprints_resumes_with_a_warning(one_round, tmp_path, caplog):
    _, run = _copy(one_round, tmp_path)
    path = checkpoint_path(run)
    _rewrite_checkpoint(path, lambda ckpt: [ckpt.pop(k) for k in ("data", "environment")])  # as older versions did
    with caplog.at_level(logging.WARNING, logger="fedreid"):
        assert tool.main(["--resume", str(run), "--rounds", "2", "--no-progress"]) == 0
    assert "records no data fingerprints and no torch thread count" in caplog.text
    assert "data" in load_checkpoint(path)  # written again, now with them


# ----------------------------------------------------------------------------- threads


def test_the_thread_count_is_recorded_and_a_different_one_warns(one_round, tmp_path, caplog):
    _, run = _copy(one_round, tmp_path)
    path = checkpoint_path(run)
    ckpt = load_checkpoint(path)
    threads = torch.get_num_threads()
    assert ckpt["environment"]["torch_threads"] == threads
    assert f"with {threads} torch thread" in (run / "config.yaml").read_text().splitlines()[0]
    with caplog.at_level(logging.WARNING, logger="fedreid"):
        assert tool.main(["--resume", str(run), "--rounds", "2", "--no-progress"]) == 0
    assert "torch threads" not in caplog.text  # same count: nothing to say
    _rewrite_checkpoint(path, lambda ckpt: ckpt["environment"].update(torch_threads=threads + 3))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedreid"):
        assert tool.main(["--resume", str(run), "--rounds", "3", "--no-progress"]) == 0
    assert (f"was written with {threads + 3} torch threads, this process has {threads}: the resumed run's numbers "
            "will not be bit-identical") in caplog.text


def test_the_device_and_precision_are_recorded_and_a_different_one_warns(one_round, tmp_path, caplog):
    """A page or a resume can tell a CPU fp32 run from a GPU bf16 one: both are in the checkpoint and config.yaml."""
    _, run = _copy(one_round, tmp_path)
    path = checkpoint_path(run)
    assert {k: load_checkpoint(path)["environment"][k] for k in ("device", "precision")} == {
        "device": "cpu", "precision": "fp32"}
    assert "trained on cpu in fp32 under torch" in (run / "config.yaml").read_text().splitlines()[0]
    _rewrite_checkpoint(path, lambda ckpt: ckpt["environment"].update(device="cuda (NVIDIA H100)", precision="bf16"))
    with caplog.at_level(logging.WARNING, logger="fedreid"):
        assert tool.main(["--resume", str(run), "--rounds", "2", "--no-progress"]) == 0
    assert "was trained with device cuda (NVIDIA H100), this process trains with cpu" in caplog.text
    assert "was trained with precision bf16, this process trains with fp32" in caplog.text


def test_resume_refuses_changed_data_through_the_library_too(one_round, tmp_path):
    from fedreid.fl.simulation import resume

    root, run = _copy(one_round, tmp_path)
    _drop_training_rows(root / "dsb", 1)
    with pytest.raises(DataChangedError, match="client dsb: 16 training images at checkpoint, 15 now"):
        resume(run, progress=False)


# ------------------------------------------------------------------------ Flower's folders


def _flower_tool():
    return load_tool("flower_fed", "flower_fed_tool_guarantees")


def test_flower_local_and_node_refuse_a_users_folders_before_starting_anything(tmp_path):
    flower = _flower_tool()
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "report.md").write_text("my notes")
    before = _digest(user)
    with pytest.raises(OutputDirError, match=r"mine holds files flower_fed did not write \(report.md\)"):
        flower.main(["local", "--config", str(config), "--out", str(user)])
    with pytest.raises(OutputDirError, match=r"mine holds files flower_fed did not write"):  # as the work folder
        flower.main(["simulate", "--config", str(config), "--out", str(tmp_path / "new"), "--workdir", str(user)])
    assert not (tmp_path / "new").exists()
    with pytest.raises(OutputDirError, match=r"mine holds files the fedreid node \(--state-dir\) did not write"):
        flower.main(["node", "--client", "dsa", "--superlink", "127.0.0.1:1", "--insecure", "--state-dir", str(user)])
    assert _digest(user) == before and [p.name for p in user.iterdir()] == ["report.md"]
