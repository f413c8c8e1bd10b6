"""tools/prepare_datasets.py end to end, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from raw_fixtures import make_market1501_tree, make_msmt17_tree

TOOL = Path(__file__).resolve().parents[2] / "tools" / "prepare_datasets.py"


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
                   "--datasets", "market1501,dukemtmc", cwd=tmp_path)  # named: no public set added
    assert out.returncode == 2 and "cuhk02" not in out.stderr
    assert "Traceback" not in out.stderr
    assert "dukemtmc" in out.stderr and "DukeMTMC-reID" in out.stderr
    assert (tmp_path / "prep" / "market1501" / "manifest.csv").is_file()
    assert not (tmp_path / "prep" / "dukemtmc").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--datasets", "market"), "unknown dataset 'market'"),
        (("--datasets", "markt1501"), "unknown dataset 'markt1501' (did you mean market1501?)"),
        (("--datasets", ""), "--datasets '': expected comma-separated dataset names or 'all'"),
        (("--out", "a", "data.prepared_root=b"), "the override 'data.prepared_root=b' and a command-line option"),
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


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_raw_root_inside_the_output_dataset_folder_is_refused(tmp_path):
    # --raw-root data/market1501 --out data: the target data/market1501 *is* the raw root.
    raw = tmp_path / "data" / "market1501"
    make_market1501_tree(raw)
    before = tree_digest(raw)
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "data"), "--datasets", "market1501",
                   "data.public_dataset=null", "--force", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"the raw root {raw}" in out.stderr and "nothing was moved or deleted" in out.stderr
    assert tree_digest(raw) == before, "raw data must never change"
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["market1501"]


def test_path_flags_are_taken_literally(tmp_path):
    # As YAML, "#..." would be a comment and ": " would start a mapping.
    raw = tmp_path / "my: raw #1"
    make_market1501_tree(raw)
    split = tmp_path / "split #2.json"
    split.write_text("{}")  # market1501's split is the release's own; the file must still exist
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "run #2"), "--datasets", "market1501",
                   "--split-file", f"market1501={split}", "data.public_dataset=null", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    made = json.loads((tmp_path / "run #2" / "market1501" / "prepare.json").read_text())
    assert made["raw_root"] == str(raw.resolve()) and made["split_file"] == str(split)
    assert not (tmp_path / "run").exists()


def test_cards_md_keeps_the_datasets_of_earlier_runs(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    make_msmt17_tree(raw)
    for name in ("market1501", "msmt17"):
        out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "prep"), "--datasets", name,
                       "data.public_dataset=null", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    assert "| market1501 |" not in out.stdout  # the printed summary is this run's
    cards = (tmp_path / "prep" / "cards.md").read_text()
    # benchmark order: msmt17 first, as in the paper's Table 1
    assert cards.index("| msmt17 |") < cards.index("| market1501 |")
    assert "1 dataset(s) prepared by earlier runs" in out.stdout


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("data.options.cuhk03np.box=labeled", ("data.options.cuhk03np.box", "cuhk03np", "allowed options: boxes")),
        ("data.split_files.vipr=split.json", ("data.split_files.vipr", "unknown dataset 'vipr'", "viper")),
    ],
)
def test_misspelt_dataset_or_option_is_one_clear_line(tmp_path, override, fragments):
    out = run_tool("--datasets", "cuhk03np", override, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unexpected keyword" not in out.stderr
    for fragment in fragments:
        assert fragment in out.stderr


def test_rerun_on_a_raw_folder_that_changed_says_stale_and_force_redoes_it(tmp_path):
    raw = tmp_path / "raw"
    release = make_market1501_tree(raw)
    args = ("--raw-root", str(raw), "--out", str(tmp_path / "prep"), "--datasets", "market1501",
            "data.public_dataset=null", "--no-progress")
    assert run_tool(*args, cwd=tmp_path).returncode == 0
    train = release / "bounding_box_train"
    extra = train / "0002_c3s1_999999_01.jpg"
    extra.write_bytes(next(train.glob("0002_*.jpg")).read_bytes())
    images = sum(p.suffix == ".jpg" for p in release.rglob("*"))
    second = run_tool(*args, cwd=tmp_path)
    assert second.returncode == 0 and "already prepared" in second.stdout
    assert f"now has {images} images, {images - 1} when prepared" in second.stdout
    assert "stale" in second.stdout and "--force" in second.stdout
    forced = run_tool(*args, "--force", cwd=tmp_path)
    assert forced.returncode == 0 and "already prepared" not in forced.stdout
    assert extra.name in (tmp_path / "prep" / "market1501" / "manifest.csv").read_text()
    third = run_tool(*args, cwd=tmp_path)
    assert "stale" not in third.stdout and "already prepared" in third.stdout


def test_a_cards_md_the_tool_did_not_write_is_refused_untouched(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "cards.md").write_text("MY NOTES\n")
    out = run_tool("--raw-root", str(raw), "--out", str(prep), "--datasets", "market1501",
                   "data.public_dataset=null", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert f"{prep / 'cards.md'} was not written by tools/prepare_datasets.py" in out.stderr
    assert "move it" in out.stderr
    assert (prep / "cards.md").read_text() == "MY NOTES\n"
    assert sorted(p.name for p in prep.iterdir()) == ["cards.md"], "nothing may be prepared first"


def test_the_written_cards_md_carries_the_marker_and_an_old_generated_one_is_replaced(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    prep = tmp_path / "prep"
    prep.mkdir()
    # A cards.md of the tool before the marker: the table alone.
    (prep / "cards.md").write_text(
        "| dataset | train ids | train imgs | query ids | query imgs | gallery imgs | cameras |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n| viper | 316 | 632 | 316 | 316 | 316 | 2 |\n")
    args = ("--raw-root", str(raw), "--out", str(prep), "--datasets", "market1501", "data.public_dataset=null")
    out = run_tool(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cards = (prep / "cards.md").read_text()
    assert cards.startswith("<!-- written by tools/prepare_datasets.py") and "| market1501 |" in cards
    again = run_tool(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_out_that_is_a_file_is_one_line_naming_the_option(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    (tmp_path / "file").write_text("x")
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "file"), "--datasets", "market1501",
                   "data.public_dataset=null", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"error: --out {tmp_path / 'file'}: expected a folder, "
                                               f"but {tmp_path / 'file'} is a file"]


def test_a_missing_raw_root_is_one_line_at_the_door(tmp_path):
    out = run_tool("--raw-root", str(tmp_path / "nope"), "--out", str(tmp_path / "prep"), "--datasets", "all",
                   cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"error: --raw-root {tmp_path / 'nope'}: no such folder"]
    assert not (tmp_path / "prep").exists()


def test_a_missing_split_file_is_refused_before_any_dataset_is_prepared(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    make_msmt17_tree(raw)
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "prep"), "--datasets", "market1501,msmt17",
                   "--split-file", f"msmt17={tmp_path / 'missing.json'}", "data.public_dataset=null", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--split-file msmt17=" in out.stderr and "no such file" in out.stderr
    assert not (tmp_path / "prep" / "market1501").exists()


def test_a_failure_is_printed_once_without_a_doubled_name(tmp_path):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    out = run_tool("--raw-root", str(raw), "--out", str(tmp_path / "prep"), "--datasets", "market1501,viper",
                   cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "viper: viper:" not in out.stderr
    detail = [line for line in out.stderr.splitlines() if "viper:" in line]
    assert len(detail) == 1, out.stderr


@pytest.mark.parametrize(
    "damage, fragment",
    [
        ("no card", "card.json is missing; use --force"),
        ("card list", "card.json holds a JSON list, not an object; use --force"),
        ("bad record", "prepare.json is not valid JSON"),
    ],
)
def test_a_damaged_prepared_folder_fails_alone_and_the_others_are_prepared(tmp_path, damage, fragment):
    raw = tmp_path / "raw"
    make_market1501_tree(raw)
    make_msmt17_tree(raw)
    prep = tmp_path / "prep"
    args = ("--raw-root", str(raw), "--out", str(prep), "data.public_dataset=null", "--no-progress")
    assert run_tool(*args, "--datasets", "market1501", cwd=tmp_path).returncode == 0
    market = prep / "market1501"
    if damage == "no card":
        (market / "card.json").unlink()
    elif damage == "card list":
        (market / "card.json").write_text("[]")
    else:
        (market / "prepare.json").write_text("{oops")
    out = run_tool(*args, "--datasets", "market1501,msmt17", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (prep / "msmt17" / "manifest.csv").is_file() and "[msmt17]" in out.stdout
    [line] = [line for line in out.stderr.splitlines() if line.startswith("  market1501:")]
    assert line.startswith(f"  market1501: {market}/{fragment}")
    if damage != "bad record":  # --force remakes a folder whose prepare.json says it is the tool's
        again = run_tool(*args, "--datasets", "market1501", "--force", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert json.loads((market / "card.json").read_text())["query"]["images"] == 2


def test_synthetic_world_of_other_settings_is_refused_and_force_regenerates_it(tmp_path):
    world = tmp_path / "synraw"
    args = ("--synthetic", "--datasets", "viper", "--out", str(tmp_path / "prep"), "--no-progress",
            f"synthetic.root={world}", "synthetic.min_ids=12")
    first = run_tool(*args, "synthetic.id_scale=0.04", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = tree_digest(world)
    same = run_tool(*args, "synthetic.id_scale=0.04", cwd=tmp_path)
    assert same.returncode == 0 and "synthetic world already in" in same.stdout
    other = run_tool(*args, "synthetic.id_scale=0.02", cwd=tmp_path)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1
    for fragment in (str(world), "id_scale=0.04", "id_scale=0.02", "--force"):
        assert fragment in other.stderr
    assert tree_digest(world) == before, "the recorded world must not change"
    forced = run_tool(*args, "synthetic.id_scale=0.02", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert json.loads((world / "synthetic_world.json").read_text())["parameters"]["id_scale"] == 0.02
