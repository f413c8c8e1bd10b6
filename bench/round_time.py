"""Time and bytes per federated round of a config (default: the synthetic demo).

Generates and prepares the synthetic world into a temp folder (data.raw_root,
data.prepared_root, synthetic.root and run.out_dir are pointed there), runs
``run_simulation`` with ``eval.every`` set so large that only the last round
evaluates, and prints per round, from the history records' ``time`` and
``comm`` entries: client training (``time_train`` summed over clients), CDW
and KD-feature seconds spent in clients, whole client fits, aggregation,
server KD, evaluation, the round's wall time, and the MiB sent to / received
from the clients; plus the model's shared-state size.

    python bench/round_time.py [--config configs/fedreid/demo_synthetic.yaml] [--rounds 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.config import load_config  # noqa: E402
from fedreid.data.prepared import prepare_dataset, synthetic_world  # noqa: E402
from fedreid.data.raw import create_raw_dataset  # noqa: E402
from fedreid.data.synthetic import generate_world  # noqa: E402
from fedreid.fl.simulation import run_simulation  # noqa: E402
from fedreid.fl.state import state_nbytes  # noqa: E402
from fedreid.models.reid import create_reid_model, shared_state  # noqa: E402

MIB = 2**20


def prepare_synthetic(cfg) -> None:
    """What ``tools/prepare_datasets.py --synthetic`` does, quietly."""
    names = cfg.data.dataset_names()
    public = cfg.fl.public_dataset or cfg.data.public_dataset
    if public and public not in names:
        names.append(public)
    s = cfg.synthetic
    generate_world(s.root, datasets=names, id_scale=s.id_scale, min_ids=s.min_ids,
                   images_per_camera=s.images_per_camera, height=s.height, width=s.width, seed=s.seed)
    options = (synthetic_world(s.root) or {}).get("parser_options", {})
    for name in names:
        parser = create_raw_dataset(name, s.root, seed=cfg.data.split_seed,
                                    **{**options.get(name, {}), **cfg.data.options.get(name, {})})
        prepare_dataset(parser, cfg.data.prepared_root, resize=cfg.data.resize,
                        workers=cfg.data.workers, progress=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/fedreid/demo_synthetic.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="key.sub=value")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fedreid-round-") as tmp:
        tmp = Path(tmp)
        cfg = load_config(args.config, [
            f"data.raw_root={tmp / 'raw'}", f"synthetic.root={tmp / 'raw'}",
            f"data.prepared_root={tmp / 'prepared'}", f"run.out_dir={tmp / 'run'}",
            f"fl.rounds={args.rounds}", "eval.every=1000000000", *args.overrides,
        ])
        t0 = time.perf_counter()
        prepare_synthetic(cfg)
        print(f"data: synthetic world generated + prepared in {time.perf_counter() - t0:.1f}s")

        m = cfg.model  # sizes do not depend on the weights: no pretrained file needed
        model = create_reid_model(m.backbone, 0, pretrained=None, last_stride=m.last_stride,
                                  bottleneck_dim=m.bottleneck_dim, dropout=m.dropout, seed=0)
        shared_mib = state_nbytes(shared_state(model)) / MIB

        t0 = time.perf_counter()
        history = run_simulation(cfg, Path(cfg.run.out_dir), progress=False)
        total = time.perf_counter() - t0

    print(f"config {args.config} (+ overrides), {len(history)} rounds, {len(history[0]['clients'])} clients, "
          f"backbone {m.backbone} {m.height}x{m.width}, batch {cfg.train.batch_size}, "
          f"cdw={cfg.fl.cdw} kd={cfg.fl.kd} (every {cfg.fl.kd_every})")
    print(f"shared state: {shared_mib:.2f} MiB")
    cols = ("round", "train_s", "cdw_s", "kdfeat_s", "fit_s", "agg_s", "kd_s", "eval_s", "round_s",
            "sent_MiB", "recv_MiB", "meta_MiB")
    print(" ".join(f"{c:>9}" for c in cols))
    for rec in history:
        t, c = rec["time"], rec["comm"]
        per = t.get("clients", {}).values()

        def csum(key):
            return sum(v.get(key, 0.0) for v in per)

        row = [rec["round"], csum("time_train"), csum("time_cdw"), csum("time_kd_features"),
               csum("time_fit"), t.get("aggregate", 0.0), t.get("kd", 0.0), t.get("eval", 0.0),
               t.get("round", 0.0), c["sent_bytes"] / MIB, c["received_bytes"] / MIB,
               c["metadata_bytes"] / MIB]
        print(f"{row[0]:>9d} " + " ".join(f"{x:>9.2f}" for x in row[1:]))
    print(f"run_simulation total: {total:.1f}s (includes building the federation and checkpoints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
