"""Final test accuracy of FedAvg-family client objectives (and FedFTG) on label-skewed Fashion-MNIST.

Runs ``run_simulation`` (``task: classification``) once per (method, seed) on
Fashion-MNIST split over ``--clients`` clients by ``partition=dirichlet``
(NIID-Bench's per-class Dir(alpha), ``min_size`` 10), ``--per-round`` clients
sampled per round, the FedLMD paper's CNN (``cnn_lmd``) and the FedLMD official
client optimiser (github.com/wnma3mz/FedLMD ``src/config/fedlmd.json``: B=50,
SGD lr 0.01, momentum 0.9 (no Nesterov), weight decay 1e-5, lr x 0.99 per
round). Methods: ``fedavg``, ``fedntd``, ``fedlmd``, ``fedlmd_tf`` (client
objectives with their default options) and ``<objective>+fedftg``
(``fl.fedftg=true`` with the paper's I=10, I_g=1, I_d=5), or
``<objective>+fedftg:<md_divergence>`` (e.g. ``fedavg+fedftg:kl_teacher_first``,
the official code's KL direction for the global model's ``L_md``).
A run whose client training diverges (NaN loss) is reported as
"div@round r" and left out of the means (the count of runs kept is shown).

The training split is a seeded, class-stratified subset of ``--train-subset``
images (CPU budget), written as IDX files to a temporary folder that
``classification.root`` points at (the real loader reads it; the 10k test set
is the official one, linked from Debian's folder). The subset is the same for
every seed; a seed sets ``seed`` and ``classification.split_seed`` (model
init, partition, client sampling, loaders).

How to read it: per method, the mean +- std (population std over seeds) of the
accuracy after the last round ("final") and of the best evaluated accuracy
("best", evaluated every ``--eval-every`` rounds and after the last), the
mean wall seconds per round (training, aggregation, hooks and any evaluation
in it), then each seed's final accuracy. One machine, one run per seed: small
differences between methods are within noise at these budgets.

The defaults are the run behind the README's table (20 rounds, seeds 0-2,
the six methods below).

    python bench/classification_methods.py [--rounds 20] [--train-subset 12000] [--seeds 0,1,2]
        [--methods fedavg,fedntd,fedlmd,fedlmd_tf,fedavg+fedftg,fedavg+fedftg:kl_teacher_first]
        [--out results.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedreid.config import load_config  # noqa: E402
from fedreid.data.classification import FASHION_MNIST_DEBIAN_DIR, load_fashion_mnist  # noqa: E402
from fedreid.fl.simulation import run_simulation  # noqa: E402


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (magic 0x08nn, big-endian dims, raw bytes)."""
    data = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack(f">I{data.ndim}I", 0x0800 | data.ndim, *data.shape))
        f.write(data.tobytes())


def subset_root(folder: Path, size: int, seed: int = 0, source: Path = FASHION_MNIST_DEBIAN_DIR) -> Path:
    """``folder`` with a stratified ``size``-image Fashion-MNIST train split and the full test split.

    Each class keeps ``round(size * n_c / N)`` images drawn with
    ``default_rng(seed)``, in dataset order; ``size=0`` returns ``source``.
    """
    if size <= 0:
        return source
    train = load_fashion_mnist(source, "train")
    rng = np.random.default_rng(seed)
    keep = [rng.permutation(np.flatnonzero(train.labels == c))[: round(size * np.mean(train.labels == c))]
            for c in range(train.num_classes)]
    idx = np.sort(np.concatenate(keep))
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte", train.images[idx])
    write_idx(folder / "train-labels-idx1-ubyte", train.labels[idx])
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        os.symlink(source / name, folder / name)
    return folder


def method_overrides(method: str) -> list[str]:
    """``fedavg`` / ``fedntd`` / ... or ``<objective>+fedftg[:<md_divergence>]`` as config overrides."""
    objective, _, hook = method.partition("+")
    hook, _, divergence = hook.partition(":")
    if hook not in ("", "fedftg"):
        raise SystemExit(f"unknown server hook {hook!r} in method {method!r} (only +fedftg)")
    extra = [f"fl.fedftg_options={{md_divergence: {divergence}}}"] if divergence else []
    return [f"train.objective={objective}", f"fl.fedftg={'true' if hook else 'false'}", *extra]


def base_overrides(args: argparse.Namespace, root: Path) -> list[str]:
    return [
        "task=classification", "classification.dataset=fashion_mnist", f"classification.root={root}",
        "classification.partition=dirichlet", f"classification.num_clients={args.clients}",
        f"classification.alpha={args.alpha}", f"classification.min_size={args.min_size}",
        "model.backbone=cnn_lmd", "fl.aggregation=fedavg", f"fl.rounds={args.rounds}",
        f"fl.clients_per_round={args.per_round}", f"train.local_epochs={args.local_epochs}",
        "train.batch_size=50", "train.lr=0.01", "train.momentum=0.9", "train.nesterov=false",
        "train.weight_decay=0.00001", "train.drop_last=false", f"eval.every={args.eval_every}",
        "eval.batch_size=500", "run.device=cpu", "run.tensorboard=false",
        *([f"train.lr_round_decay={args.lr_round_decay}"] if args.lr_round_decay != 1 else []),
    ]


def one_run(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One simulation; a run whose client training diverges (NaN loss) is kept with ``diverged`` set."""
    cfg = load_config(None, overrides)
    history: list[dict[str, Any]] = []
    diverged = None
    t0 = time.perf_counter()
    try:
        run_simulation(cfg, run_dir, progress=False,
                       callbacks=[lambda ev, info: history.append(info["record"]) if ev == "round_end" else None])
    except FloatingPointError as exc:
        diverged = f"round {len(history) + 1}: {exc}"
    wall = time.perf_counter() - t0
    accs = [(r["round"], r["eval"]["test"]["accuracy"]) for r in history if r.get("eval")]
    return {"final": accs[-1][1] if accs and not diverged else float("nan"),
            "best": max((a for _, a in accs), default=float("nan")), "curve": accs, "wall_s": wall,
            "diverged": diverged, "round_s": statistics.mean(r["time"]["round"] for r in history) if history else 0.0,
            "fedftg_s": statistics.mean(r["time"].get("fedftg", 0.0) for r in history) if history else 0.0}


def mean_std(xs: list[float]) -> str:
    ok = [x for x in xs if x == x]  # NaN: a diverged run
    if not ok:
        return "diverged"
    tail = "" if len(ok) == len(xs) else f" ({len(ok)}/{len(xs)} runs)"
    return f"{100 * statistics.mean(ok):5.2f} ± {100 * statistics.pstdev(ok):4.2f}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds (20: the README table's run)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10, help="clients sampled per round (0: all)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods",
                    default="fedavg,fedntd,fedlmd,fedlmd_tf,fedavg+fedftg,fedavg+fedftg:kl_teacher_first")
    ap.add_argument("--local-epochs", type=int, default=1,
                    help="E (FedLMD's code: 5; 1 fits a 2-core CPU budget, and non-IID drift grows with E)")
    ap.add_argument("--lr-round-decay", type=float, default=0.99, help="FedLMD's per-round lr decay (1: off)")
    ap.add_argument("--train-subset", type=int, default=12000, help="stratified training images (0: all 60k)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("overrides", nargs="*", help="extra key.sub=value for every run")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in methods}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedreid-cls-") as tmp:
        root = subset_root(Path(tmp) / "data", args.train_subset)
        base = base_overrides(args, root)
        for seed in seeds:
            for method in methods:
                ov = [*base, f"seed={seed}", f"classification.split_seed={seed}", *method_overrides(method),
                      *args.overrides]
                res = one_run(ov, Path(tmp) / f"{method}-{seed}")
                results[method][seed] = res
                print(f"  {method:<14} seed {seed}: final {100 * res['final']:.2f}  best {100 * res['best']:.2f}"
                      f"  {res['round_s']:.2f} s/round  ({res['wall_s']:.0f} s)"
                      + (f"  DIVERGED in {res['diverged']}" if res["diverged"] else ""), flush=True)
    total = time.perf_counter() - started

    print(f"\nFashion-MNIST, {args.train_subset or 60000} train images (stratified subset), 10k test; "
          f"Dir(alpha={args.alpha}) over {args.clients} clients (min_size {args.min_size}), "
          f"{args.per_round or args.clients} of {args.clients} sampled per round, {args.rounds} rounds, "
          f"E={args.local_epochs}, cnn_lmd, B=50, SGD lr 0.01 (x{args.lr_round_decay}/round) momentum 0.9 "
          f"wd 1e-5; seeds {seeds}; eval every {args.eval_every} rounds; torch threads {torch.get_num_threads()}")
    if args.overrides:
        print(f"extra overrides: {' '.join(args.overrides)}")
    w = max([15, *(len(m) + 1 for m in methods)])
    print(f"{'method':<{w}}| {'final acc % (mean ± std)':>25} | {'best acc % (mean ± std)':>24} | {'s/round':>8} "
          f"| per-seed final acc %")
    for method in methods:
        runs = [results[method][s] for s in seeds]
        per_seed = "  ".join(f"{100 * r['final']:.2f}" if not r["diverged"] else f"div@{r['diverged'].split(':')[0]}"
                             for r in runs)
        print(f"{method:<{w}}| {mean_std([r['final'] for r in runs]):>25} | {mean_std([r['best'] for r in runs]):>24} "
              f"| {statistics.mean(r['round_s'] for r in runs):8.2f} | {per_seed}")
    print(f"total wall time {total:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results, "total_s": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
