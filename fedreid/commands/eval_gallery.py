"""The gallery commands of ``eval_reid.py``: ``index`` (build, extend, prune, check a store) and ``query``."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedreid.commands.eval_args import (
    add_backend_argument,
    add_progress_argument,
    add_skip_argument,
    add_speed_arguments,
    load_for_features,
    speedups,
)
from fedreid.inference import devices
from fedreid.inference.errors import EvalInputError
from fedreid.inference.images import SKIPPED_FILE, SkippedImage, write_skipped_csv
from fedreid.retrieval.faiss_gpu import resolve_faiss_gpu
from fedreid.retrieval.folders import (
    add_to_gallery_store,
    build_gallery_store,
    draw_query_pictures,
    index_action,
    open_gallery_store,
    query_filters,
    query_index,
    remove_from_gallery_store,
)
from fedreid.utils.cli import positive_int, show_progress
from fedreid.utils.io import claim_output_dir

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

QUERY_EXAMPLES = """Examples:
  # the top 10 of each image of a folder, with a PNG of each ranked list
  python tools/eval_reid.py query --model runs/fedpav --index runs/fedpav/index --images photos/query --out /tmp/q

  # cameras 1 and 2 of one day, from the sites lobby and gate
  python tools/eval_reid.py query --model runs/fedpav --index big --images photos/query \\
      --cameras 1,2 --sites lobby,gate --since 2024-05-01 --until 2024-05-01T23:59:59

  # with an exported model (ONNX Runtime on the CPU, no PyTorch needed)
  python tools/eval_reid.py query --backend onnx --model fedpav.onnx --index idx_onnx --images photos/query
"""

QUERY_HELP = """Search a gallery store (written by 'index') with query images.

The store (`index --help`): a FAISS index by --factory (default Flat: exact, the ranking of
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


def add_index_command(sub: argparse._SubParsersAction) -> None:
    """The ``index`` subcommand."""
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
    ix.add_argument("--batch-size", type=positive_int, default=128, metavar="N")
    ix.add_argument("--device", default="auto")
    ix.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    add_skip_argument(ix, f"the index folder's {SKIPPED_FILE}")
    add_speed_arguments(ix)
    add_progress_argument(ix)
    add_backend_argument(ix)
    ix.set_defaults(func=cmd_index)


def add_query_command(sub: argparse._SubParsersAction) -> None:
    """The ``query`` subcommand."""
    qu = sub.add_parser("query", help="search an index with query images", description=QUERY_HELP,
                        epilog=QUERY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    qu.add_argument("--index", required=True, metavar="DIR", help="index folder written by 'index'")
    qu.add_argument("--model", required=True, metavar="PATH", help="the model the index was built with")
    qu.add_argument("--images", required=True, metavar="FILE_OR_DIR", help="query image or folder of images")
    qu.add_argument("--top-k", type=int, default=10, metavar="K")
    qu.add_argument("--cameras", action="append", metavar="C[,C...]", help="only items of these cameras")
    qu.add_argument("--sites", action="append", metavar="S[,S...]", help="only items of these sites")
    qu.add_argument("--since", metavar="TIME", help="only items at or after TIME (seconds since the epoch or ISO)")
    qu.add_argument("--until", metavar="TIME", help="only items at or before TIME (seconds since the epoch or ISO)")
    qu.add_argument("--out", metavar="DIR", help="write one ranked-list PNG per query here")
    qu.add_argument("--batch-size", type=positive_int, default=128, metavar="N")
    qu.add_argument("--device", default="auto")
    qu.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    qu.add_argument(
        "--allow-model-mismatch", action="store_true",
        help="search even when --model is not the model the index was built with (prints a WARNING line)",
    )
    add_skip_argument(qu, f"--out/{SKIPPED_FILE} (printed without --out)")
    add_speed_arguments(qu)
    add_progress_argument(qu)
    add_backend_argument(qu)
    qu.set_defaults(func=cmd_query)


def _search_words(params: dict, exact: bool) -> str:
    """The search settings in words; a store without any is "exact" only if its index is a bare Flat."""
    return ", ".join(f"{k}={v}" for k, v in params.items()) or ("exact" if exact else "the index's own search")


def _print_check(store, args: argparse.Namespace) -> None:
    """--check, then --target-recall (tune) or --verify on ``store``; a tune or verify result is stored in its header."""
    if args.check:
        c = store.check_files()
        print(f"check: all {c['files']} files of {args.index} match the SHA-256 in its header.json "
              f"({c['bytes'] / 2**20:.1f} MiB hashed)")
    if args.target_recall is not None:
        t = store.tune(args.target_recall, sample=args.verify_sample, k=args.verify_k, seed=args.seed)
        outcome = "reached" if t["reached"] else "not reached: kept the largest value tried"
        print(f"tuned: {_search_words(t['search'], store.exact)}: recall@{t['k']} {t['recall']:.4f} against exact search "
              f"(target {t['target_recall']:g}, {outcome}; {t['sample']} sampled items, seed {t['seed']})")
    elif args.verify:
        r = store.verify(sample=args.verify_sample, k=args.verify_k, seed=args.seed)
        print(f"verify: recall@{r['k']} {r['recall']:.4f} against exact search ({_search_words(r['search'], store.exact)}; "
              f"{r['sample']} sampled items, seed {r['seed']})")


def cmd_index(args: argparse.Namespace) -> int:
    action = index_action(
        gallery=args.gallery, add=args.add, remove=args.remove, model=args.model, factory=args.factory,
        refine=args.refine, site=args.site, metadata=args.metadata, verify=args.verify, check=args.check,
        target_recall=args.target_recall, verify_sample=args.verify_sample, verify_k=args.verify_k)
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
    speed = speedups(args, device)
    faiss_gpu = resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = load_for_features(args, device)
    skipped: list[SkippedImage] | None = [] if args.skip_bad_images else None
    common = dict(batch_size=args.batch_size, device=device, skipped=skipped, site=args.site,
                  metadata=args.metadata, progress=show_progress(args), **speed)
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
    print(f"store: {store.factory} ({_search_words(store.search_params, store.exact)}), {store.ntotal} items")
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


def _match_line(m: dict) -> str:
    from fedreid.retrieval.gallery_rows import format_time

    mark = {True: " +", False: " -", None: ""}[m["correct"]]
    camera = "-" if m["camera"] is None else m["camera"]
    extra = f"item={m['id']} cam={camera} site={m['site'] or '-'} time={format_time(m['timestamp']) or '-'}"
    return f"  {m['rank']:3d}  {m['score']:.4f}  {_shown(m['path'])}  {extra}{mark}"


def cmd_query(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise EvalInputError(f"--top-k must be >= 1, got {args.top_k}")
    filters = query_filters(args.cameras, args.sites, args.since, args.until)
    device = devices.resolve_backend_device(args.device, args.backend)
    speed = speedups(args, device)
    faiss_gpu = resolve_faiss_gpu(args.faiss_gpu, device)
    loaded = load_for_features(args, device)
    if args.out:  # refused before any work when it holds files of the user's
        claim_output_dir(args.out, "query", tool="tools/eval_reid.py query --out")
    skipped: list[SkippedImage] | None = [] if args.skip_bad_images else None
    results = query_index(
        loaded, args.index, args.images, top_k=args.top_k, batch_size=args.batch_size, device=device,
        faiss_gpu=faiss_gpu, allow_model_mismatch=args.allow_model_mismatch,
        warn=lambda message: print(f"WARNING: {message}", flush=True), skipped=skipped, **filters, **speed,
        progress=show_progress(args),
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
