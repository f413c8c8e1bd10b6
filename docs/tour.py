"""Run the README's tour and write what it printed into the docs; or measure the demo's spread.

The README's tour and the pages it links show real output. This script runs
the tour's commands in a scratch folder (never the checkout's datasets/ or
runs/) and replaces each block between ``<!-- tour:NAME head=H tail=T -->``
and ``<!-- /tour:NAME -->`` in the files given with the command and what it
printed: its first H and last T lines, ``...`` between (no ``head``/``tail``:
all of it). NAME is one of the steps below; each runs once, whatever number
of blocks show it:

    python docs/tour.py --write README.md docs/*.md   # about 5 minutes on 2 CPU cores

``--spread`` trains the demo instead under several seeds and torch thread
counts and prints the best-3 mean Rank-1 and mAP of each run with their
mean and standard deviation, the figures the README quotes beside the demo:

    python docs/tour.py --spread --seeds 0,1,2 --threads 2
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = "configs/fedreid/demo_synthetic.yaml"
QUERY = "datasets/raw/synthetic/Market-1501-v15.09.15/query/0011_c1s1_958074_02.jpg"
GALLERY = "datasets/raw/synthetic/Market-1501-v15.09.15/bounding_box_test"


#: The tour's steps in the order they run: name -> the tool command.
STEPS: dict[str, list[str]] = {
    "prepare": ["tools/prepare_datasets.py", "--config", DEMO, "--synthetic", "--no-progress"],
    "train": ["tools/train_fed.py", "--config", DEMO, "--out", "runs/demo", "--no-progress"],
    "evaluate": ["tools/eval_reid.py", "evaluate", "--model", "runs/demo"],
    "index": ["tools/eval_reid.py", "index", "--model", "runs/demo", "--gallery", GALLERY,
              "--index", "runs/demo/index", "--site", "lobby", "--verify"],
    "query": ["tools/eval_reid.py", "query", "--model", "runs/demo", "--index", "runs/demo/index",
              "--images", QUERY, "--top-k", "5", "--out", "runs/demo/query_pictures"],
}
BLOCK = re.compile(r"<!-- tour:(?P<name>[a-z]+)(?P<opts>(?: \w+=\d+)*) -->\n```\n.*?```\n<!-- /tour:(?P=name) -->", re.S)


def scratch(tmp: str) -> Path:
    """A scratch working folder that sees the checkout's configs/ (the commands name them relatively)."""
    folder = Path(tmp)
    (folder / "configs").symlink_to(REPO / "configs")
    return folder


def run(command: list[str], cwd: Path, threads: int | None = None) -> str:
    """One tool run in ``cwd``; its stdout (a failure raises with its stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_ALBUMENTATIONS_UPDATE="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op thread count
    tool = [sys.executable, str(REPO / command[0]), *command[1:]]
    done = subprocess.run(tool, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def shown(command: list[str]) -> str:
    """The command as the README shows it: ``$ python tools/x.py ...``, wrapped before options."""
    words = ["python", *command]
    words = [w for w in words if w != "--no-progress"]
    line, lines = "$", []
    for word in words:
        piece = shlex.quote(word)
        if len(line) + len(piece) > 88 and word.startswith("--"):
            lines.append(line + " \\")
            line = "     "
        line += " " + piece
    return "\n".join([*lines, line])


def shorten(text: str, head: int, tail: int) -> str:
    """The first ``head`` and last ``tail`` lines (``...`` between); gallery paths cut to their folder."""
    lines = [re.sub(r"\S*/(bounding_box_test/)", r".../\1", ln) for ln in text.rstrip("\n").splitlines()]
    if head + tail >= len(lines):
        return "\n".join(lines)
    kept = lines[:head] + ["..."] + (lines[-tail:] if tail else [])
    return "\n".join(kept)


def fill_blocks(text: str, outputs: dict[str, str]) -> str:
    """``text`` with every tour block holding its step's command and (shortened) output."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in outputs:
            raise SystemExit(f"unknown tour step {name!r} in a block; steps: {', '.join(STEPS)}")
        opts = dict(o.split("=") for o in m.group("opts").split())
        out = outputs[name]
        body = shorten(out, int(opts.get("head", 10**6)), int(opts.get("tail", 0)))
        return (f"<!-- tour:{name}{m.group('opts')} -->\n```\n{shown(STEPS[name])}\n{body}\n```\n"
                f"<!-- /tour:{name} -->")
    return BLOCK.sub(fill, text)


def write_tour(paths: list[Path]) -> None:
    pages = [p for p in paths if BLOCK.search(p.read_text())]  # the pages that show the tour
    if not pages:
        raise SystemExit(f"none of {', '.join(map(str, paths))} has a <!-- tour:NAME --> block")
    outputs = {}
    with tempfile.TemporaryDirectory(prefix="fedreid-tour-") as tmp:
        work = scratch(tmp)
        for name, command in STEPS.items():
            outputs[name] = run(command, work)
            print(f"== {name}\n{outputs[name]}", flush=True)
    for p in pages:  # read again: the pages may have been edited while the tour ran
        p.write_text(fill_blocks(p.read_text(), outputs))
        print(f"wrote {p}")


def best3(stdout: str) -> tuple[float, float]:
    """The ``| **mean** |`` row's Rank-1 and mAP of train_fed's summary."""
    row = next(ln for ln in stdout.splitlines() if ln.startswith("| **mean** |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return float(cells[1]), float(cells[4])


def spread(seeds: list[int], threads: list[int]) -> None:
    with tempfile.TemporaryDirectory(prefix="fedreid-spread-") as tmp:
        work = scratch(tmp)
        run(["tools/prepare_datasets.py", "--config", DEMO, "--synthetic", "--no-progress"], work)
        rows = []
        for t in threads:
            for seed in seeds:
                out = run(["tools/train_fed.py", "--config", DEMO, "--out", f"runs/s{seed}-t{t}", "--no-progress",
                           f"seed={seed}"], work, threads=t)
                r1, m_ap = best3(out)
                rows.append((seed, t, r1, m_ap))
                print(f"seed {seed}  threads {t}  best-3 mean Rank-1 {r1:.1f}  mAP {m_ap:.1f}", flush=True)
    if len(rows) < 2:
        return  # one run has no spread: its line above is the figure
    for label, pick in (("Rank-1", 2), ("mAP", 3)):
        values = [r[pick] for r in rows]
        print(f"{label}: mean {statistics.mean(values):.1f}, std {statistics.stdev(values):.1f}, "
              f"min {min(values):.1f}, max {max(values):.1f} over {len(values)} runs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", nargs="+", metavar="FILE", help="run the tour and rewrite these files' tour blocks")
    ap.add_argument("--spread", action="store_true", help="train the demo under --seeds x --threads")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds of --spread (default 0,1,2)")
    ap.add_argument("--threads", default="2", help="torch thread counts of --spread (default 2)")
    args = ap.parse_args(argv)
    if args.spread:
        spread([int(s) for s in args.seeds.split(",")], [int(t) for t in args.threads.split(",")])
    elif args.write:
        write_tour([Path(p) for p in args.write])
    else:
        ap.error("give --write FILE... or --spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
