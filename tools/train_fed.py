#!/usr/bin/env python
"""``fedreid train`` from a checkout: the tool is :mod:`fedreid.commands.train_fed`."""

from fedreid.commands.train_fed import cli

if __name__ == "__main__":
    cli()
