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
model_final.pt or a checkpoint.pt. Features are the flip-averaged,
L2-normalised embeddings; the device is CUDA when available (with --backend
onnx it is the CPU, and PyTorch is not needed). On CUDA the extraction uses
float16 autocast (--amp) and channels-last tensors and
weights (--channels-last) unless --no-amp / --no-channels-last; on the CPU
they are off, and asking for them there is an error. --faiss-gpu on puts
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
samplings from --seed, default the config's seed) with the standard mAP. A features file
(--save-features DIR writes DIR/<dataset>.npz) holds the query and gallery
features of one dataset; pass it back as --features FILE or NAME=FILE
(comma-separated or repeated for several datasets).

index writes a gallery store (fedreid.retrieval.GalleryStore; `index --help`
tells more): a FAISS index by --factory (default Flat: exact, the ranking of
an exact inner-product search), stable item ids, and per item its path,
camera and identity (from Market-style names ^<pid>_c<camera>, e.g.
0002_c1s1_000451_01.jpg: identity 2, camera 1; unknown otherwise), site
(--site) and time (the file's modification time), or the values of a
--metadata CSV. --add adds images to a store, --remove erases items. query
prints each image's top-k (rank, score, path, then the item's id, camera,
site and time; + / - when both identities are known and equal / differ),
restricted by --cameras, --sites, --since, --until if given, and, with --out,
draws one PNG per query: green/red frames where both identities are known,
grey otherwise.

Safety: every output folder (evaluate's --out and --save-features, index's
--index, query's --out) must be new, empty, or one these commands made
(marked .fedreid-<kind>.json; the folders of an earlier fedreid are
recognised and adopted); a folder holding anything else, and an index folder
in the gallery folder, is refused and left untouched. An index folder is
replaced as a whole, by a build and by every --add/--remove: an interrupted
index leaves the old store or the new. query refuses an index folder of an
earlier fedreid (asking to rebuild it with index). The store header records
the size and SHA-256 of each store file (checked before faiss or SQLite read
them) and the model's fingerprint (weights
SHA-256, backbone, input size, feature kind): query with another model is
refused, naming the fields that differ, unless --allow-model-mismatch, which
searches anyway and prints a WARNING line first; --add with another model is
refused. Model files are only read
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
from fedreid.eval import protocols
from fedreid.eval.pipeline import claim_eval_dir, evaluate_and_report
from fedreid.eval.report import EVAL_DIR, format_table, write_report
from fedreid.inference import devices
from fedreid.inference.dataset_features import (
    claim_features_dir,
    dataset_features,
    load_dataset_features,
    resolve_datasets,
    save_dataset_features,
)
from fedreid.inference.errors import EvalInputError
from fedreid.inference.export import BACKENDS
from fedreid.inference.images import SKIPPED_FILE, SkippedImage, write_skipped_csv
from fedreid.inference.model_io import find_model_file, load_model, run_config_path
from fedreid.retrieval.faiss_gpu import FAISS_GPU_MODES, resolve_faiss_gpu
from fedreid.retrieval.folders import (
    add_to_gallery_store,
    build_gallery_store,
    draw_query_pictures,
    open_gallery_store,
    query_index,
    remove_from_gallery_store,
)
from fedreid.retrieval.service import add_serve_arguments, run_serve
from fedreid.utils.cli import add_config_arguments, checked_overrides, run_main
from fedreid.utils.io import claim_output_dir
from fedreid.utils.logging import METRICS_JSONL, add_pictures, read_metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{evaluate,index,query,serve,export}")

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
        "--protocol", choices=protocols.EVAL_PROTOCOLS.keys(), default="standard", help=protocols.protocol_help(),
    )
    ev.add_argument("--seed", type=int, metavar="N", help="seed of --protocol cuhk03 (default: the config's seed)")
    ev.add_argument("--out", metavar="DIR", help="output folder (default: <run folder>/eval)")
    ev.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1...")
    ev.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to evaluate")
    _add_speed_arguments(ev, faiss=False)
    add_config_arguments(ev)

    ix = sub.add_parser(
        "index", help="build, extend or prune a gallery store (FAISS index + metadata) of image folders",
        description=INDEX_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ix.add_argument("--index", required=True, metavar="DIR", help="the store folder")
    ix.add_argument(
        "--model", metavar="PATH",
        help="run folder, model_final.pt or checkpoint.pt (with --gallery and --add; not with --remove)",
    )
    action = ix.add_mutually_exclusive_group()
    action.add_argument(
        "--gallery", metavar="DIR", help="build a new store of this folder's images (recursive jpg/png/bmp)"
    )
    action.add_argument("--add", metavar="DIR", help="add this folder's images (or this image) to the store")
    action.add_argument(
        "--remove", nargs="+", metavar="ID_OR_PATH",
        help="erase these items: ids (digits), paths as stored, or file names one item has",
    )
    ix.add_argument(
        "--factory", metavar="STRING",
        help="FAISS index factory string, with --gallery (default Flat: exact); e.g. IVF1024,Flat, IVF1024,PQ64, "
        "HNSW32",
    )
    ix.add_argument(
        "--refine", type=int, metavar="R",
        help="with --gallery: searches re-score the index's top R*k exactly from the stored vectors "
        "(for PQ factories, whose codes lose the order of close neighbours; default 1: off)",
    )
    ix.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the index training and of --verify's sample (0)"
    )
    ix.add_argument("--site", metavar="NAME", help="the site of the images of --gallery/--add (default: none)")
    ix.add_argument(
        "--metadata", metavar="FILE.csv",
        help="per-image values overriding the defaults: columns path and any of camera,site,timestamp,identity",
    )
    ix.add_argument("--verify", action="store_true", help="recall@k against exact search, printed and stored")
    ix.add_argument(
        "--check", action="store_true",
        help="hash every file of the store (SHA-256) against header.json, whatever was checked before; one line",
    )
    ix.add_argument(
        "--target-recall", type=float, metavar="R",
        help="choose the smallest nprobe (IVF) / efSearch (HNSW) whose recall@k reaches R; printed and stored",
    )
    ix.add_argument("--verify-sample", type=int, default=200, metavar="N", help="items sampled as queries (200)")
    ix.add_argument("--verify-k", type=int, default=10, metavar="K", help="k of recall@k (10)")
    ix.add_argument("--batch-size", type=int, default=128, metavar="N")
    ix.add_argument("--device", default="auto")
    ix.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    _add_skip_argument(ix, f"the index folder's {SKIPPED_FILE}")
    _add_speed_arguments(ix)
    _add_backend_argument(ix)

    qu = sub.add_parser("query", help="search an index with query images", description="search an index")
    qu.add_argument("--index", required=True, metavar="DIR", help="index folder written by 'index'")
    qu.add_argument("--model", required=True, metavar="PATH", help="the model the index was built with")
    qu.add_argument("--images", required=True, metavar="FILE_OR_DIR", help="query image or folder of images")
    qu.add_argument("--top-k", type=int, default=10, metavar="K")
    qu.add_argument("--cameras", action="append", metavar="C[,C...]", help="only items of these cameras")
    qu.add_argument("--sites", action="append", metavar="S[,S...]", help="only items of these sites")
    qu.add_argument("--since", metavar="TIME", help="only items at or after TIME (seconds since the epoch or ISO)")
    qu.add_argument("--until", metavar="TIME", help="only items at or before TIME (seconds since the epoch or ISO)")
    qu.add_argument("--out", metavar="DIR", help="write one ranked-list PNG per query here")
    qu.add_argument("--batch-size", type=int, default=128, metavar="N")
    qu.add_argument("--device", default="auto")
    qu.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    qu.add_argument(
        "--allow-model-mismatch", action="store_true",
        help="search even when --model is not the model the index was built with (prints a WARNING line)",
    )
    _add_skip_argument(qu, f"--out/{SKIPPED_FILE} (printed without --out)")
    _add_speed_arguments(qu)
    _add_backend_argument(qu)

    sv = sub.add_parser(
        "serve", help="serve a gallery store: search API and web page",
        description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(sv)

    ex = sub.add_parser(
        "export", help="write the model's feature extractor as ONNX or TorchScript",
        description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("--model", required=True, metavar="PATH", help="run folder, model_final.pt or checkpoint.pt")
    ex.add_argument("--format", required=True, choices=("onnx", "torchscript"), help="file format")
    ex.add_argument("--out", required=True, metavar="FILE", help="the file to write (and FILE.json beside it)")
    ex.add_argument("--height", type=int, metavar="H", help="input height (default: the model config's)")
    ex.add_argument("--width", type=int, metavar="W", help="input width (default: the model config's)")
    ex.add_argument("--opset", type=int, default=17, metavar="N", help="ONNX opset (default 17)")
    ex.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to export")
    return parser


INDEX_HELP = """Build, extend or prune a gallery store of image folders (fedreid.retrieval.GalleryStore).

  index --model RUN --gallery DIR --index DIR [--factory F] [--verify] [--target-recall R]
      a new store of DIR's images, replacing what --index DIR holds (the folder must
      be new, empty, or an index folder these commands made)
  index --model RUN --index DIR --add DIR2
      add DIR2's images; the model must be the store's, and no image may be in the
      store already (the error names them; nothing changes)
  index --index DIR --remove ID_OR_PATH [...]
      erase items: no trace of them stays in the store's files (no model needed)
  index --index DIR --verify | --target-recall R | --check
      check or tune an existing store (no model needed)

The store (--index DIR) is a set of segments, each four files written once:
seg-<n>.faiss (its FAISS index), seg-<n>.vectors.npy, seg-<n>.ids.npy and
seg-<n>.sqlite (one row per item: id, path, camera, site, timestamp,
identity); template.faiss (the trained, empty index new segments copy);
header.json (factory, search parameters, model fingerprint, last verify, the
segments, file checksums); skipped.csv with --skip-bad-images. --add writes
new segments only; --remove rewrites only the segments holding the removed
items. Items keep their ids for the store's lifetime; ids are never reused.

--check: hash every file against the SHA-256 in header.json (reading a store
hashes a file only the first time a process reads it) and print one line; a
file that differs is an error naming it.

--factory: a FAISS factory string (inner product). Flat (default) is exact
search: the ranking of an exact IndexFlatIP over the features. IVF<n>,... and
PQ need at least n (IVF) and 2^bits per sub-quantizer (PQ) images to train on,
drawn with --seed; --add encodes new images with that training. HNSW<m> needs
no training. --verify: recall@k (--verify-k, 10) of the index against exact
search, for --verify-sample (200) stored items drawn with --seed as queries;
--target-recall R: the smallest nprobe (IVF) / efSearch (HNSW) reaching R (or
the largest tried), used by later queries. Both are printed and stored in the
header; an --add or --remove clears the stored result (run --verify again).

Rows: path (absolute, links resolved), camera and identity from a
Market-style name (0002_c3s1_000451_01.jpg: identity 2, camera 3; none
otherwise), site from --site (default none), timestamp from the file's
modification time. --metadata FILE.csv overrides them: a header row with path
and any of camera, site, timestamp, identity; one row per image at most
(relative paths are relative to the --gallery/--add folder); an empty cell
keeps the default; camera and identity are integers, timestamp is seconds
since the epoch or an ISO date/time (UTC unless it has an offset); a bad
value, an unknown column or a path that is not an image of the folder is an
error naming the file and row.

--remove: a token of digits is an item id (query prints them); any other token
is a path, as stored or as a file path from here; a bare file name (no folder)
names the item whose path ends with it, and is an error when several do. Any
unknown item is an error and nothing is removed. The removed ids are printed,
not their paths.

Examples:
  python tools/eval_reid.py index --model runs/fedpav --gallery photos/gallery --index idx --verify
  python tools/eval_reid.py index --model runs/fedpav --gallery photos/gallery --index big \\
      --factory IVF1024,PQ64 --target-recall 0.95 --site lobby --metadata photos/times.csv
  python tools/eval_reid.py index --model runs/fedpav --index idx --add photos/new --site lobby
  python tools/eval_reid.py index --index idx --remove 17 42 0002_c1s1_000451_01.jpg
"""


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


SERVE_HELP = """Serve a gallery store (written by 'index') over HTTP: a search API and a web page.

Every endpoint but the page itself needs 'Authorization: Bearer TOKEN'; serve
refuses to start without a token unless --insecure-local (then only on
127.0.0.1/::1/localhost). The model must be the one the store was built with.

  GET    /                   the web page: drop a query image, see the ranked gallery
  POST   /search             multipart: image (a file) or item (a stored id), k, and
                             optional cameras, sites, since, until -> {"results": [...]}
  GET    /items/ID           an item's metadata;  GET /items/ID/image  its image
  POST   /items              multipart image + camera/site/timestamp/identity (needs --uploads)
  DELETE /items/ID           erase an item from the store
  GET    /info               items, feature size, factory, limits

Examples:
  python tools/eval_reid.py serve --model runs/fedpav --index runs/fedpav/index --token-file ~/.fedreid-token
  FEDREID_SERVE_TOKEN=... python tools/eval_reid.py serve --model fedpav.onnx --backend onnx \\
      --index big --host 0.0.0.0 --port 8443 --ssl-certfile cert.pem --ssl-keyfile key.pem --uploads uploads
  python tools/eval_reid.py serve --model runs/fedpav --index runs/fedpav/index --insecure-local
  curl -H "Authorization: Bearer $TOKEN" -F image=@query.jpg -F k=10 http://127.0.0.1:8000/search
"""


def _add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default="pytorch",
        help="pytorch (default): --model is a run folder or model file; onnx (ONNX Runtime, CPU, no PyTorch "
        "needed; --device auto or cpu) / torchscript: "
        "--model is a file written by 'export' (with its .json sidecar). The index records the backend and "
        "the exported file's SHA-256: query with the same backend and file",
    )


def _load_for_features(args: argparse.Namespace, device):
    """The model of index/query: a run/model file (--backend pytorch) or an exported file."""
    from fedreid.inference.export import load_feature_model

    return load_feature_model(args.model, args.backend, device, client=args.client)


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
            "--faiss-gpu", choices=FAISS_GPU_MODES, default="auto",
            help="FAISS on the GPU (index: IVF training; query: Flat stores): auto (faiss-gpu sees a GPU and the "
            "device is CUDA), on, off",
        )


def _speedups(args: argparse.Namespace, device) -> dict:
    amp, channels_last = devices.resolve_speedups(device, args.amp, args.channels_last)
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
        feats = [load_dataset_features(f, name) for name, f in _feature_files(args.features)]
        source = ", ".join(f for _, f in _feature_files(args.features))
        out = Path(args.out or Path(_feature_files(args.features)[0][1]).parent / "eval")
        claim_eval_dir(out)
        cfg = load_config(args.config, checked_overrides(args))
    else:
        model_file = find_model_file(args.model)
        run_cfg = run_config_path(args.model)
        cfg = load_config(run_cfg, args.overrides) if run_cfg and not args.config else load_config(args.config, checked_overrides(args))
        root = args.prepared_root or cfg.data.prepared_root
        names = args.datasets.split(",") if args.datasets else (cfg.eval.datasets or cfg.data.dataset_names())
        names = resolve_datasets([n.strip() for n in names if n.strip()], root)
        device = devices.resolve_device(args.device)
        speed = _speedups(args, device)
        loaded = load_model(model_file, device, client=args.client)
        out = Path(args.out or model_file.parent / EVAL_DIR)
        claim_eval_dir(out)  # both refused before any extraction when they hold the user's files
        if args.save_features:
            claim_features_dir(args.save_features)
        feats = []
        batch_size = args.batch_size or cfg.eval.batch_size
        for name in names:
            print(f"extracting features: {name}", flush=True)
            fs = dataset_features(loaded, root, name, batch_size=batch_size, device=device, **speed)
            if args.save_features:
                print(f"  saved {save_dataset_features(args.save_features, fs)}")
            feats.append(fs)
        source = str(model_file)
    # A protocol may report some AP forms only (cuhk03: the standard AP): an explicit --ap is
    # refused there, a config's eval.ap is not the user's request for this protocol.
    protocol = protocols.EVAL_PROTOCOLS.get(args.protocol, where="--protocol")
    ap = args.ap or protocol.default_ap(cfg.eval.ap)
    seed = cfg.seed if args.seed is None else args.seed
    report = evaluate_and_report(
        feats, out, ap=ap, rerank=args.rerank, pictures=args.pictures, queries=_comma_list(args.queries),
        protocol=args.protocol, seed=seed, source=source,
    )
    what = f"{report['ap']} AP" + protocols.build_protocol(args.protocol).describe(seed)
    print(f"\n{'Re-ranked r' if args.rerank else 'R'}esults ({what}), in %:\n")
    print(format_table(report["datasets"]))
    print(f"results: {out / 'results.json'}\ncmc plot: {report['cmc_plot']}")
    print(f"ranked lists: {len(report['pictures'])} in {out / 'ranked_lists'}")
    run_dir = out.parent
    if out.name == EVAL_DIR and (run_dir / METRICS_JSONL).is_file():
        history = read_metrics(run_dir)
        add_pictures(run_dir, [*report["pictures"], report["cmc_plot"]], int(history[-1]["round"]) if history else 0)
        print(f"report: {write_report(run_dir, history)}")
    return 0


def _check_index_arguments(args: argparse.Namespace) -> str:
    """What ``index`` is asked to do (build, add, remove, check), after the flags' consistency is checked."""
    action = "build" if args.gallery else "add" if args.add else "remove" if args.remove else "check"
    if action == "check" and not (args.verify or args.check or args.target_recall is not None):
        raise EvalInputError(
            "index: give --gallery DIR (a new store), --add DIR, --remove ID_OR_PATH..., or --verify / "
            "--target-recall R / --check (an existing store)"
        )
    if action in ("build", "add") and not args.model:
        raise EvalInputError(f"--{'gallery' if action == 'build' else 'add'} needs --model (the features' model)")
    if action in ("remove", "check") and args.model:
        what = "--remove" if action == "remove" else "--verify / --target-recall / --check alone"
        raise EvalInputError(f"--model does not apply to {what} (no image is read)")
    if args.factory is not None and action != "build":
        raise EvalInputError("--factory applies to --gallery: a store keeps the factory it was built with")
    if args.refine is not None and (action != "build" or args.refine < 1):
        raise EvalInputError("--refine R (R >= 1) applies to --gallery: a store keeps the search it was built with")
    for flag, value in (("--site", args.site), ("--metadata", args.metadata)):
        if value is not None and action not in ("build", "add"):
            raise EvalInputError(f"{flag} applies to the images of --gallery or --add")
    if args.target_recall is not None and not 0 < args.target_recall <= 1:
        raise EvalInputError(f"--target-recall must be in (0, 1], got {args.target_recall}")
    if args.verify_sample < 1 or args.verify_k < 1:
        raise EvalInputError(
            f"--verify-sample and --verify-k must be >= 1, got {args.verify_sample}, {args.verify_k}"
        )
    return action


def _search_words(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "exact"


def _print_check(store, args: argparse.Namespace) -> None:
    """--check, then --target-recall (tune) or --verify on ``store``; a tune or verify result is stored in its header."""
    if args.check:
        c = store.check_files()
        print(f"check: all {c['files']} files of {args.index} match the SHA-256 in its header.json "
              f"({c['bytes'] / 2**20:.1f} MiB hashed)")
    if args.target_recall is not None:
        t = store.tune(args.target_recall, sample=args.verify_sample, k=args.verify_k, seed=args.seed)
        outcome = "reached" if t["reached"] else "not reached: kept the largest value tried"
        print(f"tuned: {_search_words(t['search'])}: recall@{t['k']} {t['recall']:.4f} against exact search "
              f"(target {t['target_recall']:g}, {outcome}; {t['sample']} sampled items, seed {t['seed']})")
    elif args.verify:
        r = store.verify(sample=args.verify_sample, k=args.verify_k, seed=args.seed)
        print(f"verify: recall@{r['k']} {r['recall']:.4f} against exact search ({_search_words(r['search'])}; "
              f"{r['sample']} sampled items, seed {r['seed']})")


def cmd_index(args: argparse.Namespace) -> int:
    action = _check_index_arguments(args)
    if action == "remove":
        store, gone = remove_from_gallery_store(args.index, args.remove)
        print(f"removed {len(gone)} items from {args.index}: ids {', '.join(str(i) for i in gone)} "
              f"({store.ntotal} items left)")
        _print_check(store, args)
        return 0
    if action == "check":
        _print_check(open_gallery_store(args.index), args)
        return 0
    device = devices.resolve_backend_device(args.device, args.backend)
    speed = _speedups(args, device)
    faiss_gpu = resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = _load_for_features(args, device)
    skipped: list[SkippedImage] | None = [] if args.skip_bad_images else None
    common = dict(batch_size=args.batch_size, device=device, skipped=skipped, site=args.site,
                  metadata=args.metadata, **speed)
    if action == "build":
        store, n = build_gallery_store(
            loaded, args.gallery, args.index, faiss_gpu=faiss_gpu, factory=args.factory or "Flat", seed=args.seed,
            refine=args.refine or 1, **common,
        )
        print(f"indexed {n} images of {args.gallery} into {args.index}")
    else:
        store, ids = add_to_gallery_store(loaded, args.index, args.add, **common)
        print(f"added {len(ids)} images of {args.add} to {args.index}: ids {ids[0]}-{ids[-1]} "
              f"({store.ntotal} items)")
    print(f"store: {store.factory} ({_search_words(store.search_params)}), {store.ntotal} items")
    if skipped:
        print(f"skipped {len(skipped)} unreadable images: listed in {Path(args.index) / SKIPPED_FILE}")
    _print_check(store, args)
    return 0


def _shown(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it (the index stores absolute paths)."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _query_filters(args: argparse.Namespace) -> dict:
    """The filters of ``query`` (--cameras, --sites, --since, --until) as :func:`~fedreid.retrieval.folders.query_index` takes them.

    Checked by the rules the metadata CSV and the service use (:mod:`fedreid.retrieval.fields`).
    """
    from fedreid.retrieval import fields

    filters: dict = {}
    if args.cameras:
        cams = fields.camera_list(",".join(args.cameras), "--cameras")
        if not cams:
            raise EvalInputError(f"--cameras expects camera numbers like 1,2, got {','.join(args.cameras)!r}")
        filters["cameras"] = cams
    if args.sites:
        sites = fields.site_list(",".join(args.sites), "--sites")
        if not sites:
            raise EvalInputError(f"--sites expects site names like north,south, got {','.join(args.sites)!r}")
        filters["sites"] = sites
    window = fields.time_window(args.since, args.until, "--")
    if window is not None:
        filters["time_window"] = window
    return filters


def _match_line(m: dict) -> str:
    from fedreid.retrieval.gallery_rows import format_time

    mark = {True: " +", False: " -", None: ""}[m["correct"]]
    camera = "-" if m["camera"] is None else m["camera"]
    extra = f"item={m['id']} cam={camera} site={m['site'] or '-'} time={format_time(m['timestamp']) or '-'}"
    return f"  {m['rank']:3d}  {m['score']:.4f}  {_shown(m['path'])}  {extra}{mark}"


def cmd_query(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise EvalInputError(f"--top-k must be >= 1, got {args.top_k}")
    filters = _query_filters(args)
    device = devices.resolve_backend_device(args.device, args.backend)
    speed = _speedups(args, device)
    faiss_gpu = resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = _load_for_features(args, device)
    if args.out:  # refused before any work when it holds files of the user's
        claim_output_dir(args.out, "query", tool="tools/eval_reid.py query --out")
    skipped: list[SkippedImage] | None = [] if args.skip_bad_images else None
    results = query_index(
        loaded, args.index, args.images, top_k=args.top_k, batch_size=args.batch_size, device=device,
        faiss_gpu=faiss_gpu, allow_model_mismatch=args.allow_model_mismatch,
        warn=lambda message: print(f"WARNING: {message}", flush=True), skipped=skipped, **filters, **speed,
    )
    if skipped:
        if args.out:
            listed = write_skipped_csv(Path(args.out) / SKIPPED_FILE, skipped)
            print(f"skipped {len(skipped)} unreadable images: listed in {listed}")
        else:
            for s in skipped:
                print(f"skipped {s.path}: {s.reason}")
    elif args.out and (Path(args.out) / SKIPPED_FILE).is_file():
        (Path(args.out) / SKIPPED_FILE).unlink()  # from an earlier query into this folder
    for r in results:
        print(f"{r.path}")
        for m in r.matches:
            print(_match_line(m))
        if not r.matches:
            print("  (no item passes the filters)" if filters else "  (the store is empty)")
    if args.out:
        pictures = draw_query_pictures(results, args.out)
        print(f"pictures: {len(pictures)} in {args.out}")
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


def cmd_serve(args: argparse.Namespace) -> int:
    return run_serve(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"evaluate": cmd_evaluate, "index": cmd_index, "query": cmd_query, "serve": cmd_serve,
               "export": cmd_export}[args.command]
    return command(args)


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
