"""Fault injection: kill a tool with SIGKILL at a seeded random moment, recover, check the invariants.

Shared by ``tests/commands/test_fault_injection.py`` (a few kill points per tool) and
``bench/fault_soak.py`` (the seeded soak, >= 20 points per tool). Four tools:

``prepare``    ``tools/prepare_datasets.py`` on a synthetic raw world (four releases, resized copies)
``train-reid`` ``tools/train_fed.py``: FedPav + CDW + KD on two tiny prepared datasets and a public set
``train-cls``  ``tools/train_fed.py``: SCAFFOLD + FedFTG on scikit-learn's digits
``index``      ``tools/eval_reid.py index``: a gallery folder into a FAISS index folder, fresh
               (even points) or over an earlier index of another gallery (odd points)

A :class:`FaultHarness` builds the tool's inputs once (the "raw" side: every
file there is hashed and must never change), runs the tool once without
interruption (the reference: its wall time and its outputs' fingerprint), then
for each kill point, in a fresh folder holding a few user files next to where
the outputs go:

1. starts the tool (its own session) and SIGKILLs its process group after a
   delay drawn uniformly from ``[0, reference wall time)`` by a seeded numpy
   generator; a run that ends first counts as "finished";
2. checks what the kill left: every output absent, previous or complete, never
   half (a prepared dataset folder absent or equal to the reference's, a run
   folder's checkpoint loadable and its history a prefix of the reference's, an
   index folder absent, the previous one or the new one), and names the phase
   the kill hit;
3. recovers as a user would (``--resume`` when the run folder has its
   config.yaml, else the same command again) and checks that the outputs now
   equal the reference's exactly (metrics without wall-clock times, model and
   checkpoint tensors, prepared files, index files) and that no input or user
   file changed.

Besides wall-clock kill points, *write points* kill the tool right before its
n-th ``os.replace`` (every commit of a file or folder in fedreid goes through
it: atomic files, the prepared-dataset and index folder swaps): the windows a
random moment rarely hits. This module, run as a script, is that wrapper::

    python tests/fault_helpers.py --kill-before-replace N [--replace-log FILE] -- tools/x.py ARGS...

Subprocesses run with one OpenMP thread (the machines this runs on are small
and shared).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TOOLS = REPO / "tools"
COMMANDS = REPO / "fedreid" / "commands"
PYTHON = sys.executable
#: A hard limit for one uninterrupted tool run (a hang is a failure, not a wait).
RUN_TIMEOUT_S = 600
#: Files fedreid writes to mark folders as its own; their content is not compared with the reference's.
MARKER_PREFIX = ".fedreid-"


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[key] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# ---------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------


def file_sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_hashes(root: Path, skip: Callable[[Path], bool] = lambda rel: False) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (links are recorded, not followed)."""
    root = Path(root)
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if skip(rel):
            continue
        if path.is_symlink():
            out[str(rel)] = "link:" + os.readlink(path)
        elif path.is_file():
            out[str(rel)] = file_sha(path)
    return out


def compare_hashes(before: dict[str, str], after: dict[str, str], where: str) -> tuple[int, list[str]]:
    """(files lost or changed, problems) between two :func:`tree_hashes` of protected files."""
    missing = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    added = sorted(set(after) - set(before))
    problems = [f"{where}: {len(missing)} file(s) lost, e.g. {missing[0]}"] if missing else []
    if changed:
        problems.append(f"{where}: {len(changed)} file(s) changed, e.g. {changed[0]}")
    if added:
        problems.append(f"{where}: {len(added)} file(s) appeared, e.g. {added[0]}")
    return len(missing) + len(changed), problems


def payload_digest(obj: Any) -> str:
    """sha256 of a loaded torch payload: dict keys, tensor dtypes, shapes and bytes, other values' repr.

    A saved file's bytes are not comparable between runs (torch.save names the
    archive after the temporary file it writes), its contents are.
    """
    import torch

    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for key in sorted(x, key=str):
                h.update(repr(key).encode())
                feed(x[key])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for item in x:
                feed(item)
            h.update(b"]")
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()


def without_time(records: Sequence[dict]) -> list[dict]:
    """Round records without their wall-clock entries (the only field that differs between reruns)."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


# ---------------------------------------------------------------------------
# Running and killing
# ---------------------------------------------------------------------------


@dataclass
class RunResult:
    returncode: int
    killed: bool
    seconds: float
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def run_tool(argv: Sequence[str], cwd: Path, log: Path, kill_after: Optional[float] = None) -> RunResult:
    """Run ``argv`` in its own session; SIGKILL its process group after ``kill_after`` seconds.

    ``killed`` is True when the signal ended it (it may also have finished
    first: then ``killed`` is False and the return code is its own).
    """
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S if kill_after is None else kill_after)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    seconds = time.perf_counter() - started
    return RunResult(rc, rc == -signal.SIGKILL, seconds, log)


def hooked(argv: Sequence[str], before_replace: int, replace_log: Optional[Path] = None) -> list[str]:
    """``argv`` (``[python, tool, args...]``) run under this module's wrapper: SIGKILL before the n-th os.replace."""
    out = [argv[0], str(Path(__file__).resolve()), "--kill-before-replace", str(before_replace)]
    if replace_log is not None:
        out += ["--replace-log", str(replace_log)]
    return out + ["--", *argv[1:]]


def _run_hooked(args: Sequence[str]) -> None:
    """The wrapper: count os.replace calls (logging their targets), SIGKILL this process before the n-th."""
    import runpy
    import threading

    args = list(args)
    split = args.index("--")
    options, argv = args[:split], args[split + 1:]
    nth = int(options[options.index("--kill-before-replace") + 1])
    log = options[options.index("--replace-log") + 1] if "--replace-log" in options else None
    real_replace, lock, count = os.replace, threading.Lock(), [0]

    def replace(src, dst, *a, **k):
        with lock:
            count[0] += 1
            if log is not None:
                with open(log, "a") as fh:
                    fh.write(f"{count[0]}\t{dst}\n")
            if count[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *a, **k)

    os.replace = replace
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


def load_tool(name: str):
    """The tool ``<name>`` (``fedreid/commands/<name>.py``) as a module (its ``main(argv)`` runs it in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"fault_{name}_tool", COMMANDS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one kill point did."""

    tool: str
    point: int
    delay: float  # the seconds it was given (a write point: the seconds it lived)
    where: str = ""  # "random time" or "before os.replace #n (target)"
    killed: bool = False
    phase: str = ""
    recovery: str = "none"  # none (finished), rerun, resume
    problems: list[str] = field(default_factory=list)
    files_lost: int = 0
    leftovers: list[str] = field(default_factory=list)  # hidden temporaries a kill left that the recovery kept
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        state = "killed" if self.killed else "not killed"
        where = f", {self.where}" if self.where else ""
        head = f"{self.tool} point {self.point} ({state} at {self.delay:.2f} s{where}, phase {self.phase!r}, " \
               f"recovery {self.recovery})"
        left = f"; left {', '.join(self.leftovers)}" if self.leftovers else ""
        return head + left + ("" if self.ok else ":\n  " + "\n  ".join(self.problems))


# ---------------------------------------------------------------------------
# The tools
# ---------------------------------------------------------------------------


def _write_user_files(folder: Path) -> None:
    """A few files of the user's next to where a tool writes its outputs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "NOTES.md").write_text("my notes: do not touch\n")
    (folder / "mine").mkdir(exist_ok=True)
    (folder / "mine" / "results.csv").write_text("a,b\n1,2\n")
    (folder / "mine" / "weights.bin").write_bytes(bytes(range(256)) * 4)


def _user_skip(rel: Path) -> bool:
    return rel.parts[0] not in ("NOTES.md", "mine")


def _is_temporary(name: str) -> bool:
    return not name.startswith(MARKER_PREFIX) and name.startswith(".") and (".tmp" in name or ".old-" in name)


def _hidden_temporaries(root: Path) -> list[Path]:
    """fedreid's temporaries (``.name.xxx.tmp``, ``.name.tmp-xxx``, ``.name.old-xxx``) in ``root`` and beside it."""
    found = [p for p in root.rglob(".*") if _is_temporary(p.name)] if root.is_dir() else []
    if root.parent.is_dir():
        found += [p for p in root.parent.iterdir() if p.name.startswith(f".{root.name}.") and _is_temporary(p.name)]
    return sorted(found)


class Tool:
    """One tool under fault injection; subclasses fill in the tool-specific parts."""

    name = ""

    def setup_inputs(self, inputs: Path) -> None:
        """Write the tool's inputs under ``inputs`` (hashed; must never change)."""

    def setup_point(self, work: Path, point: int) -> None:
        """Per kill point: user files next to the outputs and any earlier output the run replaces."""

    def user_dirs(self, work: Path) -> list[Path]:
        """Folders of user files (only ``NOTES.md`` / ``mine/`` in them are protected)."""
        return []

    def command(self, work: Path) -> list[str]:
        raise NotImplementedError

    def recovery(self, work: Path) -> tuple[str, list[str]]:
        return "rerun", self.command(work)

    def after_kill(self, work: Path, ref: Any) -> tuple[str, list[str]]:
        """(phase the kill hit, problems) from the state the kill left."""
        raise NotImplementedError

    def result(self, work: Path) -> Any:
        """A comparable fingerprint of the finished outputs."""
        raise NotImplementedError

    def compare(self, got: Any, ref: Any) -> list[str]:
        problems = []
        for key in ref:
            if got.get(key) != ref[key]:
                problems.append(f"final {key} differs from the uninterrupted run's")
        return problems

    #: Names of the temporaries the tool promises to remove when it runs again after a kill
    #: (one left after the recovery is a failure; others are only counted).
    cleaned_temporaries: Optional[re.Pattern] = None

    def leftovers(self, work: Path) -> tuple[list[str], list[str]]:
        """(hidden temporaries left after recovery, relative to the work folder; problems)."""
        found = _hidden_temporaries(self.output_root(work))
        names = [str(p.relative_to(work)) for p in found]
        promised = [p.name for p in found if self.cleaned_temporaries and self.cleaned_temporaries.fullmatch(p.name)]
        if promised:
            return names, [f"the recovery left temporaries it should remove: {', '.join(promised)}"]
        return names, []

    def output_root(self, work: Path) -> Path:
        raise NotImplementedError


# -- prepare ---------------------------------------------------------------

PREPARE_DATASETS = ("market1501", "dukemtmc", "msmt17", "viper")


class PrepareTool(Tool):
    """``prepare_datasets.py`` from a synthetic raw world of four releases, resized copies."""

    name = "prepare"
    # "its own hidden temporary folders (.<name>.tmp-*, .<name>.old-*), which a killed run may leave
    # behind and the next run of the same dataset removes" (fedreid/data/prepared.py)
    cleaned_temporaries = re.compile(r"\.(%s)\.(tmp|old)-[0-9a-f]{8}" % "|".join(PREPARE_DATASETS))

    def setup_inputs(self, inputs: Path) -> None:
        from fedreid.data.synthetic import generate_world

        self.raw = inputs / "raw"
        generate_world(self.raw, datasets=list(PREPARE_DATASETS), id_scale=0.02, min_ids=12,
                       images_per_camera=2, height=64, width=32, seed=0)

    def output_root(self, work: Path) -> Path:
        return work / "prepared"

    def setup_point(self, work: Path, point: int) -> None:
        _write_user_files(self.output_root(work))  # the user's files inside the output root itself

    def user_dirs(self, work: Path) -> list[Path]:
        return [self.output_root(work)]

    def command(self, work: Path) -> list[str]:
        return [PYTHON, str(TOOLS / "prepare_datasets.py"), "--raw-root", str(self.raw),
                "--out", str(self.output_root(work)), "--datasets", ",".join(PREPARE_DATASETS),
                "--resize", "32x16", "--no-progress", "data.public_dataset=null"]

    @staticmethod
    def dataset_digest(folder: Path) -> dict[str, str]:
        """The prepared folder's files; prepare.json without its creation time."""
        out = tree_hashes(folder, skip=lambda rel: rel.name.startswith(MARKER_PREFIX))
        record = folder / "prepare.json"
        if record.is_file():
            made = json.loads(record.read_text())
            made.pop("created", None)
            out["prepare.json"] = json.dumps(made, sort_keys=True)
        return out

    def result(self, work: Path) -> dict[str, Any]:
        root = self.output_root(work)
        out: dict[str, Any] = {name: self.dataset_digest(root / name) for name in PREPARE_DATASETS}
        cards = root / "cards.md"
        out["cards.md"] = cards.read_text() if cards.is_file() else None
        return out

    def after_kill(self, work: Path, ref: dict[str, Any]) -> tuple[str, list[str]]:
        from fedreid.data.prepared import is_prepared

        root = self.output_root(work)
        problems = []
        done = 0
        for name in PREPARE_DATASETS:
            folder = root / name
            if not folder.exists():
                continue
            if not is_prepared(folder):
                problems.append(f"{folder} is half written: no manifest.csv + prepare.json")
            elif self.dataset_digest(folder) != ref[name]:
                problems.append(f"{folder} differs from the uninterrupted run's")
            else:
                done += 1
        cards = root / "cards.md"
        if cards.exists() and cards.read_text() != ref["cards.md"]:
            problems.append(f"{cards} differs from the uninterrupted run's")
        temporaries = [p for p in _hidden_temporaries(root) if p.parent == root]
        if done == 0 and not temporaries:
            phase = "before output"
        elif done == len(PREPARE_DATASETS):
            phase = "all datasets, before exit" if not cards.exists() else "complete, before exit"
        elif temporaries:
            phase = f"writing dataset {done + 1}/{len(PREPARE_DATASETS)}"
        else:
            phase = f"between datasets ({done}/{len(PREPARE_DATASETS)})"
        return phase, problems


# -- train -----------------------------------------------------------------

REID_OVERRIDES = (
    "data.datasets=[dsa,dsb]", "data.public_dataset=pub", "model.backbone=test_resnet", "model.bottleneck_dim=16",
    "model.height=32", "model.width=16", "train.batch_size=4", "fl.rounds=4", "fl.cdw=true", "fl.kd=true",
    "fl.kd_every=2", "fl.kd_batch_size=4", "eval.every=2", "eval.batch_size=8", "eval.local_models=false",
    "run.device=cpu", "run.tensorboard=false",
)
CLS_OVERRIDES = (
    "classification.num_clients=4", "train.objective=scaffold", "train.local_epochs=1", "fl.rounds=4",
    "fl.fedftg=true", "fl.fedftg_options={iterations: 2, global_steps: 2, batch_size: 16}",
    "run.device=cpu", "run.tensorboard=false",
)


class TrainTool(Tool):
    """``train_fed.py`` from a user's config file; recovery is ``--resume`` once the run folder has its config."""

    def __init__(self, name: str, base_config: Optional[Path], overrides: Sequence[str], reid: bool) -> None:
        self.name = name
        self.base_config = base_config
        self.overrides = list(overrides)
        self.reid = reid
        self.rounds = int(next(o for o in overrides if o.startswith("fl.rounds=")).split("=")[1])

    def setup_inputs(self, inputs: Path) -> None:
        from fl_helpers import write_world

        inputs.mkdir(parents=True, exist_ok=True)
        overrides = list(self.overrides)
        if self.reid:
            prepared = write_world(inputs / "prepared")
            overrides.insert(0, f"data.prepared_root={prepared}")
        text = self.base_config.read_text() if self.base_config else ""
        # The user's config: the base config as is, the overrides on the command line.
        self.config = inputs / "my_config.yaml"
        self.config.write_text(text or "seed: 0\n")
        self.args = overrides

    def output_root(self, work: Path) -> Path:
        return work / "runs" / "run"

    def setup_point(self, work: Path, point: int) -> None:
        _write_user_files(work / "runs")

    def user_dirs(self, work: Path) -> list[Path]:
        return [work / "runs"]

    def command(self, work: Path) -> list[str]:
        return [PYTHON, str(TOOLS / "train_fed.py"), "--config", str(self.config), "--out",
                str(self.output_root(work)), "--no-progress", *self.args]

    def recovery(self, work: Path) -> tuple[str, list[str]]:
        run = self.output_root(work)
        if (run / "config.yaml").is_file():
            return "resume", [PYTHON, str(TOOLS / "train_fed.py"), "--resume", str(run), "--no-progress"]
        return "rerun", self.command(work)

    def result(self, work: Path) -> dict[str, Any]:
        import torch

        from fedreid.utils.checkpoint import load_checkpoint
        from fedreid.utils.logging import read_metrics

        run = self.output_root(work)
        ckpt = load_checkpoint(run / "checkpoint.pt")
        return {
            "metrics.jsonl": without_time(read_metrics(run)),
            "model_final.pt": payload_digest(torch.load(run / "model_final.pt", map_location="cpu",
                                                        weights_only=True)),
            "checkpoint round": ckpt["round"],
            # the run's random id names the run, it is not its state
            "checkpoint state": payload_digest({"server": {k: v for k, v in ckpt["server"].items() if k != "run_id"},
                                                "clients": ckpt["clients"]}),
            "checkpoint history": without_time(ckpt["history"]),
        }

    def after_kill(self, work: Path, ref: dict[str, Any]) -> tuple[str, list[str]]:
        import torch

        from fedreid.config import load_config
        from fedreid.utils.checkpoint import load_checkpoint

        run = self.output_root(work)
        if not run.exists() or not any(p for p in run.iterdir() if not p.name.startswith(MARKER_PREFIX)):
            return "before output", []
        problems = []
        done = None
        if (run / "checkpoint.pt").exists():
            try:
                ckpt = load_checkpoint(run / "checkpoint.pt")
            except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
                problems.append(f"checkpoint.pt does not load: {exc}")
            else:
                done = ckpt["round"]
                if without_time(ckpt["history"]) != ref["metrics.jsonl"][:done]:
                    problems.append(f"the checkpoint's {done} round(s) differ from the uninterrupted run's")
        if (run / "config.yaml").exists():
            try:
                load_config(run / "config.yaml")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"config.yaml does not load: {exc}")
        metrics = run / "metrics.jsonl"
        if metrics.exists():
            try:
                rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            except ValueError as exc:
                problems.append(f"metrics.jsonl holds a half-written line: {exc}")
            else:
                # One round may be logged before its checkpoint; never a round that is not the reference's.
                if without_time(rows) != ref["metrics.jsonl"][:len(rows)]:
                    problems.append("metrics.jsonl rows differ from the uninterrupted run's")
                if len(rows) > (done or 0) + 1:
                    problems.append(f"metrics.jsonl has {len(rows)} rows, the checkpoint only {done} round(s)")
        if (run / "model_final.pt").exists():
            try:
                got = payload_digest(torch.load(run / "model_final.pt", map_location="cpu", weights_only=True))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"model_final.pt does not load: {exc}")
            else:
                if got != ref["model_final.pt"]:
                    problems.append("model_final.pt differs from the uninterrupted run's")
        if done is None:
            phase = "setup (no checkpoint yet)"
        elif done < self.rounds:
            phase = f"after round {done}/{self.rounds}"
        elif (run / "model_final.pt").exists():
            phase = "final model written, before exit"
        else:
            phase = "all rounds, before the final model"
        return phase, problems


# -- index -----------------------------------------------------------------

#: The gallery store's files (fedreid.retrieval.store), as ``eval_reid.py index`` writes them: the header,
#: the template and each segment's files (``seg-<n>.*``, whose names the header lists).
INDEX_FILES = ("header.json", "template.faiss")
_SEGMENT_FILE = re.compile(r"seg-\d{6,}\.(faiss|vectors\.npy|ids\.npy|sqlite)")


def _index_file_names(*folders: Path) -> list[str]:
    names = set(INDEX_FILES)
    for folder in folders:
        if folder.is_dir():
            names |= {p.name for p in folder.iterdir() if _SEGMENT_FILE.fullmatch(p.name)}
    return sorted(names)


class IndexTool(Tool):
    """``eval_reid.py index`` of a user's gallery folder with a saved tiny model."""

    name = "index"
    # "a hidden sibling .<name>.tmp-* / .<name>.old-* it leaves is removed by the next build" (eval/pipeline.py)
    cleaned_temporaries = re.compile(r"\.index\.(tmp|old)-[0-9a-f]{8}")

    def setup_inputs(self, inputs: Path) -> None:
        import cv2
        import torch

        from fedreid.config import ModelConfig, to_dict
        from fedreid.models.reid import create_reid_model, shared_state

        self.model = inputs / "model" / "model_final.pt"
        self.model.parent.mkdir(parents=True)
        model = create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=0)
        cfg = ModelConfig(backbone="test_resnet", bottleneck_dim=16, height=32, width=16)
        torch.save({"format": "fedreid.model", "model": to_dict(cfg), "mode": "federated", "round": 1,
                    "state": shared_state(model)}, self.model)
        rng = np.random.default_rng(0)
        self.gallery, self.old_gallery = inputs / "gallery", inputs / "old_gallery"
        for folder, count in ((self.gallery, 96), (self.old_gallery, 10)):
            for k in range(count):
                pid, cam = 1 + k // 4, 1 + k % 3
                path = folder / f"{pid:04d}_c{cam}s1_{k:06d}_00.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                cv2.imwrite(str(path), rng.integers(0, 256, (64, 32, 3), dtype=np.uint8))
        # An earlier index (of the other gallery), which odd kill points replace; built by
        # the tool in this process (a subprocess would only add its start-up time).
        self.previous = inputs.parent / "previous_index"
        with contextlib.redirect_stdout(io.StringIO()):
            code = load_tool("eval_reid").main(self._argv(self.old_gallery, self.previous)[2:])
        if code != 0:
            raise RuntimeError("building the earlier index failed")
        self.previous_digest = self.index_digest(self.previous)

    def _argv(self, gallery: Path, index: Path) -> list[str]:
        return [PYTHON, str(TOOLS / "eval_reid.py"), "index", "--model", str(self.model), "--gallery", str(gallery),
                "--index", str(index), "--device", "cpu", "--batch-size", "16"]

    def output_root(self, work: Path) -> Path:
        return work / "indexes" / "index"

    def setup_point(self, work: Path, point: int) -> None:
        _write_user_files(work / "indexes")
        if point % 2:
            shutil.copytree(self.previous, self.output_root(work))

    def user_dirs(self, work: Path) -> list[Path]:
        return [work / "indexes"]

    def command(self, work: Path) -> list[str]:
        return self._argv(self.gallery, self.output_root(work))

    @staticmethod
    def index_digest(folder: Path) -> dict[str, Any]:
        """The store's files (None where missing): header as JSON, the others' bytes."""
        out: dict[str, Any] = {}
        for name in _index_file_names(folder):
            path = folder / name
            if not path.is_file():
                out[name] = None
            elif name == "header.json":
                try:
                    out[name] = json.loads(path.read_text())
                except ValueError:
                    out[name] = "unreadable"
            else:
                out[name] = file_sha(path)
        return out

    def result(self, work: Path) -> dict[str, Any]:
        from fedreid.retrieval import GalleryStore

        GalleryStore.open(self.output_root(work))  # loads, and consistent
        return self.index_digest(self.output_root(work))

    def after_kill(self, work: Path, ref: dict[str, Any]) -> tuple[str, list[str]]:
        folder = self.output_root(work)
        got = self.index_digest(folder)
        beside = [p.name for p in _hidden_temporaries(folder) if p.parent == folder.parent]
        staging, old = any(".tmp" in n for n in beside), any(".old-" in n for n in beside)
        if got == ref:
            return "index complete, before exit", []
        if got == self.previous_digest:
            return ("building" if staging else "before output") + " (earlier index intact)", []
        if all(v is None for v in got.values()):
            if old:
                return "swapping folders (nothing in place)", []
            return "building (no index yet)" if staging else "before output", []
        names = sorted(set(got) | set(ref) | set(self.previous_digest))
        new = [n for n in names if got.get(n) is not None and got.get(n) == ref.get(n)]
        old = [n for n in names if got.get(n) is not None and got.get(n) == self.previous_digest.get(n) and n not in new]
        missing = [n for n in names if got.get(n) is None]
        return "mid-save", [
            f"{folder} is half written: new {new or '-'}, earlier {old or '-'}, missing {missing or '-'}"
        ]


class IndexUpdateTool(IndexTool):
    """``eval_reid.py index --add`` (a segment write) or ``--remove`` (a compaction) on a two-segment store.

    The store holds the 96-image gallery, then the 10-image one added as a second
    segment. ``add`` adds 12 more images; ``remove`` erases five images of the second
    segment, and after the recovery no byte of their vectors or paths may remain
    in any file of the store or beside it (crash leftovers included).
    """

    cleaned_temporaries = re.compile(r"\.index\.(tmp|old)-[0-9a-f]{8}")

    def __init__(self, mode: str) -> None:
        if mode not in ("add", "remove"):
            raise ValueError(f"mode must be 'add' or 'remove', got {mode!r}")
        self.mode = mode
        self.name = f"index-{mode}"

    def setup_inputs(self, inputs: Path) -> None:
        import cv2

        super().setup_inputs(inputs)  # the model, both galleries, and previous_index (the small gallery)
        rng = np.random.default_rng(1)
        self.new_images = inputs / "new_gallery"
        for k in range(12):
            path = self.new_images / f"{100 + k:04d}_c1s1_{k:06d}_00.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(path), rng.integers(0, 256, (64, 32, 3), dtype=np.uint8))
        # The store every point starts from: the big gallery, then the small one as a second segment.
        self.previous = inputs.parent / "store_before_update"
        with contextlib.redirect_stdout(io.StringIO()):
            tool = load_tool("eval_reid")
            codes = [tool.main(self._argv(self.gallery, self.previous)[2:]),
                     tool.main(["index", "--model", str(self.model), "--index", str(self.previous),
                                "--add", str(self.old_gallery), "--device", "cpu", "--batch-size", "16"])]
        if codes != [0, 0]:
            raise RuntimeError(f"building the store to update failed (exit codes {codes})")
        from fedreid.retrieval import GalleryStore

        store = GalleryStore.open(self.previous)
        # By path: the two galleries share file names, and the big gallery's twins must stay.
        self.erased_paths = sorted(str(p) for p in self.old_gallery.iterdir())[:5]
        by_id = {int(i): np.asarray(seg.vectors[k], dtype=np.float32)
                 for seg in store.segments for k, i in enumerate(seg.ids)}
        ids = store.find_paths(self.erased_paths)
        if sorted(ids) != self.erased_paths:
            raise RuntimeError(f"the items to erase are not stored under their paths: {ids}")
        self.erased_vectors = [by_id[ids[p]].tobytes() for p in self.erased_paths]
        self.previous_digest = self.index_digest(self.previous)

    def setup_point(self, work: Path, point: int) -> None:
        _write_user_files(work / "indexes")
        shutil.copytree(self.previous, self.output_root(work))

    def command(self, work: Path) -> list[str]:
        index = ["--index", str(self.output_root(work))]
        if self.mode == "add":
            return [PYTHON, str(TOOLS / "eval_reid.py"), "index", "--model", str(self.model), *index,
                    "--add", str(self.new_images), "--device", "cpu", "--batch-size", "16"]
        return [PYTHON, str(TOOLS / "eval_reid.py"), "index", *index, "--remove", *self.erased_paths]

    def recovery(self, work: Path) -> tuple[str, list[str]]:
        """Rerun the update, unless the killed one had already swapped its result in: its rerun is refused
        (the images are there, or gone), so the user opens the store instead (``--check`` reads and hashes
        every file, writes nothing, and like every open removes what the kill left beside the store)."""
        header = self.output_root(work) / "header.json"
        if header.is_file():
            change = 12 if self.mode == "add" else -len(self.erased_paths)
            try:
                done = json.loads(header.read_text()).get("ntotal") == (
                    self.previous_digest["header.json"]["ntotal"] + change)
            except ValueError:
                done = False
            if done:
                return "check", [PYTHON, str(TOOLS / "eval_reid.py"), "index", "--index", str(self.output_root(work)),
                                 "--check"]
        return "rerun", self.command(work)

    def erased_traces(self, work: Path) -> list[str]:
        """Files in or beside the store that still hold an erased item's vector or path."""
        folder = self.output_root(work)
        files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
        for sibling in folder.parent.iterdir():
            if sibling.name.startswith(f".{folder.name}.") and sibling.is_dir():
                files += [p for p in sibling.rglob("*") if p.is_file()]
        needles = self.erased_vectors + [p.encode() for p in self.erased_paths]
        return sorted(str(p.relative_to(work)) for p in files if any(x in p.read_bytes() for x in needles))

    def result(self, work: Path) -> dict[str, Any]:
        out = super().result(work)
        if self.mode == "remove":
            out["erased traces"] = self.erased_traces(work)
        return out

    def after_kill(self, work: Path, ref: dict[str, Any]) -> tuple[str, list[str]]:
        # The store's files only: erased traces are checked after the recovery (the set-aside copy
        # of a removal killed after its swap still holds them until the next open).
        return super().after_kill(work, {k: v for k, v in ref.items() if k != "erased traces"})


def make_tool(name: str) -> Tool:
    if name == "prepare":
        return PrepareTool()
    if name == "train-reid":
        return TrainTool("train-reid", None, REID_OVERRIDES, reid=True)
    if name == "train-cls":
        return TrainTool("train-cls", REPO / "configs" / "classification" / "digits_fedftg.yaml", CLS_OVERRIDES,
                         reid=False)
    if name == "index":
        return IndexTool()
    if name in ("index-add", "index-remove"):
        return IndexUpdateTool(name.split("-", 1)[1])
    raise ValueError(f"unknown tool {name!r}; choose from {', '.join(SOAK_TOOL_NAMES)}")


#: The tools tests/commands/test_fault_injection.py kills at random times (a module fixture each).
TOOL_NAMES = ("prepare", "train-reid", "train-cls", "index")
#: Every tool bench/fault_soak.py can soak: also the store's segment write and compaction.
SOAK_TOOL_NAMES = (*TOOL_NAMES, "index-add", "index-remove")


# ---------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------


def kill_delays(seed: int, tool: str, wall: float, points: int) -> list[float]:
    """Seeded kill delays, uniform in ``[0, wall)``; a tool's draws do not depend on which other tools run."""
    rng = np.random.default_rng([seed, zlib.crc32(tool.encode())])
    return [float(d) for d in rng.uniform(0.0, wall, size=points)]


class FaultHarness:
    """One tool: inputs, the uninterrupted reference, then kill points."""

    def __init__(self, tool: Tool, base: Path, seed: int = 0) -> None:
        self.tool = tool
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        inputs = self.base / "inputs"
        tool.setup_inputs(inputs)
        self.inputs = inputs
        self.input_hashes = tree_hashes(inputs)
        work = self.reference_dir = self.base / "reference"
        tool.setup_point(work, 0)
        # Under the write-point wrapper (never killing), to learn the run's os.replace targets as well.
        replace_log = self.base / "reference.replaces"
        res = run_tool(hooked(tool.command(work), 0, replace_log), work, self.base / "reference.log")
        if res.returncode != 0:
            raise RuntimeError(f"{tool.name}: the uninterrupted run failed (exit {res.returncode}):\n{res.tail()}")
        self.wall = res.seconds
        self.reference = tool.result(work)
        lines = replace_log.read_text().splitlines() if replace_log.is_file() else []
        #: The reference run's os.replace targets, in order (file or folder names).
        self.replaces = [Path(line.split("\t", 1)[1]).name for line in lines]

    def delays(self, points: int) -> list[float]:
        return kill_delays(self.seed, self.tool.name, self.wall, points)

    def write_points(self, points: int) -> list[int]:
        """Seeded distinct os.replace numbers (1-based) to kill before; all of them when ``points`` covers them."""
        rng = np.random.default_rng([self.seed, zlib.crc32(self.tool.name.encode()), 1])
        count = len(self.replaces)
        return [int(n) + 1 for n in rng.permutation(count)[: min(points, count)]]

    def kill_point(
        self, point: int, delay: Optional[float] = None, *, before_replace: Optional[int] = None,
        skip_untouched: bool = False,
    ) -> Outcome:
        """Kill the tool ``delay`` seconds after its start (or before its ``before_replace``-th os.replace),
        check, recover, check.

        ``skip_untouched``: when the kill left the outputs exactly as they were
        before the run (it hit the start-up), skip the recovery, which would
        only be an uninterrupted run (a saving for the quick tests; the soak
        always recovers).
        """
        tool = self.tool
        started = time.perf_counter()
        if (delay is None) == (before_replace is None):
            raise ValueError("give a delay or a write point (before_replace)")
        outcome = Outcome(tool.name, point, delay if delay is not None else 0.0)
        work = self.base / f"point{point:03d}"
        if work.exists():
            shutil.rmtree(work)
        tool.setup_point(work, point)
        user_before = {str(d): tree_hashes(d, skip=_user_skip) for d in tool.user_dirs(work)}
        outputs_before = tree_hashes(tool.output_root(work))

        def check_protected(when: str) -> None:
            lost, problems = compare_hashes(self.input_hashes, tree_hashes(self.inputs), f"inputs ({when})")
            for folder, before in user_before.items():
                n, more = compare_hashes(before, tree_hashes(Path(folder), skip=_user_skip), f"user files ({when})")
                lost += n
                problems += more
            outcome.files_lost = max(outcome.files_lost, lost)
            outcome.problems += problems

        if before_replace is None:
            outcome.where = "random time"
            first = run_tool(tool.command(work), work, work / "killed.log", kill_after=delay)
        else:
            replace_log = work / "killed.replaces"
            first = run_tool(hooked(tool.command(work), before_replace, replace_log), work, work / "killed.log")
            outcome.delay = first.seconds
            # This run's own n-th target (an earlier output can change the sequence), else the reference's.
            lines = replace_log.read_text().splitlines() if replace_log.is_file() else []
            target = Path(lines[-1].split("\t", 1)[1]).name if len(lines) == before_replace else "none: finished"
            outcome.where = f"before os.replace #{before_replace} ({target})"
        outcome.killed = first.killed
        completed = first.returncode == 0
        if not first.killed and not completed:
            outcome.problems.append(f"the run failed on its own (exit {first.returncode}):\n{first.tail()}")
        check_protected("after the kill")
        if first.killed:
            try:
                outcome.phase, problems = tool.after_kill(work, self.reference)
            except Exception as exc:  # noqa: BLE001 - a crash of the check is a finding too
                outcome.phase, problems = "unknown", [f"inspecting the killed run's outputs failed: {exc!r}"]
            outcome.problems += problems
            if skip_untouched and tree_hashes(tool.output_root(work)) == outputs_before:
                outcome.recovery = "skipped: no trace"
                completed = False
            else:
                outcome.recovery, argv = tool.recovery(work)
                again = run_tool(argv, work, work / "recovery.log")
                completed = again.returncode == 0
                if not completed:
                    outcome.problems.append(
                        f"the {outcome.recovery} failed (exit {again.returncode}):\n{again.tail()}")
                check_protected("after the recovery")
        else:
            outcome.phase = "finished before the kill"
        if completed:
            try:
                outcome.problems += tool.compare(tool.result(work), self.reference)
            except Exception as exc:  # noqa: BLE001
                outcome.problems.append(f"reading the final outputs failed: {exc!r}")
            outcome.leftovers, problems = tool.leftovers(work)
            outcome.problems += problems
        outcome.seconds = time.perf_counter() - started
        if outcome.ok:
            shutil.rmtree(work, ignore_errors=True)  # keep a failed point's folder to look at
        return outcome

    def run(self, points: int, write_points: int = 0, log: Callable[[str], None] = lambda line: None) -> list[Outcome]:
        """``points`` kills at random times, then ``write_points`` kills before seeded os.replace calls."""
        outcomes = []
        for point, delay in enumerate(self.delays(points)):
            outcomes.append(self.kill_point(point, delay))
            log(outcomes[-1].describe())
        for point, n in enumerate(self.write_points(write_points), start=points):
            outcomes.append(self.kill_point(point, before_replace=n))
            log(outcomes[-1].describe())
        return outcomes


def summary_row(tool: str, outcomes: Sequence[Outcome], wall: float, seconds: float) -> dict[str, Any]:
    phases = Counter(o.phase for o in outcomes)
    return {
        "tool": tool,
        "reference_s": round(wall, 2),
        "points": len(outcomes),
        "random_points": sum(o.where == "random time" for o in outcomes),
        "write_points": sum(o.where.startswith("before os.replace") for o in outcomes),
        "killed": sum(o.killed for o in outcomes),
        "finished_first": sum(not o.killed for o in outcomes),
        "survived": sum(o.ok for o in outcomes),
        "files_lost": sum(o.files_lost for o in outcomes),
        "temp_files_left": sum(len(o.leftovers) for o in outcomes),
        "wall_s": round(seconds, 1),
        "phases": dict(phases.most_common()),
    }


if __name__ == "__main__":
    _run_hooked(sys.argv[1:])
