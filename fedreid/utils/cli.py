"""What every tool shares: ``--config FILE`` plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

import yaml

from fedreid.config import ConfigError, load_config
from fedreid.errors import FedReIDError

#: Built-in errors that are about a path the user gave (a missing config, an
#: existing run folder, an unreadable dataset folder, a file where a folder was
#: expected...): shown as one line like :class:`FedReIDError`. Other OSErrors
#: (a full disk, a broken connection) keep their traceback.
USER_PATH_ERRORS: tuple[type[OSError], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="YAML experiment config (defaults are used without one)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides applied after the file, e.g. data.workers=4 seed=1",
    )


def literal_override(key: str, value: str) -> str:
    """A ``key=value`` override whose value is read back as exactly the string ``value``.

    Overrides are parsed as YAML, which suits typed values (``3``, ``[a, b]``)
    but mangles paths: ``/tmp/run #2`` would lose ``#2`` as a comment,
    ``/x/my: out`` would become a mapping, ``null`` or ``true`` would not stay
    strings. Tools build their path flags with this, so that ``--out`` means
    the folder the user typed.
    """
    try:
        quoted = yaml.safe_dump(value, default_style='"', width=float("inf"), allow_unicode=True)
        ok = yaml.safe_load(quoted) == value
    except yaml.YAMLError:
        ok = False
    if not ok:
        raise ConfigError(f"{key}: the value {value!r} cannot be passed as a config string")
    return f"{key}={quoted.rstrip(chr(10))}"


def config_from_args(args: argparse.Namespace, flag_overrides: Sequence[str] = ()) -> Any:
    """The config from ``--config``, then the positional overrides, then the flags.

    Flags are explicit command-line options (``--out``) turned into overrides by
    the tool, so they win over both the file and generic ``key=value`` pairs.
    Path-valued flags must be built with :func:`literal_override`.
    """
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"unexpected argument {item!r}: overrides look like key.sub=value")
    return load_config(args.config, list(args.overrides) + list(flag_overrides))


def run_main(main: Callable[[], int]) -> None:
    """Run a tool's ``main``; input errors print one clear line, not a traceback.

    Input errors are :class:`~fedreid.errors.FedReIDError` (bad config, layout,
    dataset, checkpoint, weights file...) and the OS errors about a path the
    user gave (:data:`USER_PATH_ERRORS`: missing, already existing, not
    readable or writable, a folder where a file was expected or the reverse).
    """
    try:
        code = main()
    except (FedReIDError, *USER_PATH_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
