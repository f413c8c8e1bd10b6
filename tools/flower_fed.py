#!/usr/bin/env python
"""``fedreid flower`` from a checkout: the tool is :mod:`fedreid.commands.flower_fed`."""

from fedreid.commands.flower_fed import cli

if __name__ == "__main__":
    cli()
