"""What every tool shares: ``--config FILE`` plus ``key=value`` overrides, and :func:`run_main`.

Overrides may stand anywhere among the options (``fl.rounds=1 --no-progress
seed=2``), in subcommands too (:func:`add_override_arguments`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

import yaml

from fedreid.errors import ConfigError, FedReIDError

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


#: Exit status of a tool whose output pipe was closed by its reader (``| head``):
#: what a process killed by SIGPIPE reports to a shell (128 + 13).
BROKEN_PIPE_EXIT = 141


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (a size or a count, where 0 would silently mean "the default")."""
    return _int_at_least(text, 1)


def count_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 0 (how many of something; 0 means none)."""
    return _int_at_least(text, 0)


def show_progress(args: argparse.Namespace) -> bool:
    """Whether a tool draws progress bars: stderr is a terminal and ``--no-progress`` was not given."""
    return not args.no_progress and sys.stderr.isatty()


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number > 0 (a size in GiB, a limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and the ``key=value`` overrides (see :func:`add_override_arguments`)."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML experiment config (defaults are used without one)"
    )
    add_override_arguments(parser)


def add_override_arguments(
    parser: argparse.ArgumentParser,
    help: str = "config overrides applied after the file, e.g. data.workers=4 seed=1",
) -> None:
    """The positional ``key=value`` overrides (``args.overrides``), accepted anywhere among the options.

    argparse alone takes one contiguous run of positionals, so
    ``fl.rounds=1 --no-progress seed=2`` would fail on ``seed=2``. The parser
    is made to collect every leftover argument that is not an option into
    ``args.overrides``, in command-line order; unknown options are still
    refused. This works for a subcommand's parser too (argparse parses a
    subcommand with the subparser's ``parse_known_args``).
    """
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=help)
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):  # the signature argparse calls
        namespace, extras = parse_known(args, namespace)
        stray = [a for a in extras if not a.startswith("-")]
        if stray and hasattr(namespace, "overrides"):
            namespace.overrides = list(namespace.overrides or []) + stray
            extras = [a for a in extras if a.startswith("-")]
        return namespace, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


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


def checked_overrides(args: argparse.Namespace, flag_overrides: Sequence[str] = ()) -> list[str]:
    """The overrides to load ``--config`` with: the positional ``key=value`` pairs, then the flags.

    Flags are explicit command-line options (``--out``) turned into overrides by
    the tool, so they win over both the file and generic ``key=value`` pairs
    (``load_config(args.config, checked_overrides(args, flags))``). Path-valued
    flags must be built with :func:`literal_override`. A positional argument
    that is not ``key=value`` is a ConfigError, and so is an override of a
    key a flag sets to another value (``--rounds 5 fl.rounds=3``): one of
    the two would be dropped without a word.
    """
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"unexpected argument {item!r}: overrides look like key.sub=value")
    for flag in flag_overrides:
        flag_key = flag.partition("=")[0].strip()
        for item in args.overrides:
            key = item.partition("=")[0].strip()
            same_key = key == flag_key
            if (same_key and override_value(item.partition("=")[2]) != override_value(flag.partition("=")[2])) or (
                    not same_key and (key.startswith(flag_key + ".") or flag_key.startswith(key + "."))):
                raise ConfigError(f"the override {item!r} and a command-line option ({flag}) both set "
                                  f"{min(key, flag_key, key=len)}: give it once")
    return list(args.overrides) + list(flag_overrides)


def override_value(raw: str) -> Any:
    """The value of a ``key=value`` override from its text ``raw``: YAML (``3``, ``[a, b]``, ``'quoted'``).

    A value YAML reads as a plain string is taken as typed (stripped): YAML
    would drop `` #...`` as a comment, so ``run.out_dir=/tmp/run #2`` would
    name another folder.
    """
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):
        value = raw.strip()  # a plain scalar as typed, a ' #' included
    return value


def run_main(main: Callable[[], int]) -> None:
    """Run a tool's ``main``; input errors print one clear line, not a traceback.

    Input errors are :class:`~fedreid.errors.FedReIDError` (bad config, layout,
    dataset, checkpoint, weights file...) and the OS errors about a path the
    user gave (:data:`USER_PATH_ERRORS`: missing, already existing, not
    readable or writable, a folder where a file was expected or the reverse).
    A reader that closes the tool's output early (``tool | head -1``) ends
    the tool quietly with :data:`BROKEN_PIPE_EXIT`, whether the pipe broke
    while printing or when the last output is flushed.
    """
    try:
        try:
            code = main()
        except SystemExit as exc:  # argparse's --help and usage errors print before they exit
            code = exc.code
        except (FedReIDError, *USER_PATH_ERRORS) as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            code = 130
        sys.stdout.flush()  # inside the try: the interpreter's own flush at exit would print a traceback
    except BrokenPipeError:
        # Whatever is still buffered goes nowhere, so the flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = BROKEN_PIPE_EXIT
    sys.exit(code)
