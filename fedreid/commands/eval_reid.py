"""Evaluate a trained ReID model, index a gallery folder, query an index.

Examples:
  # Rank-1/5/10 and mAP of a run's final model on its evaluation datasets
  # (prepared root and datasets default to the run's config.yaml)
  python tools/eval_reid.py evaluate --model runs/fedpav

  # chosen datasets, official (Market-1501 MATLAB) AP, re-ranking, cached features
  python tools/eval_reid.py evaluate --model runs/fedpav/model_final.pt \\
      --datasets market1501,dukemtmc --prepared-root datasets/prepared \\
      --ap official --rerank --save-features runs/fedpav/features

  # evaluate again from the cached features, without the model; draw two chosen
  # queries (an index and a prepared query image's file name) besides the best/worst ones
  python tools/eval_reid.py evaluate --features runs/fedpav/features/market1501.npz --out /tmp/eval \\
      --queries 12,000206_11_c0.jpg

  # the old CUHK03 single-gallery-shot CMC (10 seeded samplings)
  python tools/eval_reid.py evaluate --model runs/fedpav --datasets cuhk03np --protocol cuhk03 --seed 0

  # a gallery store of a folder of images (exact search), then search it
  python tools/eval_reid.py index --model runs/fedpav --gallery photos/gallery --index runs/fedpav/index
  python tools/eval_reid.py query --model runs/fedpav --index runs/fedpav/index --images photos/query --top-k 10

  # an approximate index for a large gallery, its recall checked, nprobe tuned for recall@10 >= 0.95
  python tools/eval_reid.py index --model runs/fedpav --gallery photos/gallery --index big \\
      --factory IVF1024,PQ64 --site lobby --target-recall 0.95
  # add a folder, erase items (no model needed), search cameras 1 and 2 of one day
  python tools/eval_reid.py index --model runs/fedpav --index big --add photos/monday --site lobby
  python tools/eval_reid.py index --index big --remove 17 0002_c1s1_000451_01.jpg
  python tools/eval_reid.py query --model runs/fedpav --index big --images photos/query \\
      --cameras 1,2 --since 2024-05-01 --until 2024-05-01T23:59:59

  # the model's retrieval feature as an ONNX (or TorchScript) file, plus its sidecar fedpav.onnx.json
  python tools/eval_reid.py export --model runs/fedpav --format onnx --out fedpav.onnx
  python tools/eval_reid.py export --model runs/fedpav --format torchscript --out fedpav.ts --height 256 --width 128
  # index and query with the exported file (ONNX Runtime on the CPU, no PyTorch needed); the index
  # records the backend and the file's SHA-256, so its queries use the same file
  python tools/eval_reid.py index --backend onnx --model fedpav.onnx --gallery photos/gallery --index idx_onnx
  python tools/eval_reid.py query --backend onnx --model fedpav.onnx --index idx_onnx --images photos/query

--model is a run folder (its model_final.pt, else its checkpoint.pt), a
model_final.pt or a checkpoint.pt. Features are the flip-averaged
(evaluate: unless eval.flip=false), L2-normalised embeddings; the device is
CUDA when available (with --backend onnx or torchscript it is the CPU, and
onnx needs no PyTorch). evaluate extracts in the config's eval.precision
(fp32 unless the run set another, the arithmetic of the run's own
evaluation); --precision bf16|fp16|auto changes it (--amp is --precision
fp16; fp16 needs CUDA), in channels-last on CUDA unless --no-channels-last,
and results.json records it. The model file decides the architecture and
input size: a model.* key set otherwise is refused. On CUDA index and query
use float16 autocast (--amp) and channels-last tensors and weights
(--channels-last) unless --no-amp / --no-channels-last; on the CPU they are
off, and asking for them there is an error. --faiss-gpu on puts
FAISS work on the GPU (an error when faiss has no GPU support or sees no
GPU): index trains an IVF factory's k-means there, query searches a Flat
store there (filtered searches and other factories stay on the CPU); off
keeps the CPU; auto (default) uses the GPU when faiss-gpu sees one and the
device is CUDA.

evaluate writes to --out (default <run folder>/eval, and then the run's
report.md gains a retrieval section): results.json, cmc.png
(rank 1-20), and ranked_lists/<dataset>_{best,worst}_q<index>.png: for each
dataset the --pictures queries (default 3) with the highest AP (half, rounded
up) and the lowest AP (the rest), green frames for true matches, red for
wrong ones, after the usual junk/same-camera filter; --queries A,B,...
draws chosen queries too, as ranked_lists/<dataset>_query_q<index>.png: a
query index (applied to every dataset) or a query image path or file name
(from the dataset's query manifest). --protocol cuhk03 reports the old
CUHK03 single-gallery-shot CMC (one random gallery image per identity, 10
samplings from --seed, default the config's seed) with the standard mAP.
results.json records the model file and round the features came from; the
run's report.md shows it as the final model's numbers only when they are
that model's (else it says whose they are). A run's report is rewritten only
in a folder marked as a fedreid run (.fedreid-run.json).

A features file (--save-features DIR writes DIR/<dataset>.npz) holds the
query and gallery features of one dataset; pass it back as --features FILE
or NAME=FILE (comma-separated or repeated for several datasets). An item that
is an existing file is a file (its path may hold '='); otherwise NAME=FILE
splits at the first '='. NAME must be the dataset the file holds, each
dataset may come once, and all files must come from one model (a file
whose meta names no model is named in a WARNING line when evaluated with
others). --datasets, --prepared-root, --batch-size, --save-features,
--precision, --amp, --channels-last, --device and --client act on a model's
extraction, and are refused with --features. Every option is checked before
any feature is extracted or any folder made: a refused call leaves nothing.

index, query, serve and export: `eval_reid.py <command> --help`. Every output
folder (evaluate's --out and --save-features, index's --index, query's --out)
must be new, empty, or one these commands made; anything else is refused and
left untouched (docs/retrieval-safety.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

from fedreid.commands.eval_args import (
    add_precision_arguments,
    add_progress_argument,
    evaluation_precision,
    refuse_extraction_options,
)
from fedreid.commands.eval_gallery import add_index_command, add_query_command
from fedreid.commands.eval_serve import add_serve_command
from fedreid.config import apply_overrides, load_config, read_yaml
from fedreid.eval import protocols
from fedreid.eval.pipeline import (
    CMC_PLOT,
    EVAL_KIND,
    check_feature_sets,
    check_queries,
    claim_eval_dir,
    evaluate_and_report,
    unrecorded_models,
)
from fedreid.eval.report import EVAL_DIR, RESULTS_FILE, format_table, write_report
from fedreid.inference import devices
from fedreid.inference.dataset_features import (
    DatasetFeatures,
    claim_features_dir,
    dataset_features,
    load_dataset_features,
    resolve_datasets,
    save_dataset_features,
)
from fedreid.inference.errors import EvalInputError
from fedreid.inference.model_io import find_model_file, load_model, refuse_other_model_settings, run_config_path
from fedreid.utils.cli import (
    add_config_arguments,
    checked_overrides,
    count_int,
    positive_float,
    positive_int,
    run_main,
    show_progress,
)
from fedreid.utils.io import marker_path, owns_folder
from fedreid.utils.logging import METRICS_JSONL, add_pictures, read_metrics

EVALUATE_EXAMPLES = """Examples:
  # Rank-1/5/10, mAP and mINP of a run's final model on its evaluation datasets (its config.yaml's)
  python tools/eval_reid.py evaluate --model runs/fedpav

  # chosen datasets, official (Market-1501 MATLAB) AP, re-ranking, features cached for later
  python tools/eval_reid.py evaluate --model runs/fedpav/model_final.pt --datasets market1501,dukemtmc \\
      --ap official --rerank --save-features runs/fedpav/features

  # again from the cached features, without the model
  python tools/eval_reid.py evaluate --features runs/fedpav/features/market1501.npz --out /tmp/eval

  # one client's own model of a local-training baseline
  python tools/eval_reid.py evaluate --model runs/local --client market1501
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{evaluate,index,query,serve,export}")

    ev = sub.add_parser("evaluate", help="CMC/mAP on prepared datasets", description="CMC/mAP on prepared datasets",
                        epilog=EVALUATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="run folder, model_final.pt or checkpoint.pt")
    source.add_argument(
        "--features", action="append", metavar="[NAME=]FILE",
        help="features file(s) saved by --save-features (comma-separated or repeated)",
    )
    ev.add_argument("--datasets", metavar="A,B|all", help="datasets to evaluate (default: eval.datasets, else data.datasets)")
    ev.add_argument("--prepared-root", metavar="DIR", help="prepared datasets root (data.prepared_root)")
    ev.add_argument("--ap", choices=("standard", "official"), help="AP definition (eval.ap)")
    ev.add_argument("--rerank", action="store_true", help="k-reciprocal re-ranking (k1=20, k2=6, lambda=0.3)")
    ev.add_argument("--rerank-memory", type=positive_float, metavar="GIB",
                    help="with --rerank: the memory re-ranking may take, in GiB (default 4); a dataset that needs "
                    "more is refused before anything is extracted (its N x N distances: MSMT17 needs about 40)")
    ev.add_argument("--batch-size", type=positive_int, metavar="N", help="images per batch (eval.batch_size)")
    ev.add_argument("--save-features", metavar="DIR", help="write DIR/<dataset>.npz for later --features runs")
    ev.add_argument(
        "--pictures", type=count_int, default=3, metavar="N", help="best/worst-AP ranked-list PNGs per dataset (default 3)"
    )
    ev.add_argument(
        "--queries", action="append", metavar="Q[,Q...]",
        help="also draw these queries: indices and/or query image paths or file names (comma-separated or repeated)",
    )
    ev.add_argument(
        "--protocol", choices=protocols.EVAL_PROTOCOLS.keys(), default="standard", help=protocols.protocol_help(),
    )
    ev.add_argument("--seed", type=int, metavar="N", help="seed of --protocol cuhk03 (default: the config's seed)")
    ev.add_argument("--out", metavar="DIR", help="output folder (default: <run folder>/eval)")
    ev.add_argument("--device", help="auto (default: cuda if available), cpu, cuda, cuda:1...")
    ev.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to evaluate")
    add_precision_arguments(ev)
    add_progress_argument(ev)
    add_config_arguments(ev)

    add_index_command(sub)
    add_query_command(sub)
    add_serve_command(sub)

    ex = sub.add_parser(
        "export", help="write the model's feature extractor as ONNX or TorchScript",
        description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("--model", required=True, metavar="PATH", help="run folder, model_final.pt or checkpoint.pt")
    ex.add_argument("--format", required=True, choices=("onnx", "torchscript"), help="file format")
    ex.add_argument("--out", required=True, metavar="FILE", help="the file to write (and FILE.json beside it)")
    ex.add_argument("--height", type=positive_int, metavar="H", help="input height (default: the model config's)")
    ex.add_argument("--width", type=positive_int, metavar="W", help="input width (default: the model config's)")
    ex.add_argument("--opset", type=int, default=17, metavar="N", help="ONNX opset (default 17)")
    ex.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to export")
    return parser

EXPORT_HELP = """Write the model's retrieval feature as an ONNX or TorchScript file.

The file maps images [batch, 3, H, W] (float32: RGB resized to H x W, ImageNet
mean/std, as index/query feed the model; batch size free) to features [batch, d]:
embed(image) + embed(flipped image), L2-normalised, the features index/query
compute with PyTorch. FILE.json beside it records the input size, the model
fingerprint and FILE's SHA-256; the file is only loaded back with a matching
FILE.json (a TorchScript file is a program: load only files this tool wrote).
An existing FILE is replaced only when it is an earlier export (matching
FILE.json); anything else there is refused and left untouched.

Examples:
  python tools/eval_reid.py export --model runs/fedpav --format onnx --out fedpav.onnx
  python tools/eval_reid.py export --model runs/fedpav/model_final.pt --format torchscript --out fedpav.ts
  python tools/eval_reid.py export --model runs/fedpav --format onnx --out small.onnx --height 128 --width 64
"""

def _comma_list(items: list[str] | None) -> list[str]:
    return [x.strip() for x in ",".join(items or []).split(",") if x.strip()]


def _feature_files(items: list[str]) -> list[tuple[str | None, str]]:
    """``--features`` items (comma-separated) as ``(NAME or None, FILE)``.

    An item that is an existing file is a file, whatever ``=`` its path holds
    (``runs/lr=0.1/features/market1501.npz``); otherwise ``NAME=FILE`` splits
    at the first ``=``, and FILE must exist. An item that is neither is an
    :class:`EvalInputError` naming it.
    """
    pairs: list[tuple[str | None, str]] = []
    for item in (x.strip() for x in ",".join(items).split(",")):
        if not item:
            continue
        name, eq, file = item.partition("=")
        if Path(item).is_file():
            pairs.append((None, item))
        elif eq and name and Path(file).is_file():
            pairs.append((name, file))
        else:
            why = f", nor NAME=FILE with an existing FILE ({file} does not exist)" if eq and name else ""
            raise EvalInputError(f"--features {item}: not an existing file{why}")
    return pairs


def _protocol_options(args: argparse.Namespace, cfg) -> tuple[str, int]:
    """``(ap, seed)`` of the evaluation, once ``--protocol``, the AP form and ``--rerank`` are checked together.

    A protocol may report some AP forms only (cuhk03: the standard AP): an
    explicit ``--ap`` is refused there, a config's ``eval.ap`` is not the
    user's request for this protocol.
    """
    protocol = protocols.EVAL_PROTOCOLS.get(args.protocol, where="--protocol")
    ap = args.ap or protocol.default_ap(cfg.eval.ap)
    protocols.check_protocol(args.protocol, ap, args.rerank)
    return ap, (cfg.seed if args.seed is None else args.seed)


def _rerank_max_bytes(args: argparse.Namespace) -> int:
    """``--rerank-memory`` in bytes (default 4 GiB); refused without ``--rerank``."""
    from fedreid.eval.rerank import DEFAULT_MAX_BYTES

    if args.rerank_memory is None:
        return DEFAULT_MAX_BYTES
    if not args.rerank:
        raise EvalInputError("--rerank-memory applies to --rerank only")
    return int(args.rerank_memory * 2**30)


def _check_rerank_sizes(sets: Sequence[DatasetFeatures], max_bytes: int) -> None:
    """Refuse ``--rerank`` on a dataset too large to re-rank, before anything is extracted or written."""
    from fedreid.eval.rerank import RerankMemoryError, check_rerank_memory

    for fs in sets:
        name = fs.name
        try:
            check_rerank_memory(fs.query.features.shape[0], fs.gallery.features.shape[0], max_bytes=max_bytes)
        except RerankMemoryError as exc:
            raise EvalInputError(f"--rerank on {name}: {exc.needs}, above --rerank-memory {max_bytes / 2**30:g} GiB; "
                                 f"raise it where the machine has that much free memory, or evaluate {name} "
                                 "without --rerank") from None


def _manifest_sets(root: str | Path, name: str) -> DatasetFeatures:
    """Prepared dataset ``name``'s query and gallery as its manifest lists them, without features (zero columns).

    What ``--queries`` (:func:`check_queries`) and ``--rerank``'s sizes are
    checked against before any feature is extracted: the images in the order,
    and with the paths, that :func:`dataset_features` gives them.
    """
    import numpy as np

    from fedreid.data.prepared import load_prepared
    from fedreid.inference.features import FeatureSet

    ds = load_prepared(root, name)
    sets = []
    for split in ("query", "gallery"):
        paths = [str(r.path) for r in ds.split(split)]
        sets.append(FeatureSet(np.zeros((len(paths), 0), np.float32), None, None, paths))
    return DatasetFeatures(name, *sets)


def _claim_output_folders(out: Path, features_dir: str | None) -> Callable[[], None]:
    """Claim ``--out``, then ``--save-features``; when the second is refused the first is put back as it was.

    The same folder for both is refused first. Putting ``--out`` back removes
    only what its claim added: its marker, and the folders it created (only
    while they are empty), so a refused call leaves nothing behind. Returns
    that undo, for a call that fails later (a damaged image met while
    extracting): it then leaves ``--out`` as it was, unless something was
    written there since.
    """
    if features_dir is not None and out.resolve() == Path(features_dir).resolve():
        raise EvalInputError(
            f"--out and --save-features name the same folder ({out}): the results and the feature caches "
            "go to separate folders; choose another for one of them"
        )
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first: what the claim will make
    marker = marker_path(out, EVAL_KIND)
    marked = marker.exists()

    def undo() -> None:
        if marked or any(p != marker for p in out.iterdir()):
            return  # the marker was there before, or results were written since: the folder stays
        marker.unlink(missing_ok=True)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # not empty (someone else's file): it stays
                break

    claim_eval_dir(out)
    if features_dir is not None:
        try:
            claim_features_dir(features_dir)
        except BaseException:
            undo()
            raise
    return undo


def _warn_unrecorded_models(names: list[str], files: dict[str, str]) -> None:
    """One WARNING line naming the feature files that record no model (:func:`unrecorded_models`)."""
    if names:
        shown = ", ".join(files[n] for n in names)
        verb = "records" if len(names) == 1 else "record"
        print(f"WARNING: feature file{'s' if len(names) > 1 else ''} {shown} {verb} no model (an earlier fedreid's "
              f"cache?): the mean over the {len(files)} datasets cannot be checked to come from one model", flush=True)


def _without_match_line(rows: dict[str, dict]) -> str | None:
    """The line after the table on queries without a true match; None when every query has one.

    The standard AP (and the CUHK03 protocol) leaves them out of Rank-k and
    mAP; ``--ap official`` scores them 0 and averages over all queries
    (FedReID's evaluate.py). The counts of each row say which.
    """
    counted = {name: row for name, row in rows.items() if row.get("num_queries_without_match")}
    if not counted:
        return None
    hows = {name: ("left out of Rank-k and mAP" if row["num_valid_queries"] < row["num_queries"]
                   else "scored 0 in Rank-k and mAP") for name, row in counted.items()}
    one = len(set(hows.values())) == 1
    parts = [f"{name} {row['num_queries_without_match']} of {row['num_queries']}" + ("" if one else f" ({hows[name]})")
             for name, row in counted.items()]
    return "queries without a true match: " + ", ".join(parts) + (f" ({next(iter(hows.values()))})" if one else "")


def _refuse_other_model_settings(loaded, cfg, config_file, overrides: Sequence[str]) -> None:
    """The ``model.*`` keys that ``config_file`` or ``overrides`` set must agree with the model file's own."""
    explicit = apply_overrides(read_yaml(config_file) if config_file else {}, overrides).get("model") or {}
    overridden = {item.partition("=")[0].strip() for item in overrides}
    where = {key: (f"override model.{key}" if f"model.{key}" in overridden else f"config file {config_file}")
             for key in explicit}
    refuse_other_model_settings(loaded, {key: getattr(cfg.model, key) for key in explicit
                                         if hasattr(cfg.model, key)}, where)


def cmd_evaluate(args: argparse.Namespace) -> int:
    # Every check comes first: no folder is created or marked and no feature extracted until all pass,
    # so a refused call leaves nothing behind.
    queries = _comma_list(args.queries)
    rerank_bytes = _rerank_max_bytes(args)
    if args.features:
        refuse_extraction_options(args)
        pairs = _feature_files(args.features)
        feats = [load_dataset_features(f, name) for name, f in pairs]
        check_feature_sets(feats)
        cfg = load_config(args.config, checked_overrides(args))
        ap, seed = _protocol_options(args, cfg)
        check_queries(feats, queries)
        if args.rerank:
            _check_rerank_sizes(feats, rerank_bytes)
        source = ", ".join(f for _, f in pairs)
        out = Path(args.out or Path(pairs[0][1]).parent / EVAL_DIR)
        _claim_output_folders(out, None)
        _warn_unrecorded_models(unrecorded_models(feats), {fs.name: f for (_, f), fs in zip(pairs, feats)})
    else:
        model_file = find_model_file(args.model)
        run_cfg = run_config_path(args.model)
        cfg = load_config(run_cfg, args.overrides) if run_cfg and not args.config else load_config(args.config, checked_overrides(args))
        device = devices.resolve_device(args.device or "auto")
        precision = evaluation_precision(args, cfg.eval.precision, device)
        loaded = load_model(model_file, device, client=args.client)  # a broken model file is named before datasets
        _refuse_other_model_settings(loaded, cfg, run_cfg if run_cfg and not args.config else args.config,
                                     args.overrides)
        root = args.prepared_root or cfg.data.prepared_root
        names = args.datasets.split(",") if args.datasets else (cfg.eval.datasets or cfg.data.dataset_names())
        names = [n.strip() for n in names if n.strip()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise EvalInputError(f"--datasets names {twice!r} twice: each dataset is evaluated once")
        names = resolve_datasets(names, root)
        ap, seed = _protocol_options(args, cfg)
        if queries or args.rerank:  # from the manifests, each read once
            listed = [_manifest_sets(root, name) for name in names]
            check_queries(listed, queries)
            if args.rerank:
                _check_rerank_sizes(listed, rerank_bytes)
        out = Path(args.out or model_file.parent / EVAL_DIR)
        undo_claim = _claim_output_folders(out, args.save_features)  # both refused when they hold the user's files
        feats = []
        batch_size = args.batch_size or cfg.eval.batch_size
        try:
            for name in names:
                print(f"extracting features: {name} ({precision.name})", flush=True)
                fs = dataset_features(loaded, root, name, batch_size=batch_size, device=device, precision=precision,
                                      progress=show_progress(args), flip=cfg.eval.flip)
                if args.save_features:
                    print(f"  saved {save_dataset_features(args.save_features, fs)}")
                feats.append(fs)
        except BaseException:
            undo_claim()
            raise
        source = str(model_file)
    report = evaluate_and_report(
        feats, out, ap=ap, rerank=args.rerank, pictures=args.pictures, queries=queries,
        protocol=args.protocol, seed=seed, source=source, rerank_max_bytes=rerank_bytes,
    )
    what = f"{report['ap']} AP" + protocols.build_protocol(args.protocol).describe(seed)
    print(f"\n{'Re-ranked r' if args.rerank else 'R'}esults ({what}), in %:\n")
    print(format_table(report["datasets"]))
    without_match = _without_match_line(report["datasets"])
    if without_match:
        print(without_match)
    print(f"results: {out / RESULTS_FILE}\ncmc plot: {out / CMC_PLOT}")
    print(f"ranked lists: {len(report['pictures'])} in {out / 'ranked_lists'}")
    run_dir = out.parent
    if out.name == EVAL_DIR and (run_dir / METRICS_JSONL).is_file():
        from fedreid.fl.simulation import RUN_KIND  # here: importing it imports torch

        if not owns_folder(run_dir, RUN_KIND):  # a metrics.jsonl of the user's: their report.md stays theirs
            print(f"report: not written, {run_dir} is not a fedreid run folder "
                  f"(no {marker_path(run_dir, RUN_KIND).name})")
            return 0
        history = read_metrics(run_dir)
        add_pictures(run_dir, [out / p for p in (*report["pictures"], report["cmc_plot"])],
                     int(history[-1]["round"]) if history else 0)
        print(f"report: {write_report(run_dir, history)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fedreid.inference.export import export_model, sidecar_path

    loaded = load_model(args.model, "cpu", client=args.client)
    height = args.height or int(loaded.config.get("height", 256))
    width = args.width or int(loaded.config.get("width", 128))
    out = export_model(loaded, args.out, args.format, (height, width), opset=args.opset)
    print(f"exported {loaded.source} as {args.format} ({height}x{width}, dynamic batch) to {out}")
    print(f"sidecar: {sidecar_path(out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"evaluate": cmd_evaluate, "export": cmd_export}.get(args.command, getattr(args, "func", None))
    return command(args)


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
