"""What every tool shares: ``--config FILE`` plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from fedreid.config import ConfigError, load_config
from fedreid.errors import FedReIDError


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


def config_from_args(args: argparse.Namespace, flag_overrides: Sequence[str] = ()) -> Any:
    """The config from ``--config``, then the positional overrides, then the flags.

    Flags are explicit command-line options (``--out``) turned into overrides by
    the tool, so they win over both the file and generic ``key=value`` pairs.
    """
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"unexpected argument {item!r}: overrides look like key.sub=value")
    return load_config(args.config, list(args.overrides) + list(flag_overrides))


def run_main(main: Callable[[], int]) -> None:
    """Run a tool's ``main``; input errors print one clear line, not a traceback.

    Input errors are :class:`~fedreid.errors.FedReIDError` (bad config, layout,
    dataset, checkpoint, weights file...) and missing or already existing files.
    """
    try:
        code = main()
    except (FedReIDError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
