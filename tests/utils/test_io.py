"""Atomic writes: all or nothing, and ordinary permissions."""

from __future__ import annotations

import os
import stat

import pytest

from fedreid.utils.io import (
    OutputDirError,
    atomic_path,
    claim_output_dir,
    owns_folder,
    write_json_atomic,
    write_text_atomic,
)


def test_replaces_whole_file_with_plain_permissions(tmp_path):
    target = tmp_path / "sub" / "a.txt"
    write_text_atomic(target, "one")
    write_text_atomic(target, "two")
    assert target.read_text() == "two"
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.txt"]


def test_failure_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_claim_output_dir_creates_marks_and_reuses_its_own_folder(tmp_path):
    folder = claim_output_dir(tmp_path / "run", "run", tool="train_fed")
    assert owns_folder(folder, "run")
    (folder / "report.md").write_text("ours")
    assert claim_output_dir(folder, "run", tool="train_fed") == folder  # marked: ours to reuse
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_output_dir(empty, "run", tool="train_fed")
    assert owns_folder(empty, "run")


def test_claim_output_dir_refuses_a_users_folder_and_changes_nothing(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "report.md").write_text("the user's")
    with pytest.raises(OutputDirError, match=r"mine holds files train_fed did not write \(report.md\)"):
        claim_output_dir(user, "run", tool="train_fed")
    assert sorted(p.name for p in user.iterdir()) == ["report.md"]
    assert (user / "report.md").read_text() == "the user's"
    assert claim_output_dir(user, "run", tool="train_fed", adopt=True) == user  # recognised by the caller


def test_claim_output_dir_refuses_another_kinds_folder_files_and_links(tmp_path):
    run = claim_output_dir(tmp_path / "run", "run", tool="train_fed")
    with pytest.raises(OutputDirError, match="fedreid-run.json"):
        claim_output_dir(run, "index", tool="eval_reid index")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="not a folder"):
        claim_output_dir(tmp_path / "file", "run", tool="train_fed")
    (tmp_path / "link").symlink_to(run)
    with pytest.raises(OutputDirError, match="symbolic link"):
        claim_output_dir(tmp_path / "link", "run", tool="train_fed")


def test_claim_output_dir_clears_its_own_markers_leftover_after_a_kill(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "..fedreid-run.json.ab12_x9z.tmp").write_text("{")  # a kill between mkdir and the marker's rename
    claim_output_dir(folder, "run", tool="train_fed")
    assert sorted(p.name for p in folder.iterdir()) == [".fedreid-run.json"]


def test_an_output_folder_under_a_file_is_refused_naming_the_file(tmp_path):
    from fedreid.utils.io import check_output_dir

    (tmp_path / "notes").write_text("mine")
    with pytest.raises(OutputDirError) as info:
        check_output_dir(tmp_path / "notes" / "run" / "deeper", "run", tool="train_fed.py")
    assert str(info.value) == (f"{tmp_path / 'notes' / 'run' / 'deeper'} cannot be made: {tmp_path / 'notes'} is a "
                               "file, not a folder; choose another folder for train_fed.py's output")
    assert (tmp_path / "notes").read_text() == "mine"


def test_a_checkpoint_carrying_a_pickled_call_is_named_as_such_not_as_truncated(tmp_path):
    import torch

    from fedreid.utils.checkpoint import unreadable_reason

    class Planted:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "checkpoint.pt"
    torch.save({"server": Planted()}, path)
    try:
        torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch raises is what the reason reads
        reason = unreadable_reason(path, exc)
    assert reason.startswith("it holds a pickled object (posix.system) besides tensors and plain values: refused")
