"""tools/prepare_datasets.py end to end, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from raw_fixtures import make_market1501_tree, make_msmt17_tree

TOOL = Path(__file__).resolve().parents[1] / "tools" / "prepare_datasets.py"


def run_tool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_help_teaches():
    out = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for fragment in ("--raw-root", "--datasets", "--layout", "--synthetic", "--force", "key=value", "Examples"):
        assert fragment in out.stdout


def test_prepare_two_datasets_then_skip(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    make_msmt17_tree(raw)
    args = ("--raw-root", str(raw), "--out", str(tmp_path / "prep"), "--datasets", "market1501,msmt17",
            "data.public_dataset=null")
    first = run_tool(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "[market1501]" in first.stdout and "Dataset card" in first.stdout
    assert "skipped" in first.stdout and "Thumbs.db" in first.stdout
    for name in ("market1501", "msmt17"):
        card = json.loads((tmp_path / "prep" / name / "card.json").read_text())
        assert card["query"]["images"] > 0
    assert (tmp_path / "prep" / "cards.md").is_file()
    second = run_tool(*args, cwd=tmp_path)
    assert second.returncode == 0
    assert second.stdout.count("already prepared") == 2


def test_missing_release_fails_clearly_and_others_still_prepare(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "prep"),
                   "--datasets", "market1501,dukemtmc", "data.public_dataset=null", cwd=tmp_path)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "dukemtmc" in out.stderr and "DukeMTMC-reID" in out.stderr
    assert (tmp_path / "prep" / "market1501" / "manifest.csv").is_file()
    assert not (tmp_path / "prep" / "dukemtmc").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--datasets", "market"), "unknown dataset 'market'"),
        (("data.layout=zip",), "data.layout: 'zip' is not allowed"),
        (("--config", "missing.yaml"), "cannot read config file missing.yaml"),
        (("seed",), "unexpected argument 'seed'"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, fragment):
    out = run_tool(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr
