"""Wall time of a FedAvg+FedFTG round against a FedAvg round with identical settings.

Goal (issue): a FedFTG round <= 1.5 x a FedAvg round at the paper's I=10,
I_g=1, I_d=5 (the FedFTG paper reports about 2 x). Runs ``run_simulation``
twice with the same seed, data, partition and client sampling -- plain FedAvg,
then FedAvg with ``fl.fedftg=true`` (paper defaults, teacher forward "loop"
unless ``--teacher-forward``) -- for ``--warmup`` + ``--rounds`` rounds, and
takes from each round record ``time.round - time.eval`` (sampling, client
training, aggregation, hooks; evaluation only runs after the last round and is
subtracted) and ``time.fedftg`` (the server fine-tuning alone). Warm-up rounds
(first-call allocations) are dropped; medians of the rest are printed. If a
run's client training diverges (NaN), the rounds completed before it are timed
and the divergence is printed.

Setting (defaults): Fashion-MNIST, a seeded stratified 12,000-image training
subset (as ``bench/classification_methods.py``), Dir(0.05) over 20 clients,
10 sampled per round, cnn_lmd, E=1, B=50, SGD lr 0.01 momentum 0.9 wd 1e-5.

How to read it: ``ratio`` = FedFTG round / FedAvg round (goal <= 1.5). The
client-training seconds of both runs are printed too: the clients do the same
work in both, so if these differ the machine's load changed between the runs
and the ratio is off by about as much. The ratio depends on how much client
work a round holds (FedFTG's cost is fixed per round: more data or epochs per
client lower it).

    python bench/fedftg_round.py [--rounds 3] [--warmup 1] [--train-subset 12000] [--local-epochs 1]
                                 [--teacher-forward loop|vmap] [--fedftg-options "{md_divergence: kl}"]
                                 [--threads N] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402
from classification_methods import base_overrides, subset_root  # noqa: E402

from fedreid.config import load_config  # noqa: E402
from fedreid.fl.simulation import run_simulation  # noqa: E402


def timed_rounds(overrides: list[str], run_dir: Path, warmup: int) -> dict[str, Any]:
    history: list[dict[str, Any]] = []
    note = ""
    try:
        run_simulation(load_config(None, overrides), run_dir, progress=False,
                       callbacks=[lambda ev, info: history.append(info["record"]) if ev == "round_end" else None])
    except FloatingPointError as exc:  # times of the completed rounds still count
        note = f"DIVERGED in round {len(history) + 1} ({exc}); timed the completed rounds"
    last = history[-1] if history else {}
    history = history[warmup:] or history
    return {"round": [r["time"]["round"] - r["time"].get("eval", 0.0) for r in history],
            "fit": [sum(c.get("time_fit", 0.0) for c in r["time"]["clients"].values()) for r in history],
            "fedftg": [r["time"].get("fedftg", 0.0) for r in history], "note": note,
            "mode": last.get("fedftg", {}).get("fedftg_teacher_forward", "-"),
            "acc": last.get("eval", {}).get("test", {}).get("accuracy", float("nan"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--train-subset", type=int, default=12000, help="stratified training images (0: all 60k)")
    ap.add_argument("--teacher-forward", choices=("loop", "vmap"), default="loop")
    ap.add_argument("--fedftg-options", default="{}", help="more FedFTG options, a YAML mapping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*", help="extra key.sub=value for both runs")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # classification_methods.base_overrides reads these names
    args.eval_every, args.lr_round_decay = 10**9, 1.0

    with tempfile.TemporaryDirectory(prefix="fedreid-ftg-") as tmp:
        root = subset_root(Path(tmp) / "data", args.train_subset)
        base = [*base_overrides(argparse.Namespace(**{**vars(args), "rounds": args.warmup + args.rounds}), root),
                f"seed={args.seed}", f"classification.split_seed={args.seed}", *args.overrides]
        avg = timed_rounds([*base, "fl.fedftg=false"], Path(tmp) / "fedavg", args.warmup)
        options = {**yaml.safe_load(args.fedftg_options), "teacher_forward": args.teacher_forward}
        ftg = timed_rounds([*base, "fl.fedftg=true", f"fl.fedftg_options={json.dumps(options)}"],
                           Path(tmp) / "fedftg", args.warmup)

    med = statistics.median
    print(f"Fashion-MNIST {args.train_subset or 60000} train images, Dir({args.alpha}) over {args.clients} clients, "
          f"{args.per_round} sampled per round, cnn_lmd, E={args.local_epochs}, B=50; FedFTG I=10 I_g=1 I_d=5 "
          f"(batch 50), teacher forward: {ftg['mode']}, options {options}; {args.warmup} warm-up + {args.rounds} timed rounds; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'run':<15}{'round s (median)':>18}{'client fit s':>14}{'fedftg s':>10}   per-round s")
    for name, r in (("fedavg", avg), ("fedavg+fedftg", ftg)):
        print(f"{name:<15}{med(r['round']):>18.2f}{med(r['fit']):>14.2f}{med(r['fedftg']):>10.2f}   "
              + " ".join(f"{x:.2f}" for x in r["round"]))
    print(f"ratio FedFTG round / FedAvg round: {med(ftg['round']) / med(avg['round']):.2f} (goal <= 1.5; "
          f"paper ~2); client-fit ratio (load drift check, ~1.0 expected): {med(ftg['fit']) / med(avg['fit']):.2f}")
    for name, r in (("fedavg", avg), ("fedavg+fedftg", ftg)):
        if r["note"]:
            print(f"{name}: {r['note']}")
    print(f"test accuracy after the last round: fedavg {100 * avg['acc']:.2f}%, fedavg+fedftg {100 * ftg['acc']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
