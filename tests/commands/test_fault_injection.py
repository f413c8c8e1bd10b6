"""Fault injection: the tools killed with SIGKILL at seeded random moments, then re-run or resumed.

For each tool (prepare_datasets.py; train_fed.py FedPav + CDW + KD and SCAFFOLD +
FedFTG; eval_reid.py index) a reference run and a couple of seeded random kill
points (prepare, the cheap one, also at the two ends and right before two of
its os.replace commits); after every kill: no input or user file changed,
every output absent, previous or complete, and after the recovery (the same
command, or ``--resume``) the outputs equal the uninterrupted run's exactly.
The shared logic is ``fault_helpers``; ``bench/fault_soak.py`` runs the same
checks at 20+ random points and 10 write points per tool and prints the figures.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import (
    PYTHON,
    TOOL_NAMES,
    TOOLS,
    FaultHarness,
    compare_hashes,
    kill_delays,
    make_tool,
    run_tool,
    summary_row,
    tree_hashes,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Seeded random kill points per tool here; the soak runs 20+.
CI_POINTS = 2
SEED = 0


@pytest.fixture(scope="module", params=TOOL_NAMES)
def harness(request, tmp_path_factory):
    """Inputs and an uninterrupted reference run of one tool, shared by this module's tests."""
    return FaultHarness(make_tool(request.param), tmp_path_factory.mktemp(f"fault-{request.param}"), seed=SEED)


def test_killed_at_random_points_then_recovered(harness):
    delays = harness.delays(CI_POINTS)
    cheap = harness.tool.name == "prepare"
    if cheap:
        # The two ends: killed before anything is written, and after it finished.
        delays += [0.0, 5 * harness.wall + 5]
    outcomes = [harness.kill_point(point, delay, skip_untouched=True) for point, delay in enumerate(delays)]
    if cheap:
        # and right before two of its commits (os.replace), the windows a random time rarely hits
        outcomes += [harness.kill_point(len(outcomes) + k, before_replace=n)
                     for k, n in enumerate(harness.write_points(2))]
    row = summary_row(harness.tool.name, outcomes, harness.wall, sum(o.seconds for o in outcomes))
    print(row)
    assert row["files_lost"] == 0
    failed = [o.describe() for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    if cheap:
        assert outcomes[2].killed and outcomes[2].phase == "before output"
        assert not outcomes[3].killed and outcomes[3].phase == "finished before the kill"
        assert all(o.killed and o.where.startswith("before os.replace #") for o in outcomes[4:])


@pytest.mark.parametrize("harness", ["index"], indirect=True)
def test_killed_while_marking_a_new_output_folder(harness):
    # Point 0: a new index folder; the run's first os.replace is its marker's.
    outcome = harness.kill_point(0, before_replace=1)
    assert outcome.killed and "fedreid-index.json" in outcome.where
    assert outcome.ok, outcome.describe()


def _damaged(harness, tmp_path):
    """A copy of the reference run's outputs in a fresh work folder, for the checks to inspect."""
    tool = harness.tool
    work = tmp_path / "damaged"
    shutil.copytree(tool.output_root(harness.reference_dir), tool.output_root(work))
    return work, tool.output_root(work)


def test_the_checks_catch_half_outputs(harness, tmp_path):
    """The invariant checks are not vacuous: each flags a half-written output of its tool."""
    tool = harness.tool
    work, out = _damaged(harness, tmp_path)
    assert tool.after_kill(work, harness.reference)[1] == []  # the complete outputs pass
    if tool.name == "prepare":
        (out / "market1501" / "prepare.json").unlink()
        (out / "viper" / "manifest.csv").write_text("path,pid,camid,split,source\n")
        problems = tool.after_kill(work, harness.reference)[1]
        assert any("market1501 is half written" in p for p in problems)
        assert any("viper differs" in p for p in problems)
    elif tool.name.startswith("train"):
        text = (out / "metrics.jsonl").read_text()
        (out / "metrics.jsonl").write_text(text[: len(text) - 40])
        data = (out / "checkpoint.pt").read_bytes()
        (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])
        problems = tool.after_kill(work, harness.reference)[1]
        assert any("checkpoint.pt does not load" in p for p in problems)
        assert any("half-written line" in p for p in problems)
    else:
        shutil.copy(tool.previous / "header.json", out / "header.json")
        phase, problems = tool.after_kill(work, harness.reference)
        assert phase == "mid-save" and "half written" in problems[0] and "earlier ['header.json']" in problems[0]


def test_kill_delays_are_seeded_and_within_the_wall_time():
    a = kill_delays(0, "prepare", 2.0, 20)
    assert a == kill_delays(0, "prepare", 2.0, 20) and a != kill_delays(1, "prepare", 2.0, 20)
    assert a != kill_delays(0, "index", 2.0, 20) and all(0 <= d < 2.0 for d in a)
    assert kill_delays(0, "prepare", 2.0, 5) == a[:5]


def test_protected_file_check_counts_lost_and_changed_files(tmp_path):
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    before = tree_hashes(tmp_path)
    (tmp_path / "a").unlink()
    (tmp_path / "b").write_text("B")
    (tmp_path / "c").write_text("c")
    lost, problems = compare_hashes(before, tree_hashes(tmp_path), "raw")
    assert lost == 2 and len(problems) == 3 and "1 file(s) lost, e.g. a" in problems[0]


# ---------------------------------------------------------------------------
# Erasure under kills: an index --remove killed after each file deletion of its swap
# ---------------------------------------------------------------------------

#: Runs a tool, SIGKILLing it right after its n-th ``os.unlink`` (``shutil.rmtree`` and ``Path.unlink`` go
#: through it); every unlinked path is logged. ``python WRAPPER N LOG -- tools/x.py ARGS...``; N = 0: no kill.
KILL_AFTER_UNLINK = """
import os, runpy, signal, sys
nth, log = int(sys.argv[1]), sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]
real_unlink, count = os.unlink, [0]
def unlink(path, *args, **kwargs):
    real_unlink(path, *args, **kwargs)
    count[0] += 1
    with open(log, "a") as fh:
        fh.write(f"{count[0]}\\t{os.fspath(path)}\\n")
    if count[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink
sys.argv = argv
sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
runpy.run_path(argv[0], run_name="__main__")
"""
ERASED = 3


def _erasure_store(folder: Path) -> tuple[bytes, bytes]:
    """A Flat store of 40 items in ``folder``; returns the raw vector and the path of the item to erase."""
    from fedreid.retrieval.store import GalleryStore

    feats = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    rows = [{"path": f"/gallery/secret_{i:05d}.jpg", "camera": 1} for i in range(40)]
    GalleryStore.create(folder, feats, rows)
    return feats[ERASED].tobytes(), rows[ERASED]["path"].encode()


def _remove_killed_after_unlink(work: Path, nth: int) -> tuple[bool, list[str]]:
    """``index --remove`` of the erased item in ``work/store``, killed after its ``nth`` unlink: (killed, unlinked)."""
    wrapper = work / "kill_after_unlink.py"
    wrapper.write_text(KILL_AFTER_UNLINK)
    log = work / "unlinks.log"
    argv = [PYTHON, str(wrapper), str(nth), str(log), "--", str(TOOLS / "eval_reid.py"), "index",
            "--index", str(work / "store"), "--remove", str(ERASED)]
    result = run_tool(argv, work, work / "run.log")
    assert result.killed or result.returncode == 0, result.tail()
    unlinked = [line.split("\t", 1)[1] for line in log.read_text().splitlines()] if log.is_file() else []
    for name in ("kill_after_unlink.py", "unlinks.log", "run.log"):
        (work / name).unlink()
    return result.killed, unlinked


def test_a_kill_while_a_removal_deletes_its_old_copy_leaves_no_trace_after_the_next_open(tmp_path):
    """Killed after each file deletion of ``index --remove``: the next open leaves no byte of the erased item.

    The set-aside copy of the store (``.store.old-*``) holds the erased item's
    vector and path until deleted; ``shutil.rmtree`` may remove its marker
    first, so a kill part-way leaves an unmarked copy, which the next open of
    the store must still recognise and delete.
    """
    from fedreid.retrieval.store import GalleryStore

    reference = tmp_path / "reference"
    reference.mkdir()
    _erasure_store(reference / "store")
    killed, unlinked = _remove_killed_after_unlink(reference, 0)
    assert not killed and unlinked
    unmarked_copies = 0
    for nth in range(1, len(unlinked) + 1):
        work = tmp_path / f"point{nth}"
        work.mkdir()
        vector, path = _erasure_store(work / "store")
        killed, _ = _remove_killed_after_unlink(work, nth)
        assert killed, f"point {nth}: the removal finished before its {nth}th unlink"
        for left in work.glob(".store.*"):
            names = {p.name for p in left.iterdir()}
            has_vectors = any(n == "vectors.npy" or n.endswith(".vectors.npy") for n in names)
            unmarked_copies += has_vectors and ".fedreid-index.json" not in names
        store = GalleryStore.open(work / "store")  # cleans up what the kill left
        assert not list(work.glob(".store.*")), f"point {nth}: leftovers stay after the next open"
        if store.rows([ERASED])[0] is not None:  # killed before the swap: the store is the previous one
            store.remove([ERASED])
        for f in (f for f in work.rglob("*") if f.is_file()):
            data = f.read_bytes()
            assert vector not in data and path not in data, f"point {nth}: {f} keeps the erased item"
        assert GalleryStore.open(work / "store").ntotal == 39
    assert unmarked_copies, "no kill point left a set-aside copy without its marker: the case is not exercised"


def test_a_removal_killed_between_its_renames_is_recovered_without_a_trace(tmp_path):
    """``index --remove`` killed before its last os.replace: the store sits set aside beside its folder.

    The rerun puts it back and removes again (it once answered "index folder does not exist"),
    and afterwards no byte of the erased items' vectors or paths is left in or beside the store.
    """
    harness = FaultHarness(make_tool("index-remove"), tmp_path / "h", seed=SEED)
    assert harness.reference["erased traces"] == []
    last = len(harness.replaces)
    assert harness.replaces[-1] == "index"
    outcome = harness.kill_point(0, before_replace=last)
    assert outcome.killed and outcome.phase == "swapping folders (nothing in place)", outcome.describe()
    assert outcome.ok, outcome.describe()
