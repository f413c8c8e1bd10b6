"""Run a paper table's cells (resumably) and write its results page: paper vs ours.

Each run lives in ``<out>/<table>/<cell slug>/seed<k>/`` (``--synthetic``:
``<out>/<table>-synthetic/...``, so synthetic and real runs never share a
folder) and is an ordinary run folder of
:func:`fedreid.fl.simulation.run_simulation`: an interrupted run continues
where it stopped, a finished run is only read.

A run folder is read or continued only if it holds a run of the very config
the table asks for: the config its checkpoint saved must equal the cell's
(seed and ``fl.rounds`` included) up to the keys that cannot change the
numbers (``run.*`` and the other non-``fl.rounds`` prefixes of
:data:`fedreid.fl.simulation.RESUMABLE_CHANGES`), and its history must hold
the evaluations of that schedule only (a run continued from a shorter
schedule keeps an evaluation at its old last round that a fresh run never
makes). Any other folder is a :class:`ReproduceError` naming it and what
differs, raised before any run of the table trains. So a reduced schedule
(``rounds``) and the full one, or runs of an edited config, never mix.

The page ``<pages>/<table>.md`` (``--synthetic``: ``<table>-synthetic.md``)
lists every row of the table, for every cell the paper's number, ours (mean ±
std over the seeds that finished) and the difference, per row how many seeds
each number averages, the minutes per run and what is missing (seeds not
finished, failed or unfinished runs, data not on the machine), and the exact
command; a PNG beside it plots the curves. Its first line marks it as the
tool's (:data:`PAGE_MARKER`): a page or picture without the mark is never
replaced, and the text below the page's :data:`NOTES_MARKER` line is kept
when the page is rewritten. A run of some rows or columns
(``rows``/``columns``) trains only those cells; its page still lists the
whole table, reading whatever runs of the same config are there for the
other cells.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from fedreid.config import Config, from_dict, load_config, to_dict
from fedreid.errors import ConfigError, FedReIDError
from fedreid.fl.inputs import missing_inputs
from fedreid.fl.server import RoundFailedError, is_eval_round
from fedreid.fl.simulation import RESUMABLE_CHANGES, config_changes
from fedreid.options import did_you_mean
from fedreid.reproduce.tables import Cell, Table
from fedreid.utils.cli import literal_override
from fedreid.utils.io import file_in_the_way, write_json_atomic
from fedreid.utils.logging import flatten

#: The repository root: the tables name their configs relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Config keys a finished or stopped run may differ in from the table's cell: those that cannot change its
#: numbers (every resumable change but ``fl.rounds``, which decides the rounds evaluated).
IGNORED_CHANGES = tuple(prefix for prefix in RESUMABLE_CHANGES if prefix != "fl.rounds")

#: The first line of every page the tool writes; a page without it is never replaced.
PAGE_MARKER = "<!-- written by tools/reproduce.py"
PAGE_HEADER = (f"{PAGE_MARKER}: each run of the tool rewrites this page; text below the notes line at the end "
               "is kept -->")
#: The line below which a page's hand-written notes are kept when the tool rewrites the page.
NOTES_MARKER = "<!-- notes: kept when tools/reproduce.py rewrites this page -->"
#: The PNG text chunk (``Comment``) that marks a picture as the tool's.
PICTURE_MARK = "written by tools/reproduce.py"


def config_path(cell: Cell) -> Path:
    """The cell's config file; a relative name is taken from the repository root, whatever the working folder."""
    path = Path(cell.config or "")
    return path if path.is_absolute() else REPO_ROOT / path


class ReproduceError(FedReIDError, ValueError):
    """A table run that cannot go on (a run folder of another config, a bad table name, seed or page)."""


@dataclass
class RunResult:
    """One (cell config, seed) run."""

    run_dir: Path
    seed: int
    status: str  # "done", "partial", "failed", "missing-data", "not-run"
    history: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 0
    planned_rounds: int = 0
    seconds: float = 0.0
    detail: str = ""
    #: What the run recorded of its environment (:func:`fedreid.fl.simulation.run_environment`), {} when none.
    environment: dict[str, Any] = field(default_factory=dict)


def table_folder(table: Table, synthetic: bool) -> str:
    """The name of the table's run tree under ``--out`` and of its page: ``<table>`` or ``<table>-synthetic``."""
    return f"{table.name}-synthetic" if synthetic else table.name


def run_folder(out: Path, table: Table, slug: str, seed: int, synthetic: bool) -> Path:
    """``<out>/<table>[-synthetic]/<cell slug>/seed<k>``: one seed's run of a cell."""
    return Path(out) / table_folder(table, synthetic) / slug / f"seed{seed}"


def cell_overrides(table: Table, cell: Cell, seed: int, rounds: Optional[int], synthetic: bool,
                   run_dir: Path) -> list[str]:
    """The overrides that turn a cell's config into one seed's run."""
    out = _schedule_overrides(table, cell, synthetic) + [f"seed={seed}"]
    if rounds is not None:
        out.append(f"fl.rounds={rounds}")
    out.append(literal_override("run.out_dir", str(run_dir)))
    return out


def _schedule_overrides(table: Table, cell: Cell, synthetic: bool) -> list[str]:
    """The overrides every seed's run of the cell shares: the synthetic world's, then the cell's own."""
    return list(table.synthetic if synthetic else ()) + list(cell.overrides)


def missing_data(cfg: Config) -> str:
    """What the run needs that is not on this machine, every item ('' when everything is there)."""
    return "; ".join(missing_inputs(cfg))


def check_seeds(seeds: Sequence[int]) -> None:
    """Refuse, as a one-line :class:`ReproduceError`, no seed, a seed given twice or one the config refuses."""
    if not seeds:
        raise ReproduceError("--seeds: give at least one seed")
    for seed in seeds:
        if list(seeds).count(seed) > 1:
            raise ReproduceError(f"--seeds: seed {seed} is given twice ({' '.join(map(str, seeds))}); "
                                 "each seed is one run, counted once")
        try:
            load_config(None, [f"seed={seed}"])
        except ConfigError as exc:
            raise ReproduceError(f"--seeds: {exc}") from None


def selected_cells(table: Table, rows: Optional[Sequence[str]] = None,
                   columns: Optional[Sequence[str]] = None) -> set[tuple[int, int]]:
    """The (row, column) indices of the cells ``rows``/``columns`` (slugs; None: all) select; unknown slugs refused."""
    if rows:
        unknown = sorted(set(rows) - {r.slug for r in table.rows})
        if unknown:
            raise ReproduceError(f"{table.name} has no row {unknown[0]!r}; rows: {', '.join(r.slug for r in table.rows)}")
    if columns:
        if table.kind == "reid":
            raise ReproduceError(f"{table.name}: a ReID table's columns are metrics of one run; select rows instead")
        unknown = sorted(set(columns) - set(table.column_slugs))
        if unknown:
            raise ReproduceError(f"{table.name} has no column {unknown[0]!r}; columns: {', '.join(table.column_slugs)}")
    return {(i, j) for i, row in enumerate(table.rows) if not rows or row.slug in rows
            for j in range(len(row.cells)) if not columns or table.column_slugs[j] in columns}


@dataclass
class SavedRun:
    """What a run folder holds: its latest checkpoint's rounds, history, environment and config."""

    rounds: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    #: The config the checkpoint saved (or, with no checkpoint, the one of :data:`FAILED_RECORD`); None: no run.
    config: Optional[dict[str, Any]] = None


#: Written into a run folder whose run diverged, so that a page written later (--page-only) says so.
FAILED_RECORD = "failed.json"


def read_run(run_dir: Path) -> SavedRun:
    """The run folder's latest checkpoint (rounds, history, environment, config); an empty one when none."""
    from fedreid.utils.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        failed = run_dir / FAILED_RECORD
        config = json.loads(failed.read_text()).get("config") if failed.is_file() else None
        return SavedRun(config=config)
    ckpt = load_checkpoint(path)
    return SavedRun(int(ckpt["round"]), list(ckpt["history"]), dict(ckpt.get("environment") or {}),
                    dict(ckpt["config"]))


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_run_folder(run_dir: Path, saved: SavedRun, cfg: Config) -> None:
    """Refuse, as a one-line :class:`ReproduceError`, a run folder that holds a run of another config than ``cfg``.

    The saved config may differ only in :data:`IGNORED_CHANGES`; its history may hold only the evaluations of
    its own schedule (a run continued from a shorter one keeps an evaluation at the old last round).
    """
    if saved.config is None:
        return
    try:
        old = from_dict(Config, saved.config)
    except (ConfigError, TypeError, ValueError, KeyError) as exc:
        raise ReproduceError(f"{run_dir} holds a run whose saved config no longer loads ({exc}); "
                             "use another --out for this table run") from None
    changed = [k for k in config_changes(old, cfg) if not k.startswith(IGNORED_CHANGES)]
    if changed:
        there, asked = flatten(to_dict(old)), flatten(to_dict(cfg))
        what = ", ".join(f"{k}: {_short(there.get(k, '(unset)'))} there, {_short(asked.get(k, '(unset)'))} asked"
                         for k in changed)
        if changed == ["fl.rounds"]:  # the usual cause: --rounds left out when continuing or paging a run
            advice = (f"it was made with --rounds {there['fl.rounds']}: repeat that to continue it or write its "
                      f"page, or use another --out for the {asked['fl.rounds']}-round schedule")
        else:
            advice = "use another --out for this table run, so runs of different configs never mix"
        raise ReproduceError(f"{run_dir} holds a run of another config ({what}); {advice}")
    expected = {r for r in range(1, saved.rounds + 1) if is_eval_round(r - 1, old.eval.every, old.fl.rounds)}
    extra = sorted({int(r["round"]) for r in saved.history if r.get("eval")} - expected)
    if extra:
        raise ReproduceError(
            f"{run_dir} holds a run extended from a shorter schedule: it evaluated after round"
            f"{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))}, which a {old.fl.rounds}-round run "
            "does not; use another --out for this table run"
        )


def run_cell(table: Table, cell: Cell, slug: str, seed: int, *, out: Path, rounds: Optional[int],
             synthetic: bool, execute: bool, progress: bool,
             callbacks: Sequence[Callable[[str, dict], None]] = (), saved: Optional[SavedRun] = None,
             on_start: Optional[Callable[[], None]] = None) -> RunResult:
    """Run (or resume, or only read) one cell for one seed.

    ``saved``: the run folder as :func:`read_run` read it and :func:`check_run_folder` accepted it; None reads
    and checks it here. A folder of another config is a :class:`ReproduceError`. ``on_start()`` is called
    just before the run trains: not for a finished run, a missing dataset or ``execute=False``.
    """
    from fedreid.fl.simulation import run_simulation

    run_dir = run_folder(out, table, slug, seed, synthetic)
    cfg = load_config(config_path(cell), cell_overrides(table, cell, seed, rounds, synthetic, run_dir))
    if saved is None:
        saved = read_run(run_dir)
        check_run_folder(run_dir, saved, cfg)
    result = RunResult(run_dir, seed, "not-run", planned_rounds=cfg.fl.rounds, environment=saved.environment)
    done, history = saved.rounds, saved.history
    if done < cfg.fl.rounds and execute:
        lacking = missing_data(cfg)
        if lacking:
            result.status, result.detail = "missing-data", lacking
            return result
        if on_start is not None:
            on_start()
        try:
            history = run_simulation(cfg, run_dir, resume=done > 0, progress=progress, callbacks=callbacks,
                                     tool="reproduce")
        except (RoundFailedError, FloatingPointError) as exc:  # the run diverged (non-finite loss or updates)
            after = read_run(run_dir)
            done, history, result.environment = after.rounds, after.history, after.environment
            result.status, result.detail = "failed", f"stopped in round {done + 1}: {exc}"
            write_json_atomic(run_dir / FAILED_RECORD,
                              {"round": done + 1, "detail": result.detail, "config": to_dict(cfg)})
            result.history, result.rounds = history, done
            return result
        done = len(history)
        result.environment = read_run(run_dir).environment  # what run_simulation recorded in the checkpoint
        from fedreid.eval.report import write_report

        write_report(run_dir, history, title=f"{table.name}: {slug}, seed {seed}",
                     targets=cfg.classification.target_accuracies)
    elif done < cfg.fl.rounds and (run_dir / FAILED_RECORD).is_file():  # --page-only: how the last attempt ended
        result.status, result.detail = "failed", json.loads((run_dir / FAILED_RECORD).read_text())["detail"]
        result.history, result.rounds = history, done
        return result
    result.history, result.rounds = history, done
    result.seconds = float(sum(r.get("time", {}).get("round", 0.0) for r in history))
    if done >= cfg.fl.rounds:
        result.status = "done"
    elif done:
        result.status, result.detail = "partial", f"{done} of {cfg.fl.rounds} rounds"
    return result


def cell_value(cell: Cell, history: Sequence[dict[str, Any]]) -> Optional[float]:
    """The cell's number (in %) from one run's history, or None when the run has none."""
    from fedreid.eval.report import classification_summary, paper_summary

    if not history:
        return None
    if cell.metric == "best_accuracy":
        summary = classification_summary(history, ())
        return 100 * summary["best_accuracy"] if summary else None
    row = paper_summary(history)["datasets"].get(cell.dataset or "")
    return None if row is None or cell.metric not in row else 100 * row[cell.metric]


@dataclass
class CellOutcome:
    cell: Cell
    slug: str
    runs: list[RunResult]

    def finished(self) -> list[RunResult]:
        """The finished runs that give the cell a number: the ones :meth:`values` averages."""
        return [r for r in self.runs if r.status == "done" and cell_value(self.cell, r.history) is not None]

    def values(self) -> list[float]:
        vals = [cell_value(self.cell, r.history) for r in self.runs if r.status == "done"]
        return [v for v in vals if v is not None]


def run_table(table: Table, seeds: Sequence[int], *, out: Path, rounds: Optional[int] = None,
              synthetic: bool = False, execute: bool = True, progress: bool = False,
              rows: Optional[Sequence[str]] = None, columns: Optional[Sequence[str]] = None,
              on_run: Optional[Callable[[str, int], None]] = None,
              callbacks: Sequence[Callable[[str, dict], None]] = ()) -> list[list[CellOutcome]]:
    """Every implemented cell of ``table`` for every seed; ``outcomes[row][column]``.

    Cells sharing a config and overrides share their runs. ``execute=False``
    only reads the runs already there (for ``--page-only``); so do the cells
    outside ``rows``/``columns`` (slugs; None: every row or column), which
    are still listed. Before anything trains, the seeds are checked
    (:func:`check_seeds`) and every run folder the table reads
    (:func:`check_run_folder`); ``on_run(slug, seed)`` is called as each
    selected run starts training (or resumes); a finished run or one whose
    data is missing starts nothing.
    """
    check_seeds(seeds)
    if synthetic and not table.synthetic:
        raise ReproduceError(f"{table.name} has no synthetic variant (only the FedReID tables do)")
    chosen = selected_cells(table, rows, columns)
    plan: dict[tuple[str, tuple[str, ...], str], tuple[Cell, str, bool]] = {}
    for i, row in enumerate(table.rows):
        for j, cell in enumerate(row.cells):
            if cell.missing or cell.config is None:
                continue
            slug = table.cell_slug(row, j)
            key = (*cell.run_key, slug)
            selected = (i, j) in chosen or (key in plan and plan[key][2])
            plan[key] = (cell, slug, selected)
    saved: dict[tuple[Any, ...], SavedRun] = {}
    for key, (cell, slug, _) in plan.items():  # the door: every folder read or continued is checked first
        for seed in seeds:
            run_dir = run_folder(out, table, slug, seed, synthetic)
            cfg = load_config(config_path(cell), cell_overrides(table, cell, seed, rounds, synthetic, run_dir))
            saved[(*key, seed)] = read_run(run_dir)
            check_run_folder(run_dir, saved[(*key, seed)], cfg)
    results: dict[tuple[str, tuple[str, ...], str], list[RunResult]] = {}
    for key, (cell, slug, selected) in plan.items():
        runs = []
        for seed in seeds:
            start = None if on_run is None else functools.partial(on_run, slug, seed)
            runs.append(run_cell(table, cell, slug, seed, out=out, rounds=rounds, synthetic=synthetic,
                                 execute=execute and selected, progress=progress, callbacks=callbacks,
                                 saved=saved.pop((*key, seed)), on_start=start))
        results[key] = runs
    outcomes: list[list[CellOutcome]] = []
    for row in table.rows:
        row_out = []
        for j, cell in enumerate(row.cells):
            slug = table.cell_slug(row, j)
            row_out.append(CellOutcome(cell, slug, results.get((*cell.run_key, slug), [])))  # not run: []
        outcomes.append(row_out)
    return outcomes


# --------------------------------------------------------------------------- the page


def machine_description(runs: Sequence[RunResult]) -> str:
    """The page's machine line: this machine, and the environment each run recorded in its checkpoint.

    Thread count and versions come from the runs (:func:`fedreid.fl.simulation.run_environment`), not from
    the process writing the page: a ``--page-only`` process may run with another thread count. Any further
    key a run recorded (``device``, ``precision``...) is shown as ``key value``.
    """
    import torch

    from fedreid.fl.simulation import torch_threads_phrase

    cpu = platform.processor() or platform.machine()
    here = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu})"
    if torch.cuda.is_available():
        here += f", GPU {torch.cuda.get_device_name(0)}"
    counts: dict[str, int] = {}
    unrecorded = 0
    for run in runs:
        if run.status not in ("done", "partial", "failed"):  # never trained: nothing to describe
            continue
        env = run.environment
        if not env:
            unrecorded += 1
            continue
        what = (f"{env.get('machine', '?')}, Python {env.get('python', '?')}, torch {env.get('torch', '?')} "
                f"with {torch_threads_phrase(int(env.get('torch_threads', 0)))}")
        what += "".join(f", {key} {env[key]}" for key in env if key not in ("machine", "python", "torch",
                                                                              "torch_threads"))
        counts[what] = counts.get(what, 0) + 1
    recorded = [f"{what} ({n} run{'' if n == 1 else 's'})" for what, n in counts.items()]
    if unrecorded:
        recorded.append(f"not recorded ({unrecorded} run{'' if unrecorded == 1 else 's'})")
    return f"page written on {here}; the runs recorded: {'; '.join(recorded) or 'none yet'}"


def _fmt(values: Sequence[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}"


def _paper(cell: Cell) -> str:
    if cell.paper is None:
        return "–"
    return f"{cell.paper:.2f}" + (f" ± {cell.paper_std:.2f}" if cell.paper_std is not None else "")


def _delta(cell: Cell, values: Sequence[float]) -> str:
    if cell.paper is None or not values:
        return "–"
    return f"{np.mean(values) - cell.paper:+.2f}"


def _status(outcome: CellOutcome) -> str:
    if outcome.cell.missing:
        return outcome.cell.missing
    runs = outcome.runs
    missing = [r for r in runs if r.status == "missing-data"]
    if missing:
        return f"data missing: {missing[0].detail}"
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        attempted = [r for r in runs if r.status != "not-run"]
        return (f"{len(failed)} of {len(attempted)} runs failed (seed {failed[0].seed} "
                f"{failed[0].detail.split(':')[0]}), left out of the mean")
    partial = [r for r in runs if r.status == "partial"]
    if partial:
        return f"unfinished ({partial[0].detail})"
    if not any(r.status == "done" for r in runs):
        return "not run"
    return ""


def _runnable(outcome: CellOutcome) -> bool:
    return not outcome.cell.missing and outcome.cell.config is not None


def _seeds_note(table: Table, column: int, outcome: CellOutcome, asked: int) -> str:
    """``"1 of 3 seeds finished"`` (prefixed by the column in a table of several runs per row), '' when all did."""
    n = len(outcome.finished())
    if not _runnable(outcome) or n == 0 or n >= asked:
        return ""
    prefix = f"{table.columns[column]}: " if table.kind != "reid" and len(table.columns) > 1 else ""
    return f"{prefix}{n} of {asked} seed{'' if asked == 1 else 's'} finished"


def _seeds_column(row_out: Sequence[CellOutcome]) -> str:
    """How many seeds each number of the row averages: one count, or one per column where they differ."""
    counts = [len(o.finished()) if _runnable(o) else None for o in row_out]
    ran = {c for c in counts if c is not None}
    if not ran or ran == {0}:
        return "–"
    if len(ran) == 1:
        return str(ran.pop())
    return " / ".join(str(c) if c else "–" for c in counts)


def _seeds_finished(outcomes: Sequence[Sequence[CellOutcome]]) -> str:
    """The header's finished seeds: each set of seeds and in how many cells it finished."""
    groups: dict[tuple[int, ...], int] = {}
    for row_out in outcomes:
        for outcome in row_out:
            if _runnable(outcome):
                done = tuple(sorted(r.seed for r in outcome.finished()))
                groups[done] = groups.get(done, 0) + 1
    if not groups:
        return "–"
    if len(groups) == 1:
        done = next(iter(groups))
        return f"{', '.join(map(str, done))} in every cell" if done else "none yet"
    ordered = sorted(groups.items(), key=lambda item: (-len(item[0]), item[0]))
    return "; ".join(f"{', '.join(map(str, done)) or 'none'} in {n} cell{'' if n == 1 else 's'}"
                     for done, n in ordered)


#: What every ReID page says of its Rank-k columns (fedreid.eval.metrics: ``rank<k>`` and ``rank<k>_official``).
RANK_CONVENTION = ("Rank-k (ours) divides by the queries that have a valid match in the gallery; the FedReID "
                   "official evaluate.py divides by all queries. Each run's report has both (the "
                   "\"Rank-1 (official)\" column); they differ only where a query has no valid match.")


def page_paths(table: Table, pages: Path, synthetic: bool) -> tuple[Path, Path]:
    """The table's page and picture: ``<pages>/<table>[-synthetic].md`` and ``.png``."""
    name = table_folder(table, synthetic)
    return Path(pages) / f"{name}.md", Path(pages) / f"{name}.png"


def _ours(page: Path) -> bool:
    with page.open(encoding="utf-8", errors="replace") as f:
        return f.readline().startswith(PAGE_MARKER)


def _our_picture(picture: Path) -> bool:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(picture) as image:
            return PICTURE_MARK in str(getattr(image, "text", {}).get("Comment", ""))
    except (OSError, UnidentifiedImageError):
        return False


def check_folder_option(option: str, path: Path) -> None:
    """Refuse, as a one-line :class:`ReproduceError` naming ``option``, a folder path that is (or lies under) a file."""
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise ReproduceError(f"{option} {path}: expected a folder, but {blocker} is a file")


def check_pages(table: Table, pages: Path, synthetic: bool) -> None:
    """Refuse, as a one-line :class:`ReproduceError`, a page or picture there that the tool did not write.

    A page is the tool's when its first line starts with :data:`PAGE_MARKER`; a picture when it carries
    :data:`PICTURE_MARK` or stands beside a page of the tool's (the two are written together).
    """
    check_folder_option("--pages", pages)
    page, picture = page_paths(table, pages, synthetic)
    for path in (page, picture):
        if path.exists() and not path.is_file():
            raise ReproduceError(f"{path} is not a file; choose another --pages")
    if page.is_file() and not _ours(page):
        raise ReproduceError(f"{page} was not written by tools/reproduce.py (its first line is not "
                             f"{PAGE_MARKER!r}...); move it or choose another --pages")
    if picture.is_file() and not _our_picture(picture) and not (page.is_file() and _ours(page)):
        raise ReproduceError(f"{picture} was not written by tools/reproduce.py; move it or choose another --pages")


def _kept_notes(page: Path) -> str:
    """The text below the page's :data:`NOTES_MARKER` line, as it is ('' when there is no page or no such line)."""
    if not page.is_file():
        return ""
    text = page.read_text(encoding="utf-8")
    start = 0
    for line in text.splitlines(keepends=True):
        if line.strip() == NOTES_MARKER:
            return text[start + len(line):]
        start += len(line)
    return ""


def write_page(table: Table, outcomes: list[list[CellOutcome]], *, pages: Path, seeds: Sequence[int],
               rounds: Optional[int], synthetic: bool, command: str) -> tuple[Path, Optional[Path]]:
    """``<pages>/<table>[-synthetic].md`` and, when any run has a history, the ``.png`` beside it.

    Refuses (:func:`check_pages`) to replace a page or picture the tool did not write; keeps the notes below
    the old page's :data:`NOTES_MARKER` line.
    """
    from fedreid.utils.io import write_text_atomic

    page, picture_path = page_paths(table, pages, synthetic)
    check_pages(table, pages, synthetic)
    notes = _kept_notes(page)
    Path(pages).mkdir(parents=True, exist_ok=True)
    all_runs = list({r.run_dir: r for row in outcomes for o in row for r in o.runs}.values())  # ReID cells share runs
    finished = [r for r in all_runs if r.status == "done"]
    round_counts = sorted({r.rounds for r in finished})
    planned = sorted({r.planned_rounds for r in all_runs})
    lines = [PAGE_HEADER, f"# {table.title}", "", f"Source: {table.source}.", ""]
    if synthetic:
        lines += ["**Synthetic world** (`--synthetic`: " + ", ".join(f"`{o}`" for o in table.synthetic)
                  + "). The paper's numbers are for the real datasets at the paper's schedule; compare the "
                  "pattern between rows, not the absolute values.", ""]
    full = None
    for row in table.rows:
        for cell in row.cells:
            if cell.config and not cell.missing:  # the cell's (and --synthetic's) overrides may set it
                full = load_config(config_path(cell), _schedule_overrides(table, cell, synthetic)).fl.rounds
                break
        if full:
            break
    if rounds is not None and full and rounds != full:
        shorter = rounds < full
        lines += [f"**{'Reduced' if shorter else 'Extended'} schedule: {rounds} rounds** (the configs' schedule: "
                  f"{full}). Differences to the paper include the {'shorter' if shorter else 'longer'} training.", ""]
    if len(round_counts) > 1:
        lines += [f"**Mixed schedules**: finished runs stopped at {', '.join(map(str, round_counts))} rounds.", ""]
    total = sum(r.seconds for r in all_runs)
    lines += [
        f"- Command: `{command}`",
        f"- Seeds asked: {', '.join(map(str, seeds))} (the seed of the run; the data partition is fixed by "
        "`classification.split_seed` / `data.split_seed`)",
        f"- Seeds finished: {_seeds_finished(outcomes)} (the seeds column: how many each number averages; "
        "ours is their mean ± sample standard deviation, n - 1)",
        f"- Rounds: {', '.join(map(str, planned)) or '–'} planned; {', '.join(map(str, round_counts)) or '–'} "
        "completed in the finished runs",
        f"- Data: {table.data}",
        f"- Machine: {machine_description(all_runs)}",
        f"- Wall time of the runs: {total / 60:.1f} min in all (the rounds' own times: setup and data loading "
        "left out)",
        f"- Written: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    if table.note:
        lines += [table.note, ""]
    if table.kind == "reid":
        lines += [RANK_CONVENTION, ""]
    header = ["row"]
    for col in table.columns:
        header += [f"{col} paper", f"{col} ours", "Δ"]
    header += ["seeds", "minutes / run", "note"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, row_out in zip(table.rows, outcomes):
        cells = [row.label]
        notes_of_row: list[str] = []
        minutes: list[float] = []
        statuses = [_status(outcome) for outcome in row_out]
        by_column = len(set(statuses)) > 1  # "not run" in one column only: say which
        for j, outcome in enumerate(row_out):
            values = outcome.values()
            cells += [_paper(outcome.cell), _fmt(values), _delta(outcome.cell, values)]
            status = f"{table.columns[j]}: {statuses[j]}" if by_column and statuses[j] else statuses[j]
            for note in (status, _seeds_note(table, j, outcome, len(seeds))):
                if note and note not in notes_of_row:
                    notes_of_row.append(note)
            minutes += [r.seconds / 60 for r in outcome.runs if r.status == "done"]
        cells += [_seeds_column(row_out), f"{np.mean(minutes):.1f}" if minutes else "–", "; ".join(notes_of_row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    commands = sorted({f"python tools/train_fed.py --config {shlex.quote(str(o.cell.config))} "
                       f"--out {shlex.quote(str(r.run_dir))} "
                       + " ".join(shlex.quote(x) for x in cell_overrides(table, o.cell, r.seed, rounds, synthetic,
                                                                       r.run_dir)[:-1])
                       for row in outcomes for o in row for r in o.runs[:1]})
    if commands:
        lines += ["Each run on its own (the first seed; `seed=` picks another):", "", "```"] + commands + ["```", ""]
    picture = _plot(table, outcomes, picture_path)
    if picture is not None:
        lines += [f"![curves]({picture.name})", ""]
    write_text_atomic(page, "\n".join(lines + [NOTES_MARKER]) + "\n" + notes)
    return page, picture


def _curve(history: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for record in history:
        ev = record.get("eval") or {}
        if not ev:
            continue
        if "test" in ev and "accuracy" in ev["test"]:
            y = ev["test"]["accuracy"]
        else:
            y = float(np.mean([m["rank1"] for m in ev.values() if "rank1" in m])) if ev else math.nan
        xs.append(int(record["round"]))
        ys.append(100 * y)
    return xs, ys


def _plot(table: Table, outcomes: list[list[CellOutcome]], path: Path) -> Optional[Path]:
    """Mean curve over the seeds of every run: accuracy (classification) or mean Rank-1 (ReID) per round."""
    from fedreid.utils.io import atomic_path
    from fedreid.utils.plotting import agg_figure

    series = {}
    rows_of = {}  # run slug -> the rows it fills (one ReID run fills every dataset's row)
    for row_out in outcomes:
        for outcome in row_out:
            rows_of[outcome.slug] = rows_of.get(outcome.slug, 0) + 1
    for row, row_out in zip(table.rows, outcomes):
        for j, outcome in enumerate(row_out):
            runs = [r for r in outcome.runs if r.history]
            if not runs or outcome.slug in {s for s, _ in series.values()}:
                continue
            curves = [_curve(r.history) for r in runs]
            length = min(len(c[0]) for c in curves)
            if length == 0:
                continue
            label = row.label if table.kind == "reid" or len(table.columns) == 1 else f"{row.label}, {table.columns[j]}"
            if table.kind == "reid" and rows_of[outcome.slug] > 1:
                label = "the run, mean over its datasets"  # not the first row's dataset: the curve is the mean
            xs = curves[0][0][:length]
            ys = np.mean([c[1][:length] for c in curves], axis=0)
            series[label] = (outcome.slug, (xs, ys))
    if not series:
        return None
    fig, ax = agg_figure(figsize=(7, 4.2))
    for label, (_, (xs, ys)) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.3)
    ax.set_xlabel("round")
    ax.set_ylabel("mean Rank-1 (%)" if table.kind == "reid" else "test accuracy (%)")
    ax.set_title(table.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata={"Comment": PICTURE_MARK})
    return path


def resolve_tables(names: Sequence[str]) -> list[Table]:
    from fedreid.reproduce.tables import TABLES

    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ReproduceError(f"unknown table {unknown[0]!r}{did_you_mean(unknown[0], list(TABLES))}; "
                             f"known tables: {', '.join(TABLES)} (see --list)")
    return [TABLES[n] for n in names]


__all__ = ["CellOutcome", "ReproduceError", "RunResult", "SavedRun", "cell_value", "check_pages", "check_run_folder",
           "check_seeds", "missing_data", "page_paths", "read_run", "resolve_tables", "run_folder", "run_table",
           "selected_cells", "write_page"]
