"""Atomic writes: all or nothing, and ordinary permissions."""

from __future__ import annotations

import os
import stat

import pytest

from fedreid.utils.io import atomic_path, write_json_atomic, write_text_atomic


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
