"""How much of the GPU FedPav uses: ceilings, one client, one round, evaluation.

Seven sections, each printed as soon as it is measured:

(a) ceilings: a bare IDE train step (ResNet-50 -> 512 bottleneck -> ids) on
    random tensors, at two batch sizes, in fp32, TF32 and bf16+channels-last;
(b) one client's ``Client.fit`` against a bare data-inclusive loop (the
    synthetic world's Market-1501 client: the same images, transform, workers and precision; persistent pinned workers,
    non-blocking copies): img/s of each and their ratio (runs in pairs, ABBA
    order); ``--profile`` then profiles one run of each: the device's busy
    time against the wall time, and the ops that cost the host most;
(c) FedPav rounds of the synthetic nine-dataset world with CDW and KD, for
    several ``run.concurrent_clients``: aggregate training img/s and seconds
    per phase (train, CDW, KD features, aggregation, server KD, evaluation),
    peak GPU memory; with ``run.deterministic`` on and off; then the demo
    world's 3-round run end to end;
(d) exact evaluation at MSMT17 size against the GPU floor (block matmul +
    argsort), through ``bench/gpu_eval.py``;
(e) the bare bf16 step of (a) at the smaller batch in N processes at once:
    what one GPU gives several CUDA contexts (time-slicing, no MPS), the
    bound of ``run.concurrent_clients``;
(f) evaluation during training on (c)'s world (every query and gallery set,
    flipped, one persistent stream): seconds per evaluation with the
    features in fp32, TF32 and bf16 (``eval.precision``), and how far the
    features and mAP move from fp32's;
(g) (b)'s bare data-inclusive loop in N processes at once, the loader
    workers split over them: the bound of (c) for the data path with no
    federated work around the steps.

``--cuda-graphs`` (on CUDA): (a) adds rows with the backbone replayed as a
CUDA graph (``train.cuda_graphs``), and (b), (c) and (e) run with it ``off``,
``on`` or ``both`` (default). ``--normalize-on worker,device`` runs (b) and
(c) with the images normalised by the loader workers and by the GPU
(``train.normalize_on``).

``--scale tiny`` (the default on the CPU) shrinks everything so the script
runs here in a few minutes; ``--scale full`` (the default on CUDA) is the
issue's setting: ResNet-50 at 256x128, batch 32 and 128.

    python bench/gpu_round.py [--scale tiny|full] [--sections abcdef] [--concurrent 1,2,4,8] [--cuda-graphs both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from round_time import prepare_synthetic  # noqa: E402

from fedreid.config import load_config  # noqa: E402
from fedreid.data.datasets import ReIDImageDataset, on_device  # noqa: E402
from fedreid.data.prepared import load_prepared  # noqa: E402
from fedreid.data.scenarios import by_dataset  # noqa: E402
from fedreid.data.transforms import build_train_transform, defers_normalize  # noqa: E402
from fedreid.fl.client import Client  # noqa: E402
from fedreid.fl.evaluation import Evaluator  # noqa: E402
from fedreid.fl.local.cuda_graphs import graph_captures, graphed_backbone  # noqa: E402
from fedreid.fl.simulation import run_simulation  # noqa: E402
from fedreid.models.reid import create_reid_model, replace_classifier, shared_state  # noqa: E402
from fedreid.utils.precision import Precision, resolve_precision, set_tf32  # noqa: E402
from fedreid.utils.seeding import deterministic_mode  # noqa: E402

SCALES = {
    # backbone, input size, batch sizes and steps of (a), batch and synthetic world
    # id_scale of (c) (the smallest of the nine clients must hold a batch), problem size of (d)
    "tiny": dict(backbone="resnet18", height=64, width=32, batches=(4, 8), steps=2,
                 round_batch=16, world_scale=0.04, min_ids=20, eval=(300, 2000, 128)),
    "full": dict(backbone="resnet50", height=256, width=128, batches=(32, 128), steps=20,
                 round_batch=32, world_scale=0.17, min_ids=48, eval=(11659, 82161, 512)),
}


def say(line: str = "") -> None:
    print(line, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ide_model(backbone: str, num_ids: int) -> nn.Module:
    model = create_reid_model(backbone, 0, pretrained=None, seed=0)
    replace_classifier(model, num_ids, seed=0)
    return model


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    backbone = {id(p) for p in model.backbone.parameters()}
    low = [p for p in model.parameters() if id(p) in backbone]
    high = [p for p in model.parameters() if id(p) not in backbone]
    return torch.optim.SGD([{"params": low, "lr": 0.005}, {"params": high, "lr": 0.05}],
                           lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)


# --------------------------------------------------------------------------- (a)

def ide_step(model: nn.Module, opt: torch.optim.Optimizer, crit: nn.Module, x: torch.Tensor, y: torch.Tensor,
             precision: Precision) -> None:
    opt.zero_grad(set_to_none=True)
    with precision.autocast():
        loss = crit(model(x), y)
    loss.backward()
    opt.step()


def timed_bare_steps(device: torch.device, s: dict[str, Any], batch: int, precision: Precision, graphs: bool,
                     steps: int, warmup: int = 2, ready: Callable[[], Any] = lambda: None) -> tuple[float, float]:
    """Start and end times of ``steps`` bare IDE steps on random tensors, after ``warmup`` steps and ``ready()``."""
    model = precision.prepare_model(ide_model(s["backbone"], 751).to(device).train())
    opt, crit = sgd(model), nn.CrossEntropyLoss()
    x = precision.prepare_input(torch.randn(batch, 3, s["height"], s["width"], device=device))
    y = torch.randint(0, 751, (batch,), device=device)
    with graphed_backbone(model, batch, graphs):
        for _ in range(warmup):
            ide_step(model, opt, crit, x, y, precision)
        sync(device)
        ready()
        t0 = time.perf_counter()
        for _ in range(steps):
            ide_step(model, opt, crit, x, y, precision)
        sync(device)
    return t0, time.perf_counter()


def bare_rate(device: torch.device, s: dict[str, Any], batch: int, precision: Precision, graphs: bool,
              steps: int) -> float:
    """img/s of ``steps`` bare IDE steps on random tensors (after two warm-up steps)."""
    t0, t1 = timed_bare_steps(device, s, batch, precision, graphs, steps)
    return batch * steps / (t1 - t0)


def section_ceilings(device: torch.device, s: dict[str, Any], graph_rows: bool) -> None:
    say(f"(a) bare IDE train step on random tensors: {s['backbone']} {s['height']}x{s['width']}, 751 ids")
    modes = [("fp32", "fp32", False, False), ("tf32", "fp32", True, False), ("bf16+cl", "bf16", False, False)]
    if graph_rows:
        modes += [("tf32+graph", "fp32", True, True), ("bf16+cl+graph", "bf16", False, True)]
    say(f"    {'mode':<14}" + "".join(f"{'b' + str(b) + ' img/s':>14}" for b in s["batches"]))
    for label, name, tf32, graphs in modes:
        if (tf32 or graphs) and device.type != "cuda":
            continue
        set_tf32(tf32)
        precision = resolve_precision(name, device)
        row = [bare_rate(device, s, batch, precision, graphs, s["steps"]) for batch in s["batches"]]
        say(f"    {label:<14}" + "".join(f"{r:>14,.0f}" for r in row))
    set_tf32(False)


# --------------------------------------------------------------------------- (b)

def bare_loop(model: nn.Module, dataset, batch: int, workers: int, precision: Precision, device: torch.device,
              seed: int, loader_box: dict, graphs: bool = False) -> tuple[int, float]:
    """One epoch of a plain data-inclusive loop: persistent pinned workers, non-blocking copies."""
    if "loader" not in loader_box:  # a deferring transform's batches are normalised on the device, as ours
        loader_box["loader"] = on_device(torch.utils.data.DataLoader(
            dataset, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
            persistent_workers=workers > 0, pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(seed)), dataset.transform, device,
            channels_last=precision.channels_last)
    opt, crit = sgd(model), nn.CrossEntropyLoss()
    model.train()
    sync(device)
    t0 = time.perf_counter()
    images = 0
    with graphed_backbone(model, batch, graphs):
        for b in loader_box["loader"]:
            x = precision.prepare_input(b["image"].to(device, non_blocking=True))
            y = b["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = crit(model(x), y)
            loss.backward()
            opt.step()
            images += x.shape[0]
    sync(device)
    return images, time.perf_counter() - t0


def profile_table(label: str, run: Callable[[], tuple[int, float]], device: torch.device, rows: int = 12) -> None:
    """One ``run()`` under torch.profiler: its wall time against the device's busy time, and its costliest ops.

    On CUDA, busy time below the wall time means the device waited (for the host, the data or a sync);
    the table ranks the ops by their host (self CPU) time, with their device time beside it.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        images, wall = run()
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    say(f"    profile of one {label} run: {images} images, {wall * 1e3:.0f} ms wall"
        + (f", device busy {busy_us / 1e3:.0f} ms ({busy_us / 1e4 / wall:.0f}%)" if device.type == "cuda" else ""))
    table = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48)
    for line in table.splitlines():
        say("      " + line)


def section_client(device: torch.device, s: dict[str, Any], tmp: Path, workers: int, precision_name: str,
                   graphs: bool, normalize_on: str = "auto", repeats: int = 5, profile: bool = False) -> None:
    """(b) on the world's Market-1501 client; ``profile``: then one run of each under torch.profiler."""
    ensure_world(s, tmp)
    split = by_dataset([load_prepared(tmp / "c-prepared", "market1501")], "train_all")[0]
    cfg = load_config(None, [
        f"model.backbone={s['backbone']}", f"model.height={s['height']}", f"model.width={s['width']}",
        "model.pretrained=null", "train.batch_size=32", f"train.workers={workers}",
        f"train.precision={precision_name}", f"run.device={device.type}", "fl.cdw=false", "fl.kd=false",
        f"train.cuda_graphs={graphs}", f"train.normalize_on={normalize_on}",
    ])
    client = Client(split, 0, cfg, device=device)
    precision = client.precision
    ours = create_reid_model(s["backbone"], 0, pretrained=None, seed=0).to(device)
    payload = shared_state(ours)
    bare = precision.prepare_model(ide_model(s["backbone"], split.num_classes).to(device))
    defer = defers_normalize(normalize_on, device)
    transform = build_train_transform(s["height"], s["width"], seed=0, defer_normalize=defer)
    bare_ds = ReIDImageDataset(split.records, split.labels, transform=transform)
    box: dict = {}

    outside: list[float] = []  # seconds of a fit spent outside train_local (payload, head, update)

    def run_ours(r: int) -> tuple[int, float]:
        sync(device)
        t = time.perf_counter()
        update = client.fit(ours, payload, {"round": r})
        sync(device)
        wall = time.perf_counter() - t
        outside.append(wall - float(update.metadata["time_train"]))
        return int(update.metadata["steps"]) * 32, wall

    def run_bare(r: int) -> tuple[int, float]:
        return bare_loop(bare, bare_ds, 32, workers, precision, device, r, box, graphs)

    say(f"(b) one client: {len(split)} images, {split.num_classes} ids, {s['backbone']} {s['height']}x{s['width']}, "
        f"batch 32, workers {workers}, precision {precision.name}, CUDA graphs {'on' if graphs else 'off'}, "
        f"normalised on the {'device' if defer else 'workers'}")
    run_ours(0)
    run_bare(0)
    rates: dict[str, list[float]] = {"Client.fit": [], "bare loop": []}
    pairs: list[float] = []
    for r in range(repeats):
        # ABBA order: a drift of the machine's speed over the runs weighs on both sides alike
        order = (("Client.fit", run_ours), ("bare loop", run_bare))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            n, sec = fn(r + 1)
            rates[name].append(n / sec)
        pairs.append(rates["Client.fit"][-1] / rates["bare loop"][-1])
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in rates.items():
        say(f"    {k:<11} median {med[k]:>9,.0f} img/s   runs " + ", ".join(f"{x:,.0f}" for x in v))
    say(f"    ratio Client.fit / bare loop: {med['Client.fit'] / med['bare loop']:.3f} of the medians, "
        f"{statistics.median(pairs):.3f} the median of the {len(pairs)} pairs' (goal >= 0.95); "
        f"a fit's time outside train_local: median {statistics.median(outside[1:]) * 1e3:.0f} ms"
        + (f"; graphs captured: client {graph_captures(ours.backbone)}, bare {graph_captures(bare.backbone)}"
           if graphs else ""))
    if profile:
        profile_table("Client.fit", lambda: run_ours(repeats + 1), device)
        profile_table("bare loop", lambda: run_bare(repeats + 1), device)
    # the two parts of that time that move the model: the payload in, the update out
    loads, updates = [], []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        client.prepare_model(ours, payload)
        sync(device)
        loads.append(time.perf_counter() - t)
        client._make_update(ours, {})
        updates.append(time.perf_counter() - t - loads[-1])
    say(f"    of which: payload into the model (prepare_model) median {statistics.median(loads) * 1e3:.0f} ms, "
        f"update out to the host (_make_update) {statistics.median(updates) * 1e3:.0f} ms")


# --------------------------------------------------------------------------- (c)

def round_config(s: dict[str, Any], tmp: Path, overrides: list[str], world: str = "c"):
    """The demo config at the scale's model; ``world`` names the synthetic world's folders."""
    return load_config("configs/fedreid/demo_synthetic.yaml", [
        f"data.raw_root={tmp / (world + '-raw')}", f"synthetic.root={tmp / (world + '-raw')}",
        f"data.prepared_root={tmp / (world + '-prepared')}", f"run.out_dir={tmp / (world + '-run')}",
        f"model.backbone={s['backbone']}", "model.pretrained=null",
        f"model.height={s['height']}", f"model.width={s['width']}", "run.tensorboard=false", *overrides,
    ])


def phase_row(record: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one round record (client phases summed over clients) and its training steps."""
    t = record["time"]
    clients = t.get("clients", {}).values()
    metrics = record["client_metrics"].values()

    def csum(key: str) -> float:
        return sum(v.get(key, 0.0) for v in clients)

    images = sum(int(m.get("steps", 0)) for m in metrics)
    server = t.get("aggregate", 0.0) + t.get("kd", 0.0) + t.get("eval", 0.0)
    clients_wall = t["round"] - server
    return {"clients_s": clients_wall, "train_s": csum("time_train"), "cdw_s": csum("time_cdw"),
            "kdfeat_s": csum("time_kd_features"), "agg_s": t.get("aggregate", 0.0), "kd_s": t.get("kd", 0.0),
            "eval_s": t.get("eval", 0.0), "round_s": t["round"], "steps": images,
            "gpu_peak_client_GiB": max((m.get("gpu_peak_bytes", 0) for m in metrics), default=0) / 2**30}


def world_overrides(s: dict[str, Any]) -> list[str]:
    return [f"synthetic.id_scale={s['world_scale']}", f"synthetic.min_ids={s['min_ids']}",
            f"data.workers={min(8, os.cpu_count() or 1)}"]


def ensure_world(s: dict[str, Any], tmp: Path) -> None:
    """The synthetic nine-dataset world of (b) and (c), generated and prepared once."""
    if not (tmp / "c-prepared").is_dir():
        t0 = time.perf_counter()
        prepare_synthetic(round_config(s, tmp, world_overrides(s)))
        say(f"    [synthetic world at id_scale {s['world_scale']}: {time.perf_counter() - t0:.0f} s]")


def section_rounds(device: torch.device, s: dict[str, Any], tmp: Path, concurrent: list[int], workers_total: int,
                   precision_name: str, graph_settings: list[bool], demo_run: bool = True, local_epochs: int = 1,
                   determinism_row: bool = True, normalize_settings: Sequence[str] = ("auto",)) -> None:
    world = world_overrides(s)
    ensure_world(s, tmp)
    batch = s["round_batch"]
    say(f"(c) FedPav + CDW + KD rounds on the synthetic nine-dataset world: {s['backbone']} "
        f"{s['height']}x{s['width']}, batch {batch}, {local_epochs} local epoch(s), precision {precision_name}. Round 1 is warm-up; img/s is "
        "round 2's (training and CDW, no KD or evaluation): training images / its clients phase (r2_s); the other "
        "columns are round 3's (CDW, KD and evaluation); train_loss and mAP of round 3 to full precision "
        "(equal digits: equal runs; the loader worker count per client changes the augmentations)")
    cols = ("clients", "workers", "determ.", "graphs", "norm.", "img/s", "r2_s", "clients_s", "train_s", "cdw_s", "kdfeat_s", "agg_s",
            "kd_s", "eval_s", "round_s", "peak_GiB", "train_loss", "mAP")
    say("    " + " ".join(f"{c:>9}" for c in cols))
    runs = [(n, True, g, where) for n in concurrent for g in graph_settings for where in normalize_settings]
    if determinism_row:
        runs.append((concurrent[0], False, graph_settings[0], normalize_settings[0]))
    for n, deterministic, graphs, where in runs:
        workers = max(1, min(8, workers_total // n))
        cfg = round_config(s, tmp, [
            *world, f"train.batch_size={batch}", f"train.local_epochs={local_epochs}", f"train.workers={workers}", f"train.precision={precision_name}",
            f"run.device={device.type}", f"run.concurrent_clients={n}", f"run.deterministic={deterministic}",
            f"train.cuda_graphs={graphs}", f"train.normalize_on={where}", "fl.rounds=3", "fl.kd_every=3",
            "eval.every=3", f"run.out_dir={tmp / f'c-run-{n}-{deterministic}-{graphs}-{where}'}",
        ])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            history = run_simulation(cfg, cfg.run.out_dir, progress=False)
        except Exception as exc:  # a bench reports a failed setting and goes on with the next
            say(f"    concurrent_clients={n}: failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        plain, row = phase_row(history[1]), phase_row(history[-1])
        peak = row["gpu_peak_client_GiB"]
        if device.type == "cuda" and n == 1:
            peak = torch.cuda.max_memory_allocated(device) / 2**30
        rate = plain["steps"] * batch / plain["clients_s"]
        vals = [plain["clients_s"]] + [row[k] for k in ("clients_s", "train_s", "cdw_s", "kdfeat_s", "agg_s", "kd_s",
                                                          "eval_s", "round_s")]
        ev = history[-1].get("eval", {})
        m_ap = statistics.mean(v["mAP"] for v in ev.values()) if ev else float("nan")
        # the loss and mAP to full precision: equal digits across rows show equal runs
        say(f"    {n:>9} {workers:>9} {str(deterministic):>9} {str(graphs):>9} {where:>9} {rate:>9,.0f} " + " ".join(f"{v:>9.2f}" for v in vals)
            + f" {peak:>9.2f} {history[-1]['train_loss']:.10f} {m_ap:.10f}")
    if not demo_run:
        return
    best = max(concurrent)  # the demo runs with the most concurrent clients measured
    demo = round_config(s, tmp, [], world="demo")  # the demo's own world and batch size
    prepare_synthetic(demo)
    cfg = round_config(s, tmp, [
        f"train.workers={max(1, min(8, workers_total // best))}", f"train.precision={precision_name}",
        f"run.device={device.type}", f"run.concurrent_clients={best}", "fl.rounds=3",
        f"train.cuda_graphs={graph_settings[-1]}",
    ], world="demo")
    t0 = time.perf_counter()
    history = run_simulation(cfg, cfg.run.out_dir, progress=False)
    wall = time.perf_counter() - t0
    ev = history[-1].get("eval", {})
    r1 = statistics.mean(v["rank1"] for v in ev.values()) if ev else float("nan")
    say(f"    demo world ({sum(int(m.get('steps', 0)) for m in history[-1]['client_metrics'].values())} steps a "
        f"round), 3 rounds (CDW, KD at round 3, evaluation at round 3), concurrent_clients={best}, "
        f"CUDA graphs {graph_settings[-1]}, "
        f"batch {cfg.train.batch_size}: {wall:.1f} s end to end (goal < 60 s on a GPU); mean Rank-1 {r1:.3f}")


# --------------------------------------------------------------------------- (e)

def _process_steps(rank: int, scale: str, device_type: str, graphs: bool, barrier, results) -> None:
    """One of (e)'s processes: warm up, wait for the others, time the bare bf16 steps."""
    s = SCALES[scale]
    device = torch.device(device_type)
    t0, t1 = timed_bare_steps(device, s, s["batches"][0], resolve_precision("bf16", device), graphs,
                              s["steps"] * 2, warmup=3, ready=barrier.wait)
    results.put((rank, t0, t1, s["batches"][0] * s["steps"] * 2))


def section_processes(device: torch.device, scale: str, counts: list[int], graph_settings: list[bool]) -> None:
    """(e): N processes, each running (a)'s bare bf16 step at the smaller batch, all at once."""

    s = SCALES[scale]
    batch, steps = s["batches"][0], s["steps"] * 2
    say(f"(e) the bare bf16 step at batch {batch} in N processes at once ({s['backbone']} "
        f"{s['height']}x{s['width']}, {steps} timed steps each): aggregate img/s over the span from the first "
        "start to the last end")
    say(f"    {'processes':>9} {'graphs':>7} {'img/s':>9} {'per process':>12}")
    for graphs in graph_settings:
        for n in counts:
            total = _all_at_once(n, _process_steps, (scale, device.type, graphs))
            say(f"    {n:>9} {str(graphs):>7} " + (f"{total:>9,.0f} {total / n:>12,.0f}" if total else "failed"))


def _all_at_once(n: int, target: Callable[..., None], args: tuple) -> Optional[float]:
    """``target(rank, *args, barrier, results)`` in ``n`` spawned processes; their aggregate img/s, None if one failed.

    Each process waits at the barrier once warm, then puts ``(rank, start, end, images)``; the rate is
    all images over the span from the first start to the last end.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, barrier, results)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        spans = [results.get(timeout=600) for _ in range(n)]
    except Exception:  # noqa: BLE001 - a child that died leaves its result missing
        spans = []
    for p in procs:
        p.join()
    if not spans:
        return None
    wall = max(end for _, _, end, _ in spans) - min(start for _, start, _, _ in spans)
    return sum(images for *_, images in spans) / wall


def _process_data_loop(rank: int, scale: str, device_type: str, graphs: bool, workers: int, epochs: int,
                       precision_name: str, normalize_on: str, root: str, barrier, results) -> None:
    """One of (g)'s processes: (b)'s bare data-inclusive loop on the world's Market-1501 client."""
    s = SCALES[scale]
    device = torch.device(device_type)
    precision = resolve_precision(precision_name, device)
    split = by_dataset([load_prepared(Path(root) / "c-prepared", "market1501")], "train_all")[0]
    model = precision.prepare_model(ide_model(s["backbone"], split.num_classes).to(device))
    transform = build_train_transform(s["height"], s["width"], seed=rank,
                                      defer_normalize=defers_normalize(normalize_on, device))
    dataset = ReIDImageDataset(split.records, split.labels, transform=transform)
    box: dict = {}
    bare_loop(model, dataset, 32, workers, precision, device, 0, box, graphs)  # warm-up: workers, graph
    barrier.wait()
    t0, images = time.perf_counter(), 0
    for epoch in range(epochs):
        images += bare_loop(model, dataset, 32, workers, precision, device, epoch + 1, box, graphs)[0]
    results.put((rank, t0, time.perf_counter(), images))


def section_data_processes(device: torch.device, s: dict[str, Any], scale: str, tmp: Path, counts: list[int],
                           workers_total: int, precision_name: str, graph_settings: list[bool],
                           normalize_on: str, epochs: int = 5) -> None:
    """(g): (b)'s bare data-inclusive loop in N processes at once, the loader workers split over them.

    What one card and this host give N clients that do nothing but train: the bound of (c)'s img/s for
    the data path as it is, with no federated work around the steps.
    """

    ensure_world(s, tmp)
    say(f"(g) (b)'s bare data-inclusive loop (Market-1501 client, batch 32, precision {precision_name}) in N processes at once, "
        f"{workers_total} loader workers split over them, {epochs} epochs each after a warm-up one: aggregate img/s "
        "over the span from the first start to the last end")
    say(f"    {'processes':>9} {'workers':>8} {'graphs':>7} {'img/s':>9} {'per process':>12}")
    for graphs in graph_settings:
        for n in counts:
            workers = max(1, workers_total // n)
            total = _all_at_once(n, _process_data_loop, (scale, device.type, graphs, workers, epochs, precision_name,
                                                         normalize_on, str(tmp)))
            say(f"    {n:>9} {workers:>8} {str(graphs):>7} "
                + (f"{total:>9,.0f} {total / n:>12,.0f}" if total else "failed"))


# --------------------------------------------------------------------------- (d)

def section_eval(device: torch.device, s: dict[str, Any]) -> None:
    try:
        from gpu_eval import run_eval_bench
    except ImportError as exc:
        say(f"(d) skipped: {exc}")
        return
    n_q, n_g, dim = s["eval"]
    out = run_eval_bench(device.type, n_q, n_g, dim)
    say(f"(d) exact evaluation {n_q} x {n_g} x {dim} on {device.type}: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))


# --------------------------------------------------------------------------- (f)

def section_eval_precision(device: torch.device, s: dict[str, Any], tmp: Path, workers: int,
                           repeats: int = 3) -> None:
    """(f) one evaluation of (c)'s world per arithmetic, with an untrained model (speed and agreement only)."""
    ensure_world(s, tmp)
    cfg = round_config(s, tmp, world_overrides(s))
    names = cfg.data.dataset_names()
    sets = {name: load_prepared(tmp / "c-prepared", name) for name in names}
    images = sum(len(ds.split(split)) for ds in sets.values() for split in ("query", "gallery"))
    model = create_reid_model(s["backbone"], 0, pretrained=None, seed=0).to(device)
    cuda = device.type == "cuda"
    say(f"(f) evaluation of (c)'s world: {images} query and gallery images in {len(names)} datasets, flipped, "
        f"{s['backbone']} {s['height']}x{s['width']} (untrained), batch {cfg.eval.batch_size}, {workers} loader "
        f"workers, deterministic; median of {repeats if cuda else 1} after one warm-up; min_cos: the smallest cosine between an "
        "image's feature and its fp32 feature")
    say("    " + " ".join(f"{c:>10}" for c in ("arithmetic", "eval_s", "img/s", "mean_mAP", "min_cos")))
    rows = [("fp32", False), ("fp32", True), ("bf16", False)] if cuda else [("fp32", False), ("bf16", False)]
    exact: dict = {}
    with deterministic_mode(True):
        for name, tf32 in rows:
            set_tf32(tf32)
            try:
                ev = Evaluator(sets, height=s["height"], width=s["width"], batch_size=cfg.eval.batch_size,
                               device=device, workers=workers, precision=name)
                features = ev.split_features(model, names)  # also the warm-up: workers start, kernels are picked
                seconds, result = [], {}
                for _ in range(repeats if cuda else 1):  # bf16 on a CPU without it is ~10x slower than fp32
                    sync(device)
                    t0 = time.perf_counter()
                    result = ev(model)
                    sync(device)
                    seconds.append(time.perf_counter() - t0)
            finally:
                set_tf32(False)
            exact = exact or features
            cos = min(float((features[k] * exact[k]).sum(dim=1).min()) for k in features)
            wall = statistics.median(seconds)
            mean_map = statistics.mean(float(r["mAP"]) for r in result.values())
            label = "tf32" if tf32 else name
            say("    " + " ".join(f"{v:>10}" for v in (label, f"{wall:.2f}", f"{images / wall:.0f}",
                                                       f"{mean_map:.4f}", f"{cos:.5f}")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--scale", choices=sorted(SCALES), default=None,
                    help="tiny (CPU default) or full (CUDA default: ResNet-50 at 256x128)")
    ap.add_argument("--sections", default="abcd",
                    help="which sections to run, in this order, e.g. 'aecf' (default: abcd)")
    ap.add_argument("--concurrent", default="1,2,4,8", help="run.concurrent_clients values of (c)")
    ap.add_argument("--processes", default="1,2,4,8", help="process counts of (e) and (g)")
    ap.add_argument("--workers", type=int, default=None,
                    help="loader workers in all (split over concurrent clients; default: CPU cores, at most 16)")
    ap.add_argument("--precision", default="auto", help="train.precision of (b) and (c) (default auto)")
    ap.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="both",
                    help="train.cuda_graphs of (b), (c) and (e), and (a)'s graph rows; CUDA only (default both)")
    ap.add_argument("--local-epochs", type=int, default=1,
                    help="train.local_epochs of (c) (default 1, FedPav's; the fedpav_e5 config's 5 shows the "
                         "steady state, a round's fixed costs spread over more steps)")
    ap.add_argument("--normalize-on", default="auto",
                    help="train.normalize_on of (b) and (c), comma-separated to compare, e.g. 'worker,device' "
                         "(default auto: device on CUDA)")
    ap.add_argument("--client-repeats", type=int, default=5,
                    help="(b): pairs of runs (Client.fit, bare loop), in ABBA order, after one warm-up each (default 5)")
    ap.add_argument("--profile", action="store_true",
                    help="(b): then one run of each under torch.profiler: device busy time and the costliest ops")
    ap.add_argument("--no-demo", action="store_true", help="(c) without the demo world's 3-round run")
    ap.add_argument("--no-determinism-row", action="store_true",
                    help="(c) without its run.deterministic=false row")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scale = args.scale or ("full" if device.type == "cuda" else "tiny")
    s = SCALES[scale]
    workers = args.workers if args.workers is not None else min(16, os.cpu_count() or 1)
    # CUDA graphs exist only on CUDA: elsewhere every setting runs once, eagerly
    graph_settings = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    if device.type != "cuda":
        graph_settings = [False]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say(f"device {name}, torch {torch.__version__}, {torch.get_num_threads()} threads, scale {scale}")

    normalize_settings = args.normalize_on.split(",")
    for where in normalize_settings:
        defers_normalize(where, device)  # a wrong value stops here, before any section runs

    def client(tmp: Path) -> None:
        for graphs in graph_settings:
            for where in normalize_settings:
                section_client(device, s, tmp, min(workers, 8), args.precision, graphs, where,
                               repeats=args.client_repeats, profile=args.profile)

    sections: dict[str, Callable[[Path], None]] = {
        "a": lambda tmp: section_ceilings(device, s, graph_rows=True in graph_settings),
        "b": client,
        "c": lambda tmp: section_rounds(device, s, tmp, [int(x) for x in args.concurrent.split(",")], workers,
                                        args.precision, graph_settings, demo_run=not args.no_demo,
                                        local_epochs=args.local_epochs,
                                        determinism_row=not args.no_determinism_row,
                                        normalize_settings=normalize_settings),
        "d": lambda tmp: section_eval(device, s),
        "e": lambda tmp: section_processes(device, scale, [int(x) for x in args.processes.split(",")],
                                           graph_settings),
        "f": lambda tmp: section_eval_precision(device, s, tmp, workers),
        "g": lambda tmp: section_data_processes(device, s, scale, tmp, [int(x) for x in args.processes.split(",")],
                                                workers, args.precision, graph_settings, normalize_settings[0]),
    }
    with tempfile.TemporaryDirectory(prefix="fedreid-gpu-round-") as tmp:
        for key in args.sections:
            t0 = time.perf_counter()
            try:
                sections[key](Path(tmp))
            except Exception as exc:  # one failed section must not cost the others' figures
                say(f"    section {key} failed: {type(exc).__name__}: {exc}")
            say(f"    [{key}: {time.perf_counter() - t0:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
