"""Raw-layout parsers, one module per dataset family, behind one registry.

>>> from fedreid.data.raw import create_raw_dataset, list_raw_datasets
>>> parser = create_raw_dataset("market1501", "datasets/raw")
>>> result = parser.parse()

A parser's options are the fields of its ``Options`` dataclass
(:attr:`RawDataset.Options`); :func:`check_parser_options` builds them from
``data.options.<name>``. This package never imports the config module
(the config imports it to check those options).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional, Type

from fedreid.data.benchmark import BENCHMARK_DATASETS, PUBLIC_DATASET
from fedreid.registry import Registry

from .base import (
    SPLIT_NAMES,
    SPLITS,
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawLayoutError,
    RawRecord,
    Skip,
    build_parser_options,
)

#: Raw-layout parsers by dataset name; the modules listed register them on first use.
PARSERS: Registry[Type[RawDataset]] = Registry(
    "dataset",
    locations=tuple(f"{__name__}.{module}" for module in (
        "market1501", "dukemtmc", "cuhk03np", "msmt17", "viper", "cuhk01", "prid2011", "threedpes", "ilids", "cuhk02",
    )),
)

#: Class decorator adding a parser to :data:`PARSERS` under ``cls.name``.
register = PARSERS.register


def list_raw_datasets() -> list[str]:
    return PARSERS.names()


def get_raw_dataset(name: str) -> Type[RawDataset]:
    """The parser class of dataset ``name``; an :class:`~fedreid.registry.UnknownNameError` (also a KeyError) otherwise."""
    return PARSERS.get(name)


LAYOUTS: tuple[str, ...] = ("raw", "fedreid")


def parser_class(name: str, layout: str = "raw") -> Type[RawDataset]:
    """The class that reads dataset ``name`` in ``layout`` (an :class:`~fedreid.registry.UnknownNameError` for an unknown name)."""
    if layout == "fedreid":
        from .fedreid_layout import FedReIDLayout

        get_raw_dataset(name)  # the same error for an unknown name
        return FedReIDLayout
    if layout == "raw":
        return get_raw_dataset(name)
    raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def parser_options(name: str, layout: str = "raw") -> list[str]:
    """The options (``data.options.<name>``) that dataset ``name``'s parser accepts: its ``Options`` fields."""
    return [f.name for f in dataclasses.fields(parser_class(name, layout).Options)]


def check_parser_options(
    name: str, options: Mapping[str, Any], *, layout: str = "raw", where: Optional[str] = None
) -> Any:
    """Dataset ``name``'s typed parser options built from ``options``; a :class:`ConfigError` if they do not build.

    The error names the dataset, the bad option or value and the allowed
    options (:func:`fedreid.data.raw.base.build_parser_options`). ``where`` is
    the config key of ``options`` (e.g. ``data.options.cuhk03np``).
    """
    return build_parser_options(parser_class(name, layout), name, options, where=where)


def create_raw_dataset(
    name: str, raw_root: str | Path, *, layout: str = "raw", **kwargs
) -> RawDataset:
    """A parser for dataset ``name`` under ``raw_root``.

    ``layout="raw"`` reads the dataset's official release; ``layout="fedreid"``
    reads the FedReID benchmark's processed folders (``<folder>/pytorch/...``,
    or ``cam_0/ cam_1/ meta.json split.json`` for the small datasets), see
    :mod:`fedreid.data.raw.fedreid_layout`. ``kwargs`` other than ``seed`` and
    ``split_file`` are parser options, built and checked by the parser
    (:func:`check_parser_options`).
    """
    cls = parser_class(name, layout)
    if layout == "fedreid":
        return cls(raw_root, dataset=name, **kwargs)
    return cls(raw_root, **kwargs)


__all__ = [
    "BENCHMARK_DATASETS",
    "PUBLIC_DATASET",
    "SPLITS",
    "SPLIT_NAMES",
    "LAYOUTS",
    "PARSERS",
    "ExpectedCounts",
    "ParseResult",
    "RawDataset",
    "RawLayoutError",
    "RawRecord",
    "Skip",
    "build_parser_options",
    "check_parser_options",
    "create_raw_dataset",
    "get_raw_dataset",
    "list_raw_datasets",
    "parser_class",
    "parser_options",
    "register",
]
