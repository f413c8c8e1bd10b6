"""Run a paper table's cells (resumably) and write its results page: paper vs ours.

Each run lives in ``<out>/<table>/<cell slug>/seed<k>/`` and is an ordinary
run folder of :func:`fedreid.fl.simulation.run_simulation`: an interrupted
table continues where it stopped, a finished run is only read. The page
``<pages>/<table>.md`` lists per row the paper's number, ours (mean ± std over
the seeds that finished), the difference, the seeds, the rounds, the wall
time and the exact command; a PNG beside it plots the curves.

A reduced schedule (``rounds``) is allowed and printed as such. A run folder
holding more completed rounds than asked is refused rather than read up to a
point, and a page whose runs stopped at different round counts says so at
the top: reduced and full rows are never mixed silently.
"""

from __future__ import annotations

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

from fedreid.config import Config, load_config
from fedreid.errors import FedReIDError
from fedreid.fl.inputs import missing_inputs
from fedreid.fl.server import RoundFailedError
from fedreid.reproduce.tables import Cell, Table
from fedreid.utils.cli import literal_override
from fedreid.utils.io import write_json_atomic

#: The repository root: the tables name their configs relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]


def config_path(cell: Cell) -> Path:
    """The cell's config file; a relative name is taken from the repository root, whatever the working folder."""
    path = Path(cell.config or "")
    return path if path.is_absolute() else REPO_ROOT / path


class ReproduceError(FedReIDError, ValueError):
    """A table run that cannot go on (a run folder from another schedule, a bad table name)."""


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


def cell_overrides(table: Table, cell: Cell, seed: int, rounds: Optional[int], synthetic: bool,
                   run_dir: Path) -> list[str]:
    """The overrides that turn a cell's config into one seed's run."""
    out = list(table.synthetic if synthetic else ()) + list(cell.overrides) + [f"seed={seed}"]
    if rounds is not None:
        out.append(f"fl.rounds={rounds}")
    out.append(literal_override("run.out_dir", str(run_dir)))
    return out


def missing_data(cfg: Config) -> str:
    """What the run needs that is not on this machine, every item ('' when everything is there)."""
    return "; ".join(missing_inputs(cfg))


def _completed(run_dir: Path) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Completed rounds, history and recorded environment of the run folder's latest checkpoint."""
    from fedreid.utils.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir)
    if path is None:
        return 0, [], {}
    ckpt = load_checkpoint(path)
    return int(ckpt["round"]), list(ckpt["history"]), dict(ckpt.get("environment") or {})


#: Written into a run folder whose run diverged, so that a page written later (--page-only) says so.
FAILED_RECORD = "failed.json"


def run_cell(table: Table, cell: Cell, slug: str, seed: int, *, out: Path, rounds: Optional[int],
             synthetic: bool, execute: bool, progress: bool,
             callbacks: Sequence[Callable[[str, dict], None]] = ()) -> RunResult:
    """Run (or resume, or only read) one cell for one seed."""
    from fedreid.fl.simulation import run_environment, run_simulation

    run_dir = out / table.name / slug / f"seed{seed}"
    cfg = load_config(config_path(cell), cell_overrides(table, cell, seed, rounds, synthetic, run_dir))
    result = RunResult(run_dir, seed, "not-run", planned_rounds=cfg.fl.rounds)
    done, history, result.environment = _completed(run_dir)
    if done > cfg.fl.rounds:
        raise ReproduceError(
            f"{run_dir} holds {done} completed rounds but this table run asks for {cfg.fl.rounds}; "
            "use another --out (or the matching --rounds) so reduced and full runs stay apart"
        )
    if done < cfg.fl.rounds and execute:
        lacking = missing_data(cfg)
        if lacking:
            result.status, result.detail = "missing-data", lacking
            return result
        try:
            history = run_simulation(cfg, run_dir, resume=done > 0, progress=progress, callbacks=callbacks,
                                     tool="reproduce")
        except (RoundFailedError, FloatingPointError) as exc:  # the run diverged (non-finite loss or updates)
            done, history, result.environment = _completed(run_dir)
            result.status, result.detail = "failed", f"stopped in round {done + 1}: {exc}"
            write_json_atomic(run_dir / FAILED_RECORD, {"round": done + 1, "detail": result.detail})
            result.history, result.rounds = history, done
            return result
        done = len(history)
        result.environment = run_environment()  # what run_simulation just recorded in the checkpoint
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

    def values(self) -> list[float]:
        vals = [cell_value(self.cell, r.history) for r in self.runs if r.status == "done"]
        return [v for v in vals if v is not None]


def run_table(table: Table, seeds: Sequence[int], *, out: Path, rounds: Optional[int] = None,
              synthetic: bool = False, execute: bool = True, progress: bool = False,
              on_run: Optional[Callable[[str, int], None]] = None,
              callbacks: Sequence[Callable[[str, dict], None]] = ()) -> list[list[CellOutcome]]:
    """Every implemented cell of ``table`` for every seed; ``outcomes[row][column]``.

    Cells sharing a config and overrides share their runs. ``execute=False``
    only reads the runs already there (for ``--page-only``).
    """
    if synthetic and not table.synthetic:
        raise ReproduceError(f"{table.name} has no synthetic variant (only the FedReID tables do)")
    cache: dict[tuple[str, tuple[str, ...], str], list[RunResult]] = {}
    outcomes: list[list[CellOutcome]] = []
    for row in table.rows:
        row_out = []
        for j, cell in enumerate(row.cells):
            slug = table.cell_slug(row, j)
            if cell.missing or cell.config is None:
                row_out.append(CellOutcome(cell, slug, []))
                continue
            key = (*cell.run_key, slug)
            if key not in cache:
                runs = []
                for seed in seeds:
                    if on_run is not None:
                        on_run(slug, seed)
                    runs.append(run_cell(table, cell, slug, seed, out=out, rounds=rounds, synthetic=synthetic,
                                         execute=execute, progress=progress, callbacks=callbacks))
                cache[key] = runs
            row_out.append(CellOutcome(cell, slug, cache[key]))
        outcomes.append(row_out)
    return outcomes


# --------------------------------------------------------------------------- the page


def machine_description(runs: Sequence[RunResult]) -> str:
    """The page's machine line: this machine, and the environment each run recorded in its checkpoint.

    Thread count and versions come from the runs (:func:`fedreid.fl.simulation.run_environment`), not from
    the process writing the page: a ``--page-only`` process may run with another thread count.
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


#: What every ReID page says of its Rank-k columns (fedreid.eval.metrics: ``rank<k>`` and ``rank<k>_official``).
RANK_CONVENTION = ("Rank-k (ours) divides by the queries that have a valid match in the gallery; the FedReID "
                   "official evaluate.py divides by all queries. Each run's report has both (the "
                   "\"Rank-1 (official)\" column); they differ only where a query has no valid match.")


def write_page(table: Table, outcomes: list[list[CellOutcome]], *, pages: Path, seeds: Sequence[int],
               rounds: Optional[int], synthetic: bool, command: str) -> tuple[Path, Optional[Path]]:
    """``<pages>/<table>.md`` and, when any run has a history, ``<pages>/<table>.png``."""
    from fedreid.utils.io import write_text_atomic

    pages.mkdir(parents=True, exist_ok=True)
    all_runs = list({r.run_dir: r for row in outcomes for o in row for r in o.runs}.values())  # ReID cells share runs
    finished = [r for r in all_runs if r.status == "done"]
    round_counts = sorted({r.rounds for r in finished})
    planned = sorted({r.planned_rounds for r in all_runs})
    lines = [f"# {table.title}", "", f"Source: {table.source}.", ""]
    if synthetic:
        lines += ["**Synthetic world** (`--synthetic`: " + ", ".join(f"`{o}`" for o in table.synthetic)
                  + "). The paper's numbers are for the real datasets at the paper's schedule; compare the "
                  "pattern between rows, not the absolute values.", ""]
    full = None
    for row in table.rows:
        for cell in row.cells:
            if cell.config and not cell.missing:  # the cell's own overrides may set it (FedFTG Table 4: 500)
                full = load_config(config_path(cell), list(cell.overrides)).fl.rounds
                break
        if full:
            break
    if rounds is not None and full and rounds != full:
        lines += [f"**Reduced schedule: {rounds} rounds** (the configs' schedule: {full}). Differences to the paper "
                  "include the shorter training.", ""]
    if len(round_counts) > 1:
        lines += [f"**Mixed schedules**: finished runs stopped at {', '.join(map(str, round_counts))} rounds.", ""]
    total = sum(r.seconds for r in all_runs)
    lines += [
        f"- Command: `{command}`",
        f"- Seeds: {', '.join(map(str, seeds))} (the seed of the run; the data partition is fixed by "
        "`classification.split_seed` / `data.split_seed`)",
        f"- Rounds: {', '.join(map(str, planned)) or '–'} planned; {', '.join(map(str, round_counts)) or '–'} "
        "completed in the finished runs",
        f"- Data: {table.data}",
        f"- Machine: {machine_description(all_runs)}",
        f"- Wall time of the runs: {total / 60:.1f} min in all",
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
        notes = []
        seeds_done: set[int] = set()
        minutes: list[float] = []
        for outcome in row_out:
            values = outcome.values()
            cells += [_paper(outcome.cell), _fmt(values), _delta(outcome.cell, values)]
            note = _status(outcome)
            if note and note not in notes:
                notes.append(note)
            done = [r for r in outcome.runs if r.status == "done"]
            seeds_done |= {r.seed for r in done}
            minutes += [r.seconds / 60 for r in done]
        cells += [str(len(seeds_done)) if seeds_done else "–",
                  f"{np.mean(minutes):.1f}" if minutes else "–", "; ".join(notes)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    commands = sorted({f"python tools/train_fed.py --config {o.cell.config} --out {r.run_dir} "
                       + " ".join(shlex.quote(x) for x in cell_overrides(table, o.cell, r.seed, rounds, synthetic,
                                                                       r.run_dir)[:-1])
                       for row in outcomes for o in row for r in o.runs[:1]})
    if commands:
        lines += ["Each run on its own (the first seed; `seed=` picks another):", "", "```"] + commands + ["```", ""]
    picture = _plot(table, outcomes, pages / f"{table.name}.png")
    if picture is not None:
        lines += [f"![curves]({picture.name})", ""]
    page = pages / f"{table.name}.md"
    write_text_atomic(page, "\n".join(lines))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedreid.utils.io import atomic_path

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
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (_, (xs, ys)) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.3)
    ax.set_xlabel("round")
    ax.set_ylabel("mean Rank-1 (%)" if table.kind == "reid" else "test accuracy (%)")
    ax.set_title(table.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > 6 else 1)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def resolve_tables(names: Sequence[str]) -> list[Table]:
    from fedreid.reproduce.tables import TABLES

    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ReproduceError(f"unknown table {unknown[0]!r}; known tables: {', '.join(TABLES)} (see --list)")
    return [TABLES[n] for n in names]


__all__ = ["CellOutcome", "ReproduceError", "RunResult", "cell_value", "missing_data", "resolve_tables",
           "run_table", "write_page"]
