"""Federated training of a ReID model (FedPav, CDW, public-set KD, local baseline).

Examples:
  # the demo: small backbone on the synthetic benchmark, a few minutes on 2 CPU cores
  python tools/train_fed.py --config configs/fedreid/demo_synthetic.yaml

  # the paper's benchmark setting (ResNet-50, 9 clients, 300 rounds; GPU)
  python tools/train_fed.py --config configs/fedreid/fedpav.yaml run.out_dir=runs/fedpav

  # continue a run that was stopped, from its last complete round
  python tools/train_fed.py --resume runs/fedpav

A run folder holds config.yaml, checkpoint.pt (full state, written atomically
every round), metrics.jsonl / metrics.csv, log.txt (everything printed, under
a header of versions, git commit and command line), model_final.pt and report.md with
the paper's reporting convention and PNG curves. --out must be a new or empty
folder or a run folder; a folder of other files is refused untouched.
Overrides may stand anywhere among the options (fl.rounds=1 --no-progress seed=2).

A resume refuses prepared data whose manifest changed since the checkpoint
(rows, not image bytes, are fingerprinted), and warns
when the torch thread count differs (the numbers then differ from an
uninterrupted run's).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedreid.config import ConfigError, load_config
from fedreid.eval.report import (
    classification_summary,
    format_classification_summary,
    format_paper_summary,
    is_classification,
    paper_summary,
    write_report,
)
from fedreid.utils.cli import add_config_arguments, checked_overrides, literal_override, run_main, show_progress
from fedreid.utils.run_log import LOG_FILE, OutputLog, log_header


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_arguments(parser)
    parser.add_argument("--out", metavar="RUN_DIR", help="run folder (run.out_dir)")
    parser.add_argument("--rounds", type=int, help="number of rounds (fl.rounds)")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint (its saved config is used; only what leaves "
        "the training unchanged may be overridden: fl.rounds, run.*, eval.batch_size, eval.workers, "
        "eval.before_hooks, train.persistent_workers, and a relative data path given absolute)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def round_line(record: dict[str, Any], total_rounds: int) -> str:
    """``round 3/6  loss 2.663  mean Rank-1 45.1%  mAP 50.2%  36.0 s`` (metrics only on evaluated rounds)."""
    parts = [f"round {record['round']}/{total_rounds}", f"loss {record.get('train_loss', float('nan')):.3f}"]
    evaluated = record.get("eval") or {}
    if "accuracy" in evaluated.get("test", {}):
        parts.append(f"accuracy {100 * evaluated['test']['accuracy']:.1f}%")
    elif evaluated:
        for key, label in (("rank1", "mean Rank-1"), ("mAP", "mAP")):
            parts.append(f"{label} {100 * sum(ev[key] for ev in evaluated.values()) / len(evaluated):.1f}%")
    seconds = record.get("time", {}).get("round")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return "  ".join(parts)


def _round_printer(total_rounds: int):
    def on_event(event: str, info: dict[str, Any]) -> None:
        if event == "round_end":
            print(round_line(info["record"], total_rounds), flush=True)

    return on_event


def main(argv: list[str] | None = None) -> int:
    from fedreid.fl.simulation import run_simulation

    args = build_parser().parse_args(argv)
    flags = []
    if args.rounds is not None:
        flags.append(f"fl.rounds={args.rounds}")
    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ConfigError("--resume uses the run's own config.yaml; pass overrides only")
        # A resumed run stays in its folder; its config.yaml must not name another.
        moved = [item for item in args.overrides if item.partition("=")[0].strip() in ("run", "run.out_dir")]
        if args.out or moved:
            raise ConfigError(f"{'--out' if args.out else repr(moved[0])} does not go with --resume: the run "
                              f"continues in its own folder {run_dir} (copy the folder first to continue elsewhere)")
        # The run's saved config, with the few changes a resume allows
        # (run_simulation refuses the others).
        cfg = load_config(run_dir / "config.yaml", checked_overrides(args, flags))
        resume = True
    else:
        if args.out:
            flags.append(literal_override("run.out_dir", args.out))  # a path: taken literally
        cfg = load_config(args.config, checked_overrides(args, flags))
        run_dir = Path(cfg.run.out_dir)
        resume = False
    progress = show_progress(args)
    log = OutputLog()  # run_dir/log.txt from the moment the run owns the folder

    def on_event(event: str, info: dict[str, Any]) -> None:
        if event == "run_start":
            log.start(Path(info["run_dir"]) / LOG_FILE, log_header(device=info["device"]))
        elif event == "round_end":
            trained.append(info["record"]["round"])

    trained: list[int] = []
    # Without bars (a log file, CI, --no-progress) one line per round says how it goes.
    callbacks = ([] if progress else [_round_printer(cfg.fl.rounds)]) + [on_event]
    with log:
        history = run_simulation(cfg, run_dir, resume=resume, progress=progress, callbacks=callbacks,
                                 tool="train_fed")
        if resume and not trained:
            print(f"{run_dir} had already finished its {cfg.fl.rounds} rounds: nothing trained "
                  f"(fl.rounds=N with N > {cfg.fl.rounds} trains further); its summary:")
        return _summarise(run_dir, history, cfg)


def _summarise(run_dir: Path, history: list[dict[str, Any]], cfg: Any) -> int:
    report = write_report(run_dir, history, targets=cfg.classification.target_accuracies)
    if is_classification(history):
        print("\n" + format_classification_summary(
            classification_summary(history, cfg.classification.target_accuracies)))
        print(f"report: {report}")
        return 0
    summary = paper_summary(history)
    if summary["datasets"]:
        print("\n" + format_paper_summary(summary))
    print(f"report: {report}")
    return 0


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
