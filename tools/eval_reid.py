#!/usr/bin/env python
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
  # queries (an index and a query image file name) besides the best/worst ones
  python tools/eval_reid.py evaluate --features runs/fedpav/features/market1501.npz --out /tmp/eval \
      --queries 12,0001_c1s1_001051_00.jpg

  # the old CUHK03 single-gallery-shot CMC (10 seeded samplings)
  python tools/eval_reid.py evaluate --model runs/fedpav --datasets cuhk03np --protocol cuhk03 --seed 0

  # a FAISS index of a folder of images, then search it
  python tools/eval_reid.py index --model runs/fedpav --gallery photos/gallery --index runs/fedpav/index
  python tools/eval_reid.py query --model runs/fedpav --index runs/fedpav/index --images photos/query --top-k 10

--model is a run folder (its model_final.pt, else its checkpoint.pt), a
model_final.pt or a checkpoint.pt. Features are the flip-averaged,
L2-normalised embeddings; the device is CUDA when available. On CUDA the
extraction uses float16 autocast (--amp) and channels-last tensors and
weights (--channels-last) unless --no-amp / --no-channels-last; on the CPU
they are off, and asking for them there is an error. index/query put the
FAISS index on the GPU with --faiss-gpu on (an error when faiss has no GPU
support or sees no GPU), keep it on the CPU with off; auto (default) uses the
GPU when faiss-gpu sees one and the device is CUDA.

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
samplings from --seed, default the config's seed) with the standard mAP. A features file
(--save-features DIR writes DIR/<dataset>.npz) holds the query and gallery
features of one dataset; pass it back as --features FILE or NAME=FILE
(comma-separated or repeated for several datasets).

index/query read Market-style names (^<pid>_c<camera>, e.g. 0002_c1s1_000451_01.jpg)
for identities; other images get -1. query prints each image's top-k (rank,
score, path) and, with --out, draws one PNG per query: green/red frames where
both identities are known, grey otherwise.

Safety: every output folder (evaluate's --out and --save-features, index's
--index, query's --out) must be new, empty, or one these commands made
(marked .fedreid-<kind>.json; the folders of an earlier fedreid are
recognised and adopted); a folder holding anything else, and an index folder
in the gallery folder, is refused and left untouched. An index folder is
replaced as a whole: an interrupted index leaves the old index or the new. The index header records the size and SHA-256 of each index file
(checked before faiss reads them) and the model's fingerprint (weights
SHA-256, backbone, input size, feature kind): query with another model is
refused, naming the fields that differ, unless --allow-model-mismatch, which
searches anyway and prints a WARNING line first. Model files are only read
as tensors (torch.load weights_only), feature files and index files without
pickles: nothing in them runs. An unreadable image stops index/query, naming
it; with --skip-bad-images it is left out and listed (path, reason) in
skipped.csv of the index folder (index) or of --out (query; printed without
--out). Features that are NaN/inf, all zero or all identical are an error
naming the model or file they came from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedreid.config import load_config
from fedreid.eval import pipeline as pl
from fedreid.eval.report import EVAL_DIR, format_table, write_report
from fedreid.utils.cli import add_config_arguments, config_from_args, run_main
from fedreid.utils.io import claim_output_dir
from fedreid.utils.logging import METRICS_JSONL, read_metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{evaluate,index,query}")

    ev = sub.add_parser("evaluate", help="CMC/mAP on prepared datasets", description="CMC/mAP on prepared datasets")
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
    ev.add_argument("--batch-size", type=int, metavar="N", help="images per batch (eval.batch_size)")
    ev.add_argument("--save-features", metavar="DIR", help="write DIR/<dataset>.npz for later --features runs")
    ev.add_argument(
        "--pictures", type=int, default=3, metavar="N", help="best/worst-AP ranked-list PNGs per dataset (default 3)"
    )
    ev.add_argument(
        "--queries", action="append", metavar="Q[,Q...]",
        help="also draw these queries: indices and/or query image paths or file names (comma-separated or repeated)",
    )
    ev.add_argument(
        "--protocol", choices=pl.PROTOCOLS, default="standard",
        help="standard (default) or cuhk03: single-gallery-shot CMC, 10 seeded samplings",
    )
    ev.add_argument("--seed", type=int, metavar="N", help="seed of --protocol cuhk03 (default: the config's seed)")
    ev.add_argument("--out", metavar="DIR", help="output folder (default: <run folder>/eval)")
    ev.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1...")
    ev.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to evaluate")
    _add_speed_arguments(ev, faiss=False)
    add_config_arguments(ev)

    ix = sub.add_parser("index", help="FAISS index of a gallery folder", description="FAISS index of a gallery folder")
    ix.add_argument("--model", required=True, metavar="PATH", help="run folder, model_final.pt or checkpoint.pt")
    ix.add_argument("--gallery", required=True, metavar="DIR", help="folder of images (recursive jpg/png/bmp)")
    ix.add_argument("--index", required=True, metavar="OUT_DIR", help="where to save the index")
    ix.add_argument("--batch-size", type=int, default=128, metavar="N")
    ix.add_argument("--device", default="auto")
    ix.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    _add_skip_argument(ix, f"the index folder's {pl.SKIPPED_FILE}")
    _add_speed_arguments(ix)

    qu = sub.add_parser("query", help="search an index with query images", description="search an index")
    qu.add_argument("--index", required=True, metavar="DIR", help="index folder written by 'index'")
    qu.add_argument("--model", required=True, metavar="PATH", help="the model the index was built with")
    qu.add_argument("--images", required=True, metavar="FILE_OR_DIR", help="query image or folder of images")
    qu.add_argument("--top-k", type=int, default=10, metavar="K")
    qu.add_argument("--out", metavar="DIR", help="write one ranked-list PNG per query here")
    qu.add_argument("--batch-size", type=int, default=128, metavar="N")
    qu.add_argument("--device", default="auto")
    qu.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    qu.add_argument(
        "--allow-model-mismatch", action="store_true",
        help="search even when --model is not the model the index was built with (prints a WARNING line)",
    )
    _add_skip_argument(qu, f"--out/{pl.SKIPPED_FILE} (printed without --out)")
    _add_speed_arguments(qu)
    return parser


def _add_skip_argument(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--skip-bad-images", action="store_true",
        help=f"leave out unreadable images and list them (path, reason) in {where} "
        "(default: stop at the first one)",
    )


def _add_speed_arguments(parser: argparse.ArgumentParser, faiss: bool = True) -> None:
    """--amp / --channels-last (None = on for CUDA) and, for index/query, --faiss-gpu."""
    parser.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, default=None,
        help="float16 autocast for feature extraction (default: on with a CUDA device, off on the CPU)",
    )
    parser.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=None,
        help="channels-last images and model weights (default: on with a CUDA device, off on the CPU)",
    )
    if faiss:
        parser.add_argument(
            "--faiss-gpu", choices=pl.FAISS_GPU_MODES, default="auto",
            help="FAISS index on the GPU: auto (faiss-gpu sees a GPU and the device is CUDA), on, off",
        )


def _speedups(args: argparse.Namespace, device) -> dict:
    amp, channels_last = pl.resolve_speedups(device, args.amp, args.channels_last)
    return {"amp": amp, "channels_last": channels_last}


def _comma_list(items: list[str] | None) -> list[str]:
    return [x.strip() for x in ",".join(items or []).split(",") if x.strip()]


def _feature_files(items: list[str]) -> list[tuple[str | None, str]]:
    pairs = []
    for item in ",".join(items).split(","):
        if item.strip():
            name, _, file = item.rpartition("=")
            pairs.append((name or None, file))
    return pairs


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.features:
        feats = [pl.load_dataset_features(f, name) for name, f in _feature_files(args.features)]
        source = ", ".join(f for _, f in _feature_files(args.features))
        out = Path(args.out or Path(_feature_files(args.features)[0][1]).parent / "eval")
        pl.claim_eval_dir(out)
        cfg = config_from_args(args)
    else:
        model_file = pl.find_model_file(args.model)
        run_cfg = pl.run_config_path(args.model)
        cfg = load_config(run_cfg, args.overrides) if run_cfg and not args.config else config_from_args(args)
        root = args.prepared_root or cfg.data.prepared_root
        names = args.datasets.split(",") if args.datasets else (cfg.eval.datasets or cfg.data.dataset_names())
        names = pl.resolve_datasets([n.strip() for n in names if n.strip()], root)
        device = pl.resolve_device(args.device)
        speed = _speedups(args, device)
        loaded = pl.load_model(model_file, device, client=args.client)
        out = Path(args.out or model_file.parent / EVAL_DIR)
        pl.claim_eval_dir(out)  # both refused before any extraction when they hold the user's files
        if args.save_features:
            pl.claim_features_dir(args.save_features)
        feats = []
        batch_size = args.batch_size or cfg.eval.batch_size
        for name in names:
            print(f"extracting features: {name}", flush=True)
            fs = pl.dataset_features(loaded, root, name, batch_size=batch_size, device=device, **speed)
            if args.save_features:
                print(f"  saved {pl.save_dataset_features(args.save_features, fs)}")
            feats.append(fs)
        source = str(model_file)
    # --protocol cuhk03 has the standard AP only: an explicit --ap official is refused there,
    # a config's eval.ap is not the user's request for this protocol.
    ap = args.ap or (cfg.eval.ap if args.protocol == "standard" else "standard")
    seed = cfg.seed if args.seed is None else args.seed
    report = pl.evaluate_and_report(
        feats, out, ap=ap, rerank=args.rerank, pictures=args.pictures, queries=_comma_list(args.queries),
        protocol=args.protocol, seed=seed, source=source,
    )
    what = f"{report['ap']} AP" + (f", CUHK03 single-gallery-shot CMC, seed {seed}" if args.protocol == "cuhk03" else "")
    print(f"\n{'Re-ranked r' if args.rerank else 'R'}esults ({what}), in %:\n")
    print(format_table(report["datasets"]))
    print(f"results: {out / 'results.json'}\ncmc plot: {report['cmc_plot']}")
    print(f"ranked lists: {len(report['pictures'])} in {out / 'ranked_lists'}")
    run_dir = out.parent
    if out.name == EVAL_DIR and (run_dir / METRICS_JSONL).is_file():
        print(f"report: {write_report(run_dir, read_metrics(run_dir))}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    device = pl.resolve_device(args.device)
    speed = _speedups(args, device)
    faiss_gpu = pl.resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = pl.load_model(args.model, device, client=args.client)
    skipped: list[pl.SkippedImage] | None = [] if args.skip_bad_images else None
    folder, n = pl.build_gallery_index(
        loaded, args.gallery, args.index, batch_size=args.batch_size, device=device, faiss_gpu=faiss_gpu,
        skipped=skipped, **speed,
    )
    print(f"indexed {n} images of {args.gallery} into {folder}")
    if skipped:
        print(f"skipped {len(skipped)} unreadable images: listed in {folder / pl.SKIPPED_FILE}")
    return 0


def _shown(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it (the index stores absolute paths)."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def cmd_query(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise pl.EvalInputError(f"--top-k must be >= 1, got {args.top_k}")
    device = pl.resolve_device(args.device)
    speed = _speedups(args, device)
    faiss_gpu = pl.resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = pl.load_model(args.model, device, client=args.client)
    if args.out:  # refused before any work when it holds files of the user's
        claim_output_dir(args.out, "query", tool="tools/eval_reid.py query --out")
    skipped: list[pl.SkippedImage] | None = [] if args.skip_bad_images else None
    results = pl.query_index(
        loaded, args.index, args.images, top_k=args.top_k, batch_size=args.batch_size, device=device,
        faiss_gpu=faiss_gpu, allow_model_mismatch=args.allow_model_mismatch,
        warn=lambda message: print(f"WARNING: {message}", flush=True), skipped=skipped, **speed,
    )
    if skipped:
        if args.out:
            listed = pl.write_skipped_csv(Path(args.out) / pl.SKIPPED_FILE, skipped)
            print(f"skipped {len(skipped)} unreadable images: listed in {listed}")
        else:
            for s in skipped:
                print(f"skipped {s.path}: {s.reason}")
    elif args.out and (Path(args.out) / pl.SKIPPED_FILE).is_file():
        (Path(args.out) / pl.SKIPPED_FILE).unlink()  # from an earlier query into this folder
    for r in results:
        print(f"{r.path}")
        for m in r.matches:
            mark = {True: " +", False: " -", None: ""}[m["correct"]]
            print(f"  {m['rank']:3d}  {m['score']:.4f}  {_shown(m['path'])}{mark}")
    if args.out:
        pictures = pl.draw_query_pictures(results, args.out)
        print(f"pictures: {len(pictures)} in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"evaluate": cmd_evaluate, "index": cmd_index, "query": cmd_query}[args.command]
    return command(args)


if __name__ == "__main__":
    run_main(main)
