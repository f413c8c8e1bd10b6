"""tools/reproduce.py: what a table run refuses, and what its page says of the runs it read."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from fedreid.config import load_config
from fedreid.reproduce import TABLES, Cell, ReproduceError, Row, Table, run_table, write_page
from fedreid.reproduce.runner import CellOutcome, RunResult, cell_overrides, config_path, machine_description

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "configs/classification/digits_fedavg.yaml")
SMALL = ("classification.num_clients=4", "train.local_epochs=1", "run.device=cpu")
#: The first line of a page the tool wrote, and the line below which a page's hand-written notes are kept.
WRITTEN_BY = "<!-- written by tools/reproduce.py"
NOTES_LINE = "<!-- notes: kept when tools/reproduce.py rewrites this page -->"


def _fedavg(*extra):
    return Cell(DIGITS, (*SMALL, "train.objective=fedavg", *extra), paper=90.0)


def _table(*extra, synthetic=()):
    """One row, one column: FedAvg on digits (the FedAvg cell of test_reproduce's tiny table)."""
    return Table(name="tiny-digits", title="digits", source="a test", columns=("acc",), column_slugs=("d",),
                 rows=(Row("FedAvg", "fedavg", (_fedavg(*extra),)),), data="scikit-learn's digits",
                 synthetic=synthetic)


def _two_rows():
    fedprox = Cell(DIGITS, (*SMALL, "train.objective=fedprox"), paper=91.0)
    return replace(_table(), rows=(*_table().rows, Row("FedProx", "fedprox", (fedprox,))))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """``<out>`` holding a finished 2-round run of :func:`_table`, seed 0, and its outcomes; tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "runs"
    outcomes = run_table(_table(), [0], out=out, rounds=2)
    assert outcomes[0][0].runs[0].status == "done"
    return out, outcomes


def _copy(finished, tmp_path) -> Path:
    out = tmp_path / "runs"
    shutil.copytree(finished[0], out)
    return out


def _checkpoint(out: Path) -> Path:
    return out / "tiny-digits" / "d-fedavg" / "seed0" / "checkpoint.pt"


# --------------------------------------------------------------------------- a run folder of another config


def test_a_finished_run_of_another_config_is_refused_not_read(finished, tmp_path):
    out = _copy(finished, tmp_path)
    stamp = _checkpoint(out).stat().st_mtime_ns
    for execute in (True, False):  # a table run, and --page-only
        with pytest.raises(ReproduceError, match=r"seed0 holds a run of another config \(train\.lr: 0\.05 there, "
                                                 r"0\.01 asked\).*another --out"):
            run_table(_table("train.lr=0.01"), [0], out=out, rounds=2, execute=execute)
    assert _checkpoint(out).stat().st_mtime_ns == stamp


def test_keys_that_cannot_change_the_numbers_do_not_refuse_a_finished_run(finished, tmp_path):
    out = _copy(finished, tmp_path)  # run.out_dir differs from the one the run saved, too
    again = run_table(_table("eval.batch_size=64", "run.tensorboard=false"), [0], out=out, rounds=2)
    assert again[0][0].runs[0].status == "done"
    assert again[0][0].values() == finished[1][0][0].values()


@pytest.mark.parametrize("rounds", [1, 3])
def test_a_finished_run_of_another_schedule_is_refused_in_both_directions(finished, tmp_path, rounds):
    out = _copy(finished, tmp_path)
    stamp = _checkpoint(out).stat().st_mtime_ns
    with pytest.raises(ReproduceError, match=rf"holds a run of another config \(fl\.rounds: 2 there, {rounds} asked\); "
                                             rf"it was made with --rounds 2: repeat that to continue it or write its "
                                             rf"page, or use another --out for the {rounds}-round schedule$"):
        run_table(_table(), [0], out=out, rounds=rounds)
    assert _checkpoint(out).stat().st_mtime_ns == stamp  # not extended, not rewritten


def test_a_folder_extended_from_a_shorter_schedule_is_refused(tmp_path):
    """A 1-round run continued to 2 (train_fed --resume fl.rounds=2) saved fl.rounds=2, but its history keeps
    the evaluation after round 1 that a 2-round run with eval.every=2 never makes."""
    from fedreid.fl.simulation import run_simulation

    table = _table("eval.every=2")
    run_table(table, [0], out=tmp_path, rounds=1)
    run_dir = tmp_path / "tiny-digits" / "d-fedavg" / "seed0"
    cell = table.rows[0].cells[0]
    cfg = load_config(config_path(cell), cell_overrides(table, cell, 0, 2, False, run_dir))
    history = run_simulation(cfg, run_dir, resume=True, progress=False)
    assert [r["round"] for r in history if r.get("eval")] == [1, 2]
    with pytest.raises(ReproduceError, match="seed0 holds a run extended from a shorter schedule: it evaluated "
                                             "after round 1, which a 2-round run does not"):
        run_table(table, [0], out=tmp_path, rounds=2, execute=False)


def test_every_run_folder_is_checked_before_any_run_trains(finished, tmp_path):
    out = _copy(finished, tmp_path)
    table = _two_rows()
    table = replace(table, rows=(table.rows[1], replace(table.rows[0], cells=(_fedavg("train.lr=0.01"),))))
    with pytest.raises(ReproduceError, match="another config"):
        run_table(table, [0], out=out, rounds=2)  # FedProx comes first and would train: it must not
    assert not (out / "tiny-digits" / "d-fedprox").exists()


# --------------------------------------------------------------------------- seeds


def test_duplicate_seeds_are_refused_at_the_door(tmp_path):
    from fedreid.commands import reproduce as tool

    with pytest.raises(ReproduceError, match=r"--seeds: seed 0 is given twice"):
        run_table(_table(), [0, 0], out=tmp_path / "runs", rounds=1)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ReproduceError, match=r"--seeds: seed 1 is given twice"):
        tool.main(["fedlmd-table3-mnist", "--seeds", "1", "0", "1", "--page-only", "--out", str(tmp_path / "o"),
                   "--pages", str(tmp_path / "pages")])
    assert not (tmp_path / "pages").exists()


def _done(seed, accuracy, run_dir):
    history = [{"round": 1, "eval": {"test": {"accuracy": accuracy}}, "time": {"round": 60.0}}]
    return RunResult(run_dir / f"seed{seed}", seed, "done", history, 1, 1, 60.0)


def test_the_page_says_how_many_seeds_each_number_averages(tmp_path):
    table = Table(name="two-columns", title="t", source="s", columns=("lr 0.05", "lr 0.02"), column_slugs=("a", "b"),
                  rows=(Row("FedAvg", "fedavg", (_fedavg(), _fedavg("train.lr=0.02"))),), data="digits")
    a = [_done(s, acc, tmp_path / "a") for s, acc in ((0, 0.5), (1, 0.6), (2, 0.7))]
    b = [_done(0, 0.4, tmp_path / "b")] + [RunResult(tmp_path / "b" / f"seed{s}", s, "not-run") for s in (1, 2)]
    outcomes = [[CellOutcome(table.rows[0].cells[0], "a-fedavg", a), CellOutcome(table.rows[0].cells[1], "b-fedavg", b)]]
    page, _ = write_page(table, outcomes, pages=tmp_path / "pages", seeds=[0, 1, 2], rounds=1, synthetic=False,
                         command="x")
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    assert "| 60.00 ± 10.00 |" in row and "| 40.00 |" in row
    assert "| 3 / 1 |" in row  # per column: the first number averages 3 seeds, the second 1
    assert "lr 0.02: 1 of 3 seeds finished" in row
    assert "- Seeds asked: 0, 1, 2 " in text
    assert "- Seeds finished: 0, 1, 2 in 1 cell; 0 in 1 cell" in text


def test_a_column_not_run_is_named_in_the_note(tmp_path):
    table = Table(name="two-columns", title="t", source="s", columns=("lr 0.05", "lr 0.02"), column_slugs=("a", "b"),
                  rows=(Row("FedAvg", "fedavg", (_fedavg(), _fedavg("train.lr=0.02"))),
                        Row("FedProx", "fedprox", (_fedavg("train.objective=fedprox"),
                                                   _fedavg("train.objective=fedprox", "train.lr=0.02")))),
                  data="digits")
    ran = [[CellOutcome(table.rows[0].cells[0], "a-fedavg", [_done(0, 0.5, tmp_path / "a")]),
            CellOutcome(table.rows[0].cells[1], "b-fedavg", [])],
           [CellOutcome(cell, slug, []) for cell, slug in zip(table.rows[1].cells, ("a-fedprox", "b-fedprox"))]]
    page, _ = write_page(table, ran, pages=tmp_path / "pages", seeds=[0], rounds=1, synthetic=False, command="x")
    rows = {line.split(" | ")[0]: line for line in page.read_text().splitlines() if line.startswith("| Fed")}
    assert rows["| FedAvg"].endswith("| lr 0.02: not run |")  # the row has a number: which column lacks one
    assert rows["| FedProx"].endswith("| – | – | not run |")  # neither column: once, unprefixed


def test_the_seeds_column_is_one_number_when_every_cell_has_it(tmp_path):
    table = _table()
    outcomes = [[CellOutcome(table.rows[0].cells[0], "d-fedavg", [_done(0, 0.5, tmp_path), _done(1, 0.7, tmp_path)])]]
    page, _ = write_page(table, outcomes, pages=tmp_path / "pages", seeds=[0, 1], rounds=1, synthetic=False,
                         command="x")
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    assert row.endswith("| 2 | 1.0 |  |")
    assert "- Seeds finished: 0, 1 in every cell" in text


# --------------------------------------------------------------------------- pages: whose they are


def _empty_outcomes(table, tmp_path, synthetic=False):
    return run_table(table, [0], out=tmp_path / "no-runs", rounds=1, execute=False, synthetic=synthetic)


def test_a_page_the_tool_did_not_write_is_refused_untouched(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "tiny-digits.md").write_text("# my own page\n")
    table = _table()
    with pytest.raises(ReproduceError, match=r"tiny-digits\.md was not written by tools/reproduce\.py"):
        write_page(table, _empty_outcomes(table, tmp_path), pages=pages, seeds=[0], rounds=1, synthetic=False,
                   command="x")
    assert (pages / "tiny-digits.md").read_text() == "# my own page\n"
    assert sorted(p.name for p in pages.iterdir()) == ["tiny-digits.md"]


def test_a_picture_the_tool_did_not_write_is_refused_untouched(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "tiny-digits.png").write_bytes(b"my picture")
    table = _table()
    with pytest.raises(ReproduceError, match=r"tiny-digits\.png was not written by tools/reproduce\.py"):
        write_page(table, _empty_outcomes(table, tmp_path), pages=pages, seeds=[0], rounds=1, synthetic=False,
                   command="x")
    assert sorted(p.name for p in pages.iterdir()) == ["tiny-digits.png"]


def test_the_tool_refuses_to_replace_a_hand_written_results_page(tmp_path):
    """The audit's case: --page-only with an empty --out replaced docs/results/mnist-augmentation.md."""
    from fedreid.commands import reproduce as tool

    pages = tmp_path / "results"
    shutil.copytree(REPO / "docs" / "results", pages)
    before = (pages / "mnist-augmentation.md").read_bytes()
    with pytest.raises(ReproduceError, match=r"mnist-augmentation\.md was not written by tools/reproduce\.py"):
        tool.main(["mnist-augmentation", "--page-only", "--out", str(tmp_path / "empty"), "--pages", str(pages)])
    assert (pages / "mnist-augmentation.md").read_bytes() == before


def test_a_rewritten_page_keeps_the_notes_below_its_notes_line(finished, tmp_path):
    table = _table()
    pages = tmp_path / "pages"
    page, picture = write_page(table, finished[1], pages=pages, seeds=[0], rounds=2, synthetic=False, command="x")
    text = page.read_text()
    assert text.splitlines()[0].startswith(WRITTEN_BY)
    assert text.rstrip("\n").endswith(NOTES_LINE)
    notes = "\nWhy FedAvg wins here: a paragraph of my own.\n\n| a | table |\n"
    page.write_text(text + notes)
    again, picture_again = write_page(table, finished[1], pages=pages, seeds=[0], rounds=2, synthetic=False,
                                      command="y")
    new = again.read_text()
    assert "- Command: `y`" in new and new.endswith(NOTES_LINE + "\n" + notes)  # the notes byte for byte
    assert new.count(NOTES_LINE) == 1 and picture_again == picture


def test_the_page_commands_quote_a_run_folder_with_a_space(finished, tmp_path):
    import shlex

    out = tmp_path / "out dir"
    shutil.copytree(finished[0], out)
    outcomes = run_table(_table(), [0], out=out, rounds=2)  # reads the finished run
    page, _ = write_page(_table(), outcomes, pages=tmp_path / "pages", seeds=[0], rounds=2, synthetic=False,
                         command="x")
    command = next(line for line in page.read_text().splitlines() if line.startswith("python tools/train_fed.py"))
    words = shlex.split(command)
    assert words[words.index("--out") + 1] == str(outcomes[0][0].runs[0].run_dir) and " " in str(out)
    assert "ours is their mean ± sample standard deviation, n - 1" in page.read_text()


def test_the_generated_results_pages_carry_the_marker_and_hand_written_ones_do_not():
    results = REPO / "docs" / "results"
    generated = {"cpu-fashion-mnist", "feddg-protocol1-synthetic", "fedftg-closed-loop", "fedlmd-table3-mnist",
                 "fedreid-table2-synthetic", "fedreid-table4-synthetic", "fedreid-table8-synthetic"}
    for page in sorted(results.glob("*.md")):
        lines = page.read_text().splitlines()
        assert lines[0].startswith(WRITTEN_BY) == (page.stem in generated), page.name
        if page.stem in generated:
            assert lines.count(NOTES_LINE) == 1, page.name
            # a synthetic world's numbers never sit under the real table's name
            assert ("**Synthetic world**" in page.read_text()) == page.stem.endswith("-synthetic"), page.name
    # the hand-written paragraphs of the Table 3 page are its notes now, kept when the page is rewritten
    t3 = (results / "fedlmd-table3-mnist.md").read_text()
    notes = t3.split(NOTES_LINE)[1]
    assert "Before this page's runs trained on augmented digits" in notes and "The four LDA runs above were made" in notes


# --------------------------------------------------------------------------- --rows / --columns


def test_a_subset_run_trains_only_its_cells_and_its_page_lists_the_whole_table(finished, tmp_path, monkeypatch):
    from fedreid.commands import reproduce as tool

    out = _copy(finished, tmp_path)
    table = _two_rows()
    outcomes = run_table(table, [0], out=out, rounds=2, rows=["fedavg"])
    assert [o.runs[0].status for row in outcomes for o in row] == ["done", "not-run"]
    assert not (out / "tiny-digits" / "d-fedprox").exists()  # read, not run
    monkeypatch.setitem(TABLES, "tiny-digits", table)
    pages = tmp_path / "pages"
    assert tool.main(["tiny-digits", "--rows", "fedavg", "--rounds", "2", "--out", str(out), "--pages", str(pages)]) == 0
    text = (pages / "tiny-digits.md").read_text()
    assert "| FedAvg | 90.00 |" in text
    fedprox = next(line for line in text.splitlines() if line.startswith("| FedProx |"))
    assert fedprox.endswith("| not run |")
    # the command that fills the whole page, not only the selected rows
    assert f"- Command: `python tools/reproduce.py tiny-digits --seeds 0 --rounds 2 --out {out} --pages {pages}`" in text


# --------------------------------------------------------------------------- --synthetic


def test_synthetic_runs_and_pages_are_kept_apart_from_the_real_ones(tmp_path):
    table = _table(synthetic=("train.lr=0.001",))
    outcomes = _empty_outcomes(table, tmp_path, synthetic=True)
    assert outcomes[0][0].runs[0].run_dir == tmp_path / "no-runs" / "tiny-digits-synthetic" / "d-fedavg" / "seed0"
    pages = tmp_path / "pages"
    page, _ = write_page(table, outcomes, pages=pages, seeds=[0], rounds=1, synthetic=True, command="x")
    assert page == pages / "tiny-digits-synthetic.md" and "**Synthetic world**" in page.read_text()
    real, _ = write_page(table, _empty_outcomes(table, tmp_path), pages=pages, seeds=[0], rounds=1, synthetic=False,
                         command="x")
    assert real == pages / "tiny-digits.md" and "**Synthetic world**" not in real.read_text()
    assert "**Synthetic world**" in page.read_text()


def test_the_synthetic_schedule_is_the_full_one_of_a_synthetic_page(tmp_path):
    table = TABLES["fedreid-table4"]
    outcomes = [[CellOutcome(cell, table.cell_slug(row, j), []) for j, cell in enumerate(row.cells)]
                for row in table.rows]
    for rounds, banner in ((None, None), (9, None), (5, "**Reduced schedule: 5 rounds** (the configs' schedule: 9)")):
        page, _ = write_page(table, outcomes, pages=tmp_path / str(rounds), seeds=[0], rounds=rounds, synthetic=True,
                             command="x")
        text = page.read_text()
        assert ("**Reduced schedule" in text) is (banner is not None), rounds
        assert banner is None or banner in text
    page, _ = write_page(table, outcomes, pages=tmp_path / "12", seeds=[0], rounds=12, synthetic=True, command="x")
    text = page.read_text()  # more rounds than the configs' schedule: not called reduced
    assert "**Extended schedule: 12 rounds** (the configs' schedule: 9). Differences to the paper include the " \
           "longer training." in text and "Reduced" not in text


# --------------------------------------------------------------------------- the machine line


def test_the_machine_line_shows_every_key_a_run_recorded(tmp_path):
    env = {"torch_threads": 1, "torch": "2.0", "python": "3.11.7", "machine": "Linux x86_64",
           "device": "cuda (NVIDIA H100 80GB HBM3)", "precision": "bf16+tf32"}
    run = RunResult(tmp_path, 0, "done", [], 1, 1, environment=env)
    line = machine_description([run])
    assert "Linux x86_64, Python 3.11.7, torch 2.0 with 1 torch thread, device cuda (NVIDIA H100 80GB HBM3), " \
           "precision bf16+tf32 (1 run)" in line


@pytest.mark.parametrize("option", ["--pages", "--out"])
def test_a_file_as_pages_or_out_is_one_line_naming_the_option(tmp_path, option, capsys):
    from fedreid.commands import reproduce as tool

    file = tmp_path / "file"
    file.write_text("mine\n")
    paths = {"--pages": str(tmp_path / "pages"), "--out": str(tmp_path / "runs"), option: str(file)}
    with pytest.raises(ReproduceError, match=rf"^{option} .*file: expected a folder, but .*file is a file$"):
        tool.main(["mnist-augmentation", "--page-only", "--out", paths["--out"], "--pages", paths["--pages"]])
    assert file.read_text() == "mine\n"
    assert "[" not in capsys.readouterr().out  # refused before any cell is looked at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
