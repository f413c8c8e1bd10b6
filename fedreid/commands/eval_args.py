"""Options that several ``eval_reid`` commands share: the model backend, speedups, unreadable images."""

from __future__ import annotations

import argparse

from fedreid.inference import devices
from fedreid.inference.export import BACKENDS
from fedreid.retrieval.faiss_gpu import FAISS_GPU_MODES


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default="pytorch",
        help="pytorch (default): --model is a run folder or model file; onnx (ONNX Runtime, CPU, no PyTorch "
        "needed; --device auto or cpu) / torchscript: "
        "--model is a file written by 'export' (with its .json sidecar). The index records the backend and "
        "the exported file's SHA-256: query with the same backend and file",
    )


def load_for_features(args: argparse.Namespace, device):
    """The model of index/query: a run/model file (--backend pytorch) or an exported file."""
    from fedreid.inference.export import load_feature_model

    return load_feature_model(args.model, args.backend, device, client=args.client)


def add_skip_argument(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--skip-bad-images", action="store_true",
        help=f"leave out unreadable images and list them (path, reason) in {where} "
        "(default: stop at the first one)",
    )


def add_speed_arguments(parser: argparse.ArgumentParser, faiss: bool = True) -> None:
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


def speedups(args: argparse.Namespace, device) -> dict:
    """``--amp`` / ``--channels-last`` decided for ``device``, as extraction keyword arguments."""
    amp, channels_last = devices.resolve_speedups(device, args.amp, args.channels_last)
    return {"amp": amp, "channels_last": channels_last}
