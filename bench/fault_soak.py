"""Fault-injection soak: each tool SIGKILLed at seeded random moments, recovered, checked.

The question (issue 13): does a kill at any moment leave every output absent,
previous or complete (never half), no raw or user file changed, and a re-run
(or ``--resume``) that ends exactly where an uninterrupted run ends? Tools:

* ``prepare``: ``tools/prepare_datasets.py``, four synthetic releases, resized copies;
* ``train-reid``: ``tools/train_fed.py``, FedPav + CDW + KD (4 rounds, tiny ResNet, two clients + public set);
* ``train-cls``: ``tools/train_fed.py``, SCAFFOLD + FedFTG on scikit-learn's digits (4 rounds, 4 clients);
* ``index``: ``tools/eval_reid.py index``, a 96-image gallery, into a new folder (even
  points) or over an earlier index of another gallery (odd points);
* ``index-add`` / ``index-remove``: ``index --add`` (a new segment) and ``index --remove``
  (a compaction) on a two-segment store; after a removal's recovery no byte of the erased
  items' vectors or file names may be left in or beside the store.

Per tool: one uninterrupted reference run (its wall time bounds the kill
delays), then ``--points`` kill points, each in a fresh folder with user files
next to the outputs: the delay is drawn uniformly from [0, reference wall
time) by a numpy generator seeded from ``--seed`` and the tool's name; the
tool's process group gets SIGKILL. Then ``--write-points`` more, each killing
the tool right before one of its ``os.replace`` calls (seeded, distinct; all
of them when there are fewer): the commit windows a random time rarely hits.
After each kill what it left is checked and its phase named; the recovery (the same command again, or ``--resume`` for a run folder
holding its config.yaml) must exit 0 and reproduce the reference's outputs
exactly (metrics without times, model and checkpoint tensors, prepared files,
index files). The checks live in ``tests/fault_helpers.py``, shared with
``tests/commands/test_fault_injection.py`` (a few points per tool).

Prints one line per point, then per tool: kill points tried (random times and
write points), killed (the rest finished before their kill time), survived (every check passed), files lost
(input or user files missing or changed; must be 0), hidden temporary files
left after recovery, wall time, and the phases the kills hit. Exits 1 if any
point failed.

    python bench/fault_soak.py [--points 20] [--write-points 10] [--seed 0]
        [--tools prepare,train-reid,train-cls,index] [--workdir DIR] [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# One thread per process (before torch is imported): the tools under test run as subprocesses beside this one.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fault_helpers import SOAK_TOOL_NAMES, FaultHarness, make_tool, summary_row  # noqa: E402

COLUMNS = (
    ("tool", "tool"), ("reference_s", "ref s"), ("random_points", "random points"),
    ("write_points", "write points"), ("killed", "killed"),
    ("finished_first", "finished first"), ("survived", "survived"), ("files_lost", "files lost"),
    ("temp_files_left", "temp files left"), ("wall_s", "wall s"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=20, help="kill points per tool (default 20)")
    parser.add_argument("--write-points", type=int, default=10,
                        help="kills right before a seeded os.replace call, per tool (default 10; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", default=",".join(SOAK_TOOL_NAMES),
                        help="comma-separated, from " + ", ".join(SOAK_TOOL_NAMES))
    parser.add_argument("--workdir", help="keep the work folders here (default: a temporary folder, removed)")
    parser.add_argument("--out", help="write the figures and every point's outcome as JSON here")
    args = parser.parse_args()
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in SOAK_TOOL_NAMES]
    if unknown:
        parser.error(f"unknown tool {unknown[0]!r}; choose from {', '.join(SOAK_TOOL_NAMES)}")
    if args.points < 1 or args.write_points < 0:
        parser.error("--points must be >= 1 and --write-points >= 0")

    import torch

    torch.set_num_threads(1)
    rows, points = [], []
    with tempfile.TemporaryDirectory(prefix="fault-soak-") as tmp:
        base = Path(args.workdir) if args.workdir else Path(tmp)
        for name in tools:
            started = time.perf_counter()
            print(f"== {name}: inputs and the uninterrupted reference run", flush=True)
            harness = FaultHarness(make_tool(name), base / name, seed=args.seed)
            print(f"   reference: {harness.wall:.2f} s, {len(harness.replaces)} os.replace calls; {args.points} "
                  f"kill points in [0, {harness.wall:.2f}) s, {min(args.write_points, len(harness.replaces))} "
                  "write points", flush=True)
            outcomes = harness.run(args.points, args.write_points, log=lambda line: print("   " + line, flush=True))
            rows.append(summary_row(name, outcomes, harness.wall, time.perf_counter() - started))
            points += [{**vars(o), "ok": o.ok} for o in outcomes]

    print(f"\nFault-injection soak, seed {args.seed}: SIGKILL at uniform random times within each tool's "
          "reference wall time, and right before seeded os.replace calls (write points)")
    print("| " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|" + "---|" + "---:|" * (len(COLUMNS) - 1))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    print("\nphases hit:")
    for row in rows:
        print(f"  {row['tool']:10s} " + ", ".join(f"{phase} x{n}" for phase, n in row["phases"].items()))
    failed = [p for p in points if not p["ok"]]
    lost = sum(row["files_lost"] for row in rows)
    print(f"\n{len(points) - len(failed)}/{len(points)} points survived; files lost: {lost}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "tools": rows, "points": points}, indent=1))
    return 1 if failed or lost else 0


if __name__ == "__main__":
    sys.exit(main())
