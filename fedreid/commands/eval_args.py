"""Options of the ``eval_reid`` commands: the model backend, speedups, evaluate's precision, unreadable images,
and the extraction options that ``evaluate --features`` refuses."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, get_args, get_type_hints

from fedreid.config import EvalConfig
from fedreid.inference import devices
from fedreid.inference.errors import EvalInputError
from fedreid.inference.export import BACKENDS
from fedreid.retrieval.faiss_gpu import FAISS_GPU_MODES

if TYPE_CHECKING:
    from fedreid.utils.precision import Precision

# eval.precision's choices, read off the config: this module stays importable without torch (--backend onnx).
PRECISIONS = get_args(get_type_hints(EvalConfig)["precision"])


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default="pytorch",
        help="pytorch (default): --model is a run folder or model file; onnx (ONNX Runtime, CPU, no PyTorch "
        "needed; --device auto or cpu) / torchscript: "
        "--model is a file written by 'export' (with its .json sidecar). The index records the model's "
        "fingerprint (weights, input size, feature): any backend running the same weights queries it",
    )


def load_for_features(args: argparse.Namespace, device):
    """The model of index/query: a run/model file (--backend pytorch) or an exported file."""
    from fedreid.inference.export import load_feature_model

    return load_feature_model(args.model, args.backend, device, client=args.client)


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they are drawn only when stderr is a terminal)")


def add_skip_argument(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--skip-bad-images", action="store_true",
        help=f"leave out unreadable images and list them (path, reason) in {where} "
        "(default: stop at the first one)",
    )


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """index and query's --amp / --channels-last (None = on for CUDA) and --faiss-gpu."""
    parser.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, default=None,
        help="float16 autocast for feature extraction (default: on with a CUDA device, off on the CPU)",
    )
    parser.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=None,
        help="channels-last images and model weights (default: on with a CUDA device, off on the CPU)",
    )
    parser.add_argument(
        "--faiss-gpu", choices=FAISS_GPU_MODES, default="auto",
        help="FAISS on the GPU (index: IVF training; query: Flat stores): auto (faiss-gpu sees a GPU and the "
        "device is CUDA), on, off",
    )


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """``evaluate``'s arithmetic: --precision (default: the config's eval.precision), --amp, --channels-last."""
    parser.add_argument(
        "--precision", choices=PRECISIONS,
        help="arithmetic of the feature extraction: fp32, bf16, fp16 (CUDA only) or auto (bf16 on a CUDA card "
        "that has it, else fp32). Default: the config's eval.precision (fp32 unless the run set another), so "
        "a run's checkpoint is evaluated as the run evaluated it; fp32 is the papers' protocol",
    )
    parser.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, default=None,
        help="--amp is --precision fp16, --no-amp is --precision fp32",
    )
    parser.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=None,
        help="channels-last images and model weights (CUDA only; default: on when the precision is bf16 or fp16)",
    )


def evaluation_precision(args: argparse.Namespace, configured: str, device) -> Precision:
    """The :class:`Precision` of ``evaluate``'s extraction on ``device`` (``configured``: ``eval.precision``).

    As the run's own evaluation (:class:`fedreid.fl.evaluation.Evaluator`,
    :meth:`~fedreid.utils.precision.Precision.for_extraction`): fp32 touches
    no layout, a mixed precision is channels-last on CUDA unless
    ``--no-channels-last``. Errors name the flag, or ``eval.precision``.
    """
    from fedreid.utils.precision import resolve_precision

    if args.amp is not None and args.precision is not None:
        raise EvalInputError("--amp and --precision both given: --amp is --precision fp16, give one of them")
    if args.amp is not None:
        name, field = ("fp16" if args.amp else "fp32"), "--amp"
    else:
        name, field = (args.precision, "--precision") if args.precision else (configured, "eval.precision")
    devices.resolve_speedups(device, channels_last=args.channels_last)  # refuses --channels-last off CUDA
    precision = resolve_precision(name, device, field=field, channels_last=args.channels_last is not False)
    return precision if args.channels_last else precision.for_extraction()


def speedups(args: argparse.Namespace, device) -> dict:
    """``--amp`` / ``--channels-last`` decided for ``device`` and ``--backend``, as extraction keyword arguments."""
    amp, channels_last = devices.resolve_speedups(device, args.amp, args.channels_last,
                                                  backend=getattr(args, "backend", "pytorch"))
    return {"amp": amp, "channels_last": channels_last}


#: ``evaluate``'s options that steer a model's feature extraction (dest, flag), all None unless given:
#: with ``--features`` the features are already extracted, so giving one is an error, not a silent no-op.
EXTRACTION_OPTIONS = (
    ("datasets", "--datasets"), ("prepared_root", "--prepared-root"), ("batch_size", "--batch-size"),
    ("save_features", "--save-features"), ("precision", "--precision"), ("amp", "--amp/--no-amp"),
    ("channels_last", "--channels-last/--no-channels-last"), ("device", "--device"), ("client", "--client"),
)


def refuse_extraction_options(args: argparse.Namespace) -> None:
    """With ``--features``: an :class:`EvalInputError` naming the :data:`EXTRACTION_OPTIONS` given."""
    given = [flag for dest, flag in EXTRACTION_OPTIONS if getattr(args, dest, None) is not None]
    if given:
        verb = "does" if len(given) == 1 else "do"
        raise EvalInputError(
            f"{', '.join(given)} {verb} not apply to --features (the files hold features already extracted): "
            f"drop {'it' if len(given) == 1 else 'them'}, or evaluate with --model"
        )
