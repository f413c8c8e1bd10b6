"""Rerun a table of the FedReID, FedLMD or FedFTG paper and publish paper vs ours.

Examples:
  # which tables exist, and what each needs
  python tools/reproduce.py --list

  # FedLMD Table 3, MNIST columns, 3 seeds, a reduced 50-round schedule
  python tools/reproduce.py fedlmd-table3-mnist --seeds 0 1 2 --rounds 50

  # train only the LDA column's FedAvg, FedNTD and FedLMD rows (the page lists the whole table)
  python tools/reproduce.py fedlmd-table3-mnist --rows fedavg fedntd fedlmd --columns lda --rounds 50

  # FedReID Table 2 on the synthetic world (prepare it first: make demo, or
  # tools/prepare_datasets.py --config configs/fedreid/synthetic_fedpav.yaml --synthetic)
  python tools/reproduce.py fedreid-table2 --synthetic

Every run is an ordinary run folder under --out (<out>/<table>/<cell>/seed<k>;
--synthetic: <out>/<table>-synthetic/...): a stopped table resumes where it
stopped, a finished run is only read. A folder holding a run of another
config (another --rounds, an edited config file, the real world where
--synthetic is asked) is refused before anything trains: use another --out.
The page docs/results/<table>.md (--pages; --synthetic: <table>-synthetic.md)
gives per row the paper's number, ours (mean ± std over the seeds that
finished), the difference, how many seeds each number averages, the rounds,
the command, the data and the machine, and a PNG of the curves. A reduced
schedule (--rounds) is printed as such on the page. Cells whose data is not
on this machine are listed with the files they need and where they come from.
--rows/--columns train only those cells; the page still lists the whole
table, with the runs of the same config already under --out for the others.
The tool rewrites only pages it wrote (their first line says so) and keeps
the text below a page's last line "<!-- notes: ... -->"; any other file at
the page's name is refused.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fedreid.utils.cli import run_main, show_progress

DEFAULT_OUT = "runs/reproduce"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", help="table name (see --list)")
    parser.add_argument("--list", action="store_true", help="list the tables, their rows and the data they need")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="K",
                        help="seeds to run, each once (default: 0)")
    parser.add_argument("--rounds", type=int, help="a reduced schedule: this many rounds instead of the paper's")
    parser.add_argument("--rows", nargs="+", metavar="SLUG",
                        help="run only these rows (their slugs, see --list); the page lists every row")
    parser.add_argument("--columns", nargs="+", metavar="SLUG",
                        help="run only these columns (their slugs); the page lists every column")
    parser.add_argument("--synthetic", action="store_true",
                        help="ReID tables: run on the demo-scale synthetic world instead of the real datasets")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"root of the run folders (default: {DEFAULT_OUT})")
    parser.add_argument("--pages", help="where the result page goes (default: the repository's docs/results); "
                        "a page there that the tool did not write is refused")
    parser.add_argument("--page-only", action="store_true", help="write the page from the runs there, run nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def list_tables() -> str:
    from fedreid.reproduce.tables import TABLES

    lines = []
    for table in TABLES.values():
        runnable = sum(1 for row in table.rows for c in row.cells if not c.missing)
        lines.append(f"{table.name}: {table.title}")
        lines.append(f"    {table.source}; {len(table.rows)} rows, {runnable} runnable cells"
                     + ("; --synthetic available" if table.synthetic else ""))
        lines.append(f"    rows: {', '.join(r.slug for r in table.rows)}")
        if table.kind != "reid":
            lines.append(f"    columns: {', '.join(table.column_slugs)}")
        lines.append(f"    data: {table.data}")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> str:
    """The command that makes (or continues) every run of the page: the whole table, so no --rows/--columns."""
    parts = [args.table, "--seeds", *map(str, args.seeds)]
    if args.rounds is not None:
        parts += ["--rounds", str(args.rounds)]
    if args.synthetic:
        parts.append("--synthetic")
    if args.out != DEFAULT_OUT:
        parts += ["--out", args.out]
    if args.pages:
        parts += ["--pages", args.pages]
    return "python tools/reproduce.py " + " ".join(shlex.quote(p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    from fedreid.reproduce import ReproduceError, resolve_tables, run_table, write_page
    from fedreid.reproduce.runner import REPO_ROOT, check_folder_option, check_pages, check_seeds, selected_cells

    args = build_parser().parse_args(argv)
    if args.list:
        print(list_tables())
        return 0
    if not args.table:
        raise ReproduceError("name a table (tools/reproduce.py --list shows them)")
    if args.rounds is not None and args.rounds < 1:
        raise ReproduceError(f"--rounds must be a positive number of rounds, got {args.rounds}")
    check_seeds(args.seeds)
    table = resolve_tables([args.table])[0]
    selected_cells(table, args.rows, args.columns)  # unknown slugs refused here, before anything runs
    if args.synthetic and not table.synthetic:
        raise ReproduceError(f"{table.name} has no synthetic variant (only the FedReID tables do)")
    check_folder_option("--out", Path(args.out))
    pages = Path(args.pages) if args.pages else REPO_ROOT / "docs" / "results"
    check_pages(table, pages, args.synthetic)  # a page the tool did not write: refused before hours of training
    progress = show_progress(args)

    def on_run(slug: str, seed: int) -> None:
        print(f"[{table.name}] {slug} seed {seed}", flush=True)

    def on_event(event: str, info: dict) -> None:
        if event == "round_end" and not progress:
            record = info["record"]
            ev = (record.get("eval") or {}).get("test", {})
            acc = f"  accuracy {100 * ev['accuracy']:.2f}%" if "accuracy" in ev else ""
            print(f"    round {record['round']}{acc}", flush=True)

    outcomes = run_table(table, args.seeds, out=Path(args.out), rounds=args.rounds, synthetic=args.synthetic,
                         execute=not args.page_only, progress=progress, rows=args.rows, columns=args.columns,
                         on_run=on_run, callbacks=[on_event])
    page, picture = write_page(table, outcomes, pages=pages, seeds=args.seeds, rounds=args.rounds,
                               synthetic=args.synthetic, command=_command(args))
    lacking = sorted({r.detail for row in outcomes for o in row for r in o.runs if r.status == "missing-data"})
    for detail in lacking:
        print(f"data missing: {detail} (needs: {table.data})", file=sys.stderr)
    print(f"page: {page}" + (f"\ncurves: {picture}" if picture else ""))
    ran = any(r.status == "done" for row in outcomes for o in row for r in o.runs)
    return 0 if ran or not lacking else 3


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
