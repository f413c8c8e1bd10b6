"""``fedreid <command> [options]`` and ``python -m fedreid <command> [options]``.

Each command is one of the tools (:data:`fedreid.commands.COMMANDS`);
``fedreid <command> --help`` prints that tool's help.
"""

from __future__ import annotations

import sys
from typing import Optional

from fedreid import __version__
from fedreid.commands import COMMANDS, command_module
from fedreid.options import did_you_mean
from fedreid.utils.cli import run_main


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: fedreid <command> [options]    (fedreid {__version__})", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "'fedreid <command> --help' explains a command; 'fedreid-<command>' is the same tool."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``argv[0]``'s tool on the rest of ``argv``; its exit code (2 for an unknown command)."""
    from_shell = argv is None
    argv = sys.argv[1:] if from_shell else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"fedreid {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}{did_you_mean(name, list(COMMANDS))}; "
              f"one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = command_module(name)
    if from_shell:  # argparse names the program after argv[0]: the help reads "usage: fedreid train ..."
        sys.argv[0] = f"fedreid {name}"
    return module.main(rest)


def cli() -> None:
    """The ``fedreid`` console script."""
    run_main(main)


if __name__ == "__main__":
    cli()
