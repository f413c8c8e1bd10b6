"""Raw-layout parsers, one module per dataset family, behind one registry.

>>> from fedreid.data.raw import create_raw_dataset, list_raw_datasets
>>> parser = create_raw_dataset("market1501", "datasets/raw")
>>> result = parser.parse()
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Type

from fedreid.config import BENCHMARK_DATASETS

from .base import (
    SPLIT_NAMES,
    SPLITS,
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawLayoutError,
    RawRecord,
    Skip,
)

_REGISTRY: dict[str, Type[RawDataset]] = {}

#: The modules that register parsers, imported on first use.
_PARSER_MODULES = (
    "market1501",
    "dukemtmc",
    "cuhk03np",
    "msmt17",
    "viper",
    "cuhk01",
    "prid2011",
    "threedpes",
    "ilids",
    "cuhk02",
)

#: The unlabeled public set of the knowledge-distillation step.
PUBLIC_DATASET = "cuhk02"


def register(cls: Type[RawDataset]) -> Type[RawDataset]:
    """Class decorator adding a parser to the registry under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"two raw parsers are registered as {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for module in _PARSER_MODULES:
        importlib.import_module(f"{__name__}.{module}")


def list_raw_datasets() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_raw_dataset(name: str) -> Type[RawDataset]:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown dataset {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


LAYOUTS: tuple[str, ...] = ("raw", "fedreid")


def create_raw_dataset(
    name: str, raw_root: str | Path, *, layout: str = "raw", **kwargs
) -> RawDataset:
    """A parser for dataset ``name`` under ``raw_root``.

    ``layout="raw"`` reads the dataset's official release; ``layout="fedreid"``
    reads the FedReID benchmark's processed folders (``<folder>/pytorch/...``,
    or ``cam_0/ cam_1/ meta.json split.json`` for the small datasets), see
    :mod:`fedreid.data.raw.fedreid_layout`.
    """
    if layout == "raw":
        return get_raw_dataset(name)(raw_root, **kwargs)
    if layout == "fedreid":
        from .fedreid_layout import FedReIDLayout

        get_raw_dataset(name)  # same names, same error for an unknown one
        return FedReIDLayout(raw_root, dataset=name, **kwargs)
    raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


__all__ = [
    "BENCHMARK_DATASETS",
    "PUBLIC_DATASET",
    "SPLITS",
    "SPLIT_NAMES",
    "LAYOUTS",
    "ExpectedCounts",
    "ParseResult",
    "RawDataset",
    "RawLayoutError",
    "RawRecord",
    "Skip",
    "create_raw_dataset",
    "get_raw_dataset",
    "list_raw_datasets",
    "register",
]
