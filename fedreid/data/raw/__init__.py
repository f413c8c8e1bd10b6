"""Raw-layout parsers, one module per dataset family, behind one registry.

>>> from fedreid.data.raw import create_raw_dataset, list_raw_datasets
>>> parser = create_raw_dataset("market1501", "datasets/raw")
>>> result = parser.parse()
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Mapping, Optional, Type

from fedreid.config import BENCHMARK_DATASETS, ConfigError

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

#: Constructor arguments that are not parser options: set by the caller from
#: ``data.raw_root``, ``data.split_seed`` and ``data.split_files``.
_NOT_OPTIONS = {"self": "", "raw_root": "data.raw_root", "dataset": "", "seed": "data.split_seed",
                "split_file": "data.split_files"}


def parser_options(name: str, layout: str = "raw") -> list[str]:
    """The options (``data.options.<name>``) that dataset ``name``'s parser accepts.

    Read from the constructors' keyword arguments, following ``**kwargs`` up
    to the base class, so a new option is listed as soon as it is written.
    """
    if layout == "fedreid":
        from .fedreid_layout import FedReIDLayout

        get_raw_dataset(name)  # the same error for an unknown name
        cls: type = FedReIDLayout
    elif layout == "raw":
        cls = get_raw_dataset(name)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names
        ]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return [n for n in names if n not in _NOT_OPTIONS]


def check_parser_options(
    name: str, options: Mapping[str, Any], *, layout: str = "raw", where: Optional[str] = None
) -> None:
    """A :class:`ConfigError` naming the dataset, the bad option and the allowed ones.

    Without it a misspelt option (``box`` for ``boxes``) surfaces as
    ``__init__() got an unexpected keyword argument``. ``where`` is the
    config key of ``options`` (e.g. ``data.options.cuhk03np``).
    """
    allowed = parser_options(name, layout)
    for key in options:
        if key in allowed:
            continue
        hint = f"; set it with {_NOT_OPTIONS[key]}" if _NOT_OPTIONS.get(key) else ""
        what = f"{where}.{key}: not an option" if where else f"{name}: {key!r} is not an option"
        raise ConfigError(
            f"{what} of the {name} parser (layout {layout}); "
            f"allowed options: {', '.join(allowed) or 'none'}{hint}"
        )


def create_raw_dataset(
    name: str, raw_root: str | Path, *, layout: str = "raw", **kwargs
) -> RawDataset:
    """A parser for dataset ``name`` under ``raw_root``.

    ``layout="raw"`` reads the dataset's official release; ``layout="fedreid"``
    reads the FedReID benchmark's processed folders (``<folder>/pytorch/...``,
    or ``cam_0/ cam_1/ meta.json split.json`` for the small datasets), see
    :mod:`fedreid.data.raw.fedreid_layout`. ``kwargs`` other than ``seed`` and
    ``split_file`` are parser options, checked by :func:`check_parser_options`.
    """
    if layout in LAYOUTS:
        check_parser_options(
            name, {k: v for k, v in kwargs.items() if k not in ("seed", "split_file")}, layout=layout
        )
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
    "check_parser_options",
    "create_raw_dataset",
    "get_raw_dataset",
    "list_raw_datasets",
    "parser_options",
    "register",
]
