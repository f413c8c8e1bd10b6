"""Wall time of a FedAvg+FedFTG round against a FedAvg round with identical settings.

Goal (issue): a FedFTG round <= 1.5 x a FedAvg round at the paper's I=10,
I_g=1, I_d=5 (the FedFTG paper reports about 2 x). For each setting, runs
``run_simulation`` twice with the same seed, data, partition and client
sampling -- plain FedAvg, then FedAvg with ``fl.fedftg=true`` (paper defaults,
teacher forward "loop" unless ``--teacher-forward``) -- for ``--warmup`` +
``--rounds`` rounds, and takes from each round record ``time.round -
time.eval`` (sampling, client training, aggregation, hooks; evaluation only
runs after the last round and is subtracted) and ``time.fedftg`` (the server
fine-tuning alone). Warm-up rounds (first-call allocations) are dropped;
medians of the rest are printed. If a run's client training diverges (NaN),
the rounds completed before it are timed and the divergence is printed.

Settings (``--setting``, several comma-separated; each can be adjusted with the flags below):

* ``small`` (default): Fashion-MNIST, a seeded stratified 12,000-image training
  subset (as ``bench/classification_methods.py``), Dir(0.05) per class over
  20 clients, 10 sampled per round, E=1 -- the README's accuracy benchmark;
  FedFTG with ``md_divergence: kl_teacher_first`` (same cost; the default
  reverse KL diverges within a few rounds at this skew, leaving none to time).
* ``paper``: the FedFTG paper's client setting (Table 1: 100 clients, 10%
  per round, E=5, B=50, client-prior Dirichlet beta=0.3) on the full 60k
  Fashion-MNIST (600 images per client; the paper's CIFAR-10 has 500).

Both: cnn_lmd, B=50, SGD lr 0.01 momentum 0.9 wd 1e-5 (the client optimiser
changes the client time little). FedFTG's synthetic batch is B=50 (the
paper's code: the clients' batch size).

How to read it: ``ratio`` = median FedFTG round / median FedAvg round (goal
<= 1.5). The two runs happen one after the other; on a machine shared with
other work the load can change between them, so two checks are printed:
the client-fit ratio (the clients do the same work in both runs, ~1.0
expected; if it is off, the round ratio is off by about as much), and the
*in-run* ratio ``round / (round - fedftg)`` of the FedFTG run alone (FedFTG's
round minus its server fine-tuning is the FedAvg round under the same load).
FedFTG's server work is fixed per round (K=10 teachers, I=10 iterations), so
the ratio falls as a round's client work grows.

    python bench/fedftg_round.py [--setting small,paper] [--rounds 3] [--warmup 1] [--threads N]
        [--clients N] [--per-round N] [--local-epochs E] [--train-subset N] [--partition P] [--alpha A]
        [--teacher-forward loop|vmap] [--fedftg-options "{md_divergence: kl}"] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402
from classification_methods import base_overrides, subset_root  # noqa: E402

from fedreid.config import load_config  # noqa: E402
from fedreid.fl.simulation import run_simulation  # noqa: E402

#: Per-setting defaults of the flags (a flag given on the command line wins).
SETTINGS: dict[str, dict[str, Any]] = {
    "small": {"clients": 20, "per_round": 10, "local_epochs": 1, "train_subset": 12000,
              "partition": "dirichlet", "alpha": 0.05},
    "paper": {"clients": 100, "per_round": 10, "local_epochs": 5, "train_subset": 0,
              "partition": "dirichlet_prior", "alpha": 0.3},
}
#: Per-setting FedFTG options under ``--fedftg-options``. At Dir(0.05) the
#: default reverse KL of Eq. 3-4 blows the global model up within a few rounds
#: (see the README's accuracy benchmark), which would leave no rounds to time;
#: the teacher-first direction costs the same.
SETTING_FEDFTG: dict[str, dict[str, Any]] = {
    "small": {"md_divergence": "kl_teacher_first"},
    "paper": {},
}


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


def run_setting(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Both runs of one setting; returns the timings and the printed description."""
    values = {**SETTINGS[name], **{k: v for k, v in vars(args).items() if k in SETTINGS[name] and v is not None}}
    ns = argparse.Namespace(**{**vars(args), **values, "rounds": args.warmup + args.rounds,
                               "eval_every": 10**9, "lr_round_decay": 1.0})
    root = subset_root(tmp / f"data-{name}", values["train_subset"])
    base = [*base_overrides(ns, root), f"classification.partition={values['partition']}",
            f"seed={args.seed}", f"classification.split_seed={args.seed}", *args.overrides]
    t0 = time.perf_counter()
    avg = timed_rounds([*base, "fl.fedftg=false"], tmp / f"{name}-fedavg", args.warmup)
    options = {**SETTING_FEDFTG[name], **(yaml.safe_load(args.fedftg_options) or {}),
               "teacher_forward": args.teacher_forward}
    ftg = timed_rounds([*base, "fl.fedftg=true", f"fl.fedftg_options={json.dumps(options)}"],
                       tmp / f"{name}-fedftg", args.warmup)
    label = (f"[{name}] Fashion-MNIST {values['train_subset'] or 60000} train images, {values['partition']}"
             f"({values['alpha']}) over {values['clients']} clients, {values['per_round']} sampled per round, "
             f"cnn_lmd, E={values['local_epochs']}, B=50; FedFTG I=10 I_g=1 I_d=5 (batch 50), teacher forward "
             f"{ftg['mode']}, options {options}; {args.warmup} warm-up + {args.rounds} timed rounds; "
             f"torch threads {torch.get_num_threads()}; {time.perf_counter() - t0:.0f} s")
    return {"label": label, "fedavg": avg, "fedftg": ftg}


def report(res: dict[str, Any]) -> dict[str, float]:
    med = statistics.median
    avg, ftg = res["fedavg"], res["fedftg"]
    print(res["label"])
    print(f"{'run':<15}{'round s (median)':>18}{'client fit s':>14}{'fedftg s':>10}   per-round s")
    for name, r in (("fedavg", avg), ("fedavg+fedftg", ftg)):
        print(f"{name:<15}{med(r['round']):>18.2f}{med(r['fit']):>14.2f}{med(r['fedftg']):>10.2f}   "
              + " ".join(f"{x:.2f}" for x in r["round"]))
    ratio = med(ftg["round"]) / med(avg["round"])
    fit_ratio = med(ftg["fit"]) / med(avg["fit"])
    in_run = med([r / (r - f) for r, f in zip(ftg["round"], ftg["fedftg"]) if r > f])
    print(f"ratio FedFTG round / FedAvg round: {ratio:.2f} (goal <= 1.5; paper ~2); client-fit ratio "
          f"(load drift check, ~1.0 expected): {fit_ratio:.2f}; in-run ratio round / (round - fedftg): "
          f"{in_run:.2f}")
    for name, r in (("fedavg", avg), ("fedavg+fedftg", ftg)):
        if r["note"]:
            print(f"{name}: {r['note']}")
    print(f"test accuracy after the last round: fedavg {100 * avg['acc']:.2f}%, "
          f"fedavg+fedftg {100 * ftg['acc']:.2f}%\n")
    return {"ratio": ratio, "fit_ratio": fit_ratio, "in_run_ratio": in_run}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="small",
                    help=f"comma-separated settings among {', '.join(SETTINGS)} (see the module docstring)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--clients", type=int, help="clients (setting's default)")
    ap.add_argument("--per-round", type=int, help="clients sampled per round (setting's default)")
    ap.add_argument("--partition", choices=("iid", "dirichlet", "dirichlet_prior", "shards"),
                    help="partitioner (setting's default)")
    ap.add_argument("--alpha", type=float, help="Dirichlet concentration (setting's default)")
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, help="E (setting's default)")
    ap.add_argument("--train-subset", type=int, help="stratified training images, 0: all 60k (setting's default)")
    ap.add_argument("--teacher-forward", choices=("loop", "vmap"), default="loop")
    ap.add_argument("--fedftg-options", default="{}", help="more FedFTG options, a YAML mapping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*", help="extra key.sub=value for every run")
    args = ap.parse_args(argv)
    names = [s for s in args.setting.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown or not names:
        ap.error(f"--setting: unknown {', '.join(unknown) or '(none)'}; choose among {', '.join(SETTINGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedreid-ftg-") as tmp:
        for name in names:
            results[name] = run_setting(name, args, Path(tmp))
    summary = {name: report(res) for name, res in results.items()}
    if len(summary) > 1:
        print("summary: " + "; ".join(f"{n}: ratio {s['ratio']:.2f} (in-run {s['in_run_ratio']:.2f})"
                                      for n, s in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
