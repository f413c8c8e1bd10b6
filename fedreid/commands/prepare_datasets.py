"""Prepare ReID datasets: raw releases (or FedReID folders, or the synthetic world) -> prepared folders.

Examples:
  # the nine benchmark datasets + CUHK02 from their official releases
  python tools/prepare_datasets.py --raw-root datasets/raw --out datasets/prepared --datasets all

  # the authors' processed data (their data/ folder), no conversion re-run
  python tools/prepare_datasets.py --layout fedreid --raw-root ~/FedReID/data --datasets all

  # generate the synthetic nine-domain world, then prepare it
  python tools/prepare_datasets.py --synthetic --out datasets/prepared/synthetic

Re-running skips datasets that are already prepared (use --force to redo them),
and warns when a dataset's raw folder gained, lost or changed files since it was
prepared (its prepare.json records the file list): that copy is stale.
Nothing under the raw root is ever modified, and only folders this tool prepared
are ever replaced. A parser output with an image in two splits, or an identity
in both train and query/gallery, is refused. <out>/<name>/card.md describes one
dataset; <out>/cards.md summarises every dataset prepared under <out>, earlier
runs' included (a cards.md there that this tool did not write is refused).
--synthetic reuses a world generated with the same synthetic.* settings and
refuses one made with other settings unless --force regenerates it. A dataset
that fails (a missing release, a damaged prepared folder...) is reported and the
others are still prepared; the exit status is then 2.
See datasets/README.md for layouts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedreid.config import BENCHMARK_DATASETS, ConfigError, DataConfig, load_config
from fedreid.data.prepared import (
    PrepareReport,
    format_summary,
    prepare_dataset,
    prepared_cards,
    synthetic_world,
)
from fedreid.data.raw import PUBLIC_DATASET, create_raw_dataset, list_raw_datasets
from fedreid.data.raw.base import RawLayoutError, summarize_skips
from fedreid.errors import FedReIDError
from fedreid.options import did_you_mean
from fedreid.utils.cli import add_config_arguments, checked_overrides, literal_override, run_main, show_progress
from fedreid.utils.io import file_in_the_way, write_text_atomic

CARDS_FILE = "cards.md"
# The first line of the cards.md this tool writes; any other file there is refused (never replaced).
CARDS_MARKER = "<!-- written by tools/prepare_datasets.py"
CARDS_HEADER = f"{CARDS_MARKER}: each run rewrites this file; keep notes elsewhere -->\n"
# Before the marker the file began with its table header: such a file (table rows only) is the tool's too.
_OLD_CARDS_HEADER = "| dataset | train ids | train imgs | query ids | query imgs | gallery imgs | cameras |"


def _cards_is_ours(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.startswith(CARDS_MARKER):
        return True
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and lines[0] == _OLD_CARDS_HEADER and all(line.startswith("|") for line in lines)


def check_out_root(out_root: Path) -> None:
    """Refuse, before anything is prepared, an ``--out`` that is not a folder or a ``cards.md`` not ours."""
    blocker = file_in_the_way(out_root)
    if blocker is not None:
        raise ConfigError(f"--out {out_root}: expected a folder, but {blocker} is a file")
    cards = out_root / CARDS_FILE
    if cards.exists() and (not cards.is_file() or not _cards_is_ours(cards)):
        raise ConfigError(f"{cards} was not written by tools/prepare_datasets.py (its first line is not "
                          f"{CARDS_MARKER!r}...); move it, or choose another --out")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_arguments(parser)
    parser.add_argument("--raw-root", help="folder holding the raw releases (data.raw_root)")
    parser.add_argument("--out", help="prepared output root (data.prepared_root)")
    parser.add_argument(
        "--datasets",
        help="comma-separated names (exactly these are prepared) or 'all' (the nine benchmark datasets "
        "and the public set data.public_dataset unless it is null); default: the config's data.datasets "
        "and its public set",
    )
    parser.add_argument("--layout", choices=("raw", "fedreid"), help="input layout (data.layout)")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="first generate the synthetic world (synthetic.*) and prepare from it",
    )
    parser.add_argument(
        "--resize", metavar="HxW",
        help="resize prepared images, e.g. 256x128 (the model input: the loaders then resize nothing); OpenCV "
        "bicubic as the loaders, JPEG re-encoded at quality 95; default: copy the source bytes",
    )
    parser.add_argument("--split-seed", type=int, help="seed of drawn identity splits")
    parser.add_argument(
        "--split-file",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="reuse an identity split (a split.json written by an earlier run)",
    )
    parser.add_argument("--workers", type=int, help="parallel image copy/check workers")
    parser.add_argument(
        "--force",
        action="store_true",
        help="prepare again even if done (replaces a copy this tool made, e.g. a stale one); with --synthetic, "
        "also regenerate a synthetic world made with other settings",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def flag_overrides(args: argparse.Namespace) -> list[str]:
    # Paths go in quoted (literal_override): as bare YAML "/tmp/run #2" would
    # lose its comment part and "/x/my: out" would be read as a mapping.
    out = []
    if args.raw_root:
        out.append(literal_override("data.raw_root", args.raw_root))
    if args.out:
        out.append(literal_override("data.prepared_root", args.out))
    if args.datasets is not None:
        if not args.datasets.strip(" ,"):
            raise ConfigError(f"--datasets {args.datasets!r}: expected comma-separated dataset names or 'all'")
        out.append(f"data.datasets=[{args.datasets}]")
    if args.layout:
        out.append(f"data.layout={args.layout}")
    if args.resize:
        height, _, width = args.resize.lower().partition("x")
        out.append(f"data.resize=[{height},{width}]")
    if args.split_seed is not None:
        out.append(f"data.split_seed={args.split_seed}")
    for item in args.split_file:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path:
            raise ConfigError(f"--split-file {item!r}: expected NAME=FILE, e.g. viper=split.json")
        # The name becomes a config key; a dot in it would nest a level deeper.
        if "." in name:
            raise ConfigError(f"--split-file {item!r}: {name!r} is not a dataset name")
        out.append(literal_override(f"data.split_files.{name.strip()}", path))
    if args.workers is not None:
        out.append(f"data.workers={args.workers}")
    return out


def resolve_names(data: DataConfig, with_public: bool = True) -> list[str]:
    names = data.dataset_names()
    public = data.public_dataset
    if with_public and public and public not in names:
        names.append(public)
    known = set(list_raw_datasets())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RawLayoutError(
            f"unknown dataset {unknown[0]!r}{did_you_mean(unknown[0], sorted(known))}; "
            f"known: {', '.join(sorted(known))} or 'all'"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, checked_overrides(args, flag_overrides(args)))
    data = cfg.data
    # named datasets on the command line are prepared alone; 'all' or a config's list bring the public set
    names = resolve_names(data, with_public=not args.datasets or args.datasets.strip() == "all")
    progress = show_progress(args)
    raw_root = Path(data.raw_root)
    out_root = Path(data.prepared_root)
    # At the door, before anything is generated or prepared: one line each, not one per dataset.
    check_out_root(out_root)
    if not args.synthetic and not raw_root.is_dir():
        raise ConfigError(f"--raw-root {raw_root}: " + ("not a folder" if raw_root.exists() else "no such folder"))
    for name in names:
        split = data.split_files.get(name)
        if split is not None and not Path(split).is_file():
            raise ConfigError(f"--split-file {name}={split}: no such file")
    if args.synthetic:
        raw_root = generate_synthetic(cfg, names, progress, force=args.force)

    cards, failures = {}, []
    # The synthetic world records parser options its layout needs (e.g. how
    # many PRID persons both cameras share); explicit config options win.
    world = synthetic_world(raw_root) if data.layout == "raw" else None
    world_options = world.get("parser_options", {}) if world else {}
    for name in names:
        try:
            parser = create_raw_dataset(
                name,
                raw_root,
                layout=data.layout,
                seed=data.split_seed,
                split_file=data.split_files.get(name),
                **{**world_options.get(name, {}), **data.options.get(name, {})},
            )
            report = prepare_dataset(
                parser,
                out_root,
                resize=data.resize,
                workers=data.workers,
                force=args.force,
                progress=progress,
            )
        # Any input or file error is this dataset's alone: report it, prepare the others, exit 2 at the end.
        except (FedReIDError, OSError, TypeError, ValueError) as exc:
            message = str(exc)
            # Most messages already start with the dataset's name: print it once.
            failures.append(message if message.startswith(f"{name}:") else f"{name}: {message}")
            print(f"[{name}] FAILED", file=sys.stderr)
            continue
        cards[name] = report.card
        print_report(report)

    if cards:
        print("\nDataset card\n")
        print(format_summary(cards))
        write_combined_card(out_root, cards)
    if failures:
        print(f"{len(failures)} dataset(s) failed:", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 2  # a missing or malformed release is an input error, as a bad argument is
    return 0


def write_combined_card(out_root: Path, cards: dict[str, dict]) -> None:
    """``cards.md`` over every dataset prepared in ``out_root``, not only this run's.

    Datasets of earlier runs (with other ``--datasets``) are read back from
    their ``card.json``, so the combined card never loses them.
    """
    found, problems = prepared_cards(out_root)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    merged = {**found, **cards}
    order = list(BENCHMARK_DATASETS) + [PUBLIC_DATASET]
    names = sorted(merged, key=lambda n: (order.index(n) if n in order else len(order), n))
    write_text_atomic(out_root / CARDS_FILE, CARDS_HEADER + format_summary({n: merged[n] for n in names}))
    earlier = len(set(merged) - set(cards))
    if earlier:
        print(f"{out_root / CARDS_FILE} also lists {earlier} dataset(s) prepared by earlier runs")


def print_report(report: PrepareReport) -> None:
    if report.skipped_existing:
        print(f"[{report.name}] already prepared in {report.out_dir} (use --force to redo)")
    else:
        print(
            f"[{report.name}] {report.num_images:,} images -> {report.out_dir} "
            f"({report.seconds:.1f} s)"
        )
    if report.skipped:
        for rule, count, example in summarize_skips(report.skipped):
            print(f"  skipped {count} file(s): {rule} (e.g. {example})")
        print(f"  every skipped file is listed in {report.out_dir / 'skipped.csv'}")
    for note in report.notes:
        print(f"  note: {note}")
    for warning in report.warnings:
        print(f"  warning: {warning}")


def generate_synthetic(cfg, names: list[str], progress: bool, force: bool = False) -> Path:
    from fedreid.data.synthetic import generate_world

    syn = cfg.synthetic
    root = Path(syn.root)
    params = dict(
        id_scale=syn.id_scale,
        min_ids=syn.min_ids,
        images_per_camera=syn.images_per_camera,
        height=syn.height,
        width=syn.width,
        seed=syn.seed,
    )
    world = synthetic_world(root)
    if world is not None and world.get("complete"):
        made = world.get("parameters", {})
        if all(made.get(k) == v for k, v in params.items()) and set(names) <= set(made.get("datasets", [])):
            print(f"synthetic world already in {root}")
            return root
        recorded = {k: made.get(k) for k in params}
        if recorded != params and not force:
            # Its gallery and query images may be in use (the demo's index): never replaced silently.
            raise ConfigError(
                f"the synthetic world in {root} was generated with {_settings(recorded)}, not the asked "
                f"{_settings(params)}; use the same synthetic.* settings, another synthetic.root, or --force "
                "to regenerate it"
            )
    print(f"generating the synthetic world in {root} ...")
    generate_world(root, datasets=names, progress=progress, **params)
    return root


def _settings(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
