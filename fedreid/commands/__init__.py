"""The command-line tools, inside the package so that an installed fedreid works outside a checkout.

Each module parses arguments, calls the library and prints; ``main(argv)``
returns an exit code and ``cli()`` is its console entry point. They are
reached three ways, all the same code:

* ``fedreid <command> ...`` or ``python -m fedreid <command> ...`` (:mod:`fedreid.__main__`);
* ``fedreid-<command> ...`` (console scripts installed by ``pip install``);
* ``python tools/<module>.py ...`` from a checkout, as the docs show.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: command name -> (module under fedreid.commands, one line for ``fedreid --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("prepare_datasets", "raw datasets (or the synthetic world) -> prepared folders"),
    "train": ("train_fed", "federated training in one process (FedPav, CDW, KD, the baselines)"),
    "eval": ("eval_reid", "evaluate a model; index, query, export, serve a gallery"),
    "reproduce": ("reproduce", "rerun a paper's table and publish paper vs ours"),
    "flower": ("flower_fed", "federated training and search across machines on Flower"),
}


def command_module(name: str) -> ModuleType:
    """The module of command ``name`` (a key of :data:`COMMANDS`), imported on demand."""
    return importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
