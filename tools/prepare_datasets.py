#!/usr/bin/env python
"""``fedreid prepare`` from a checkout: the tool is :mod:`fedreid.commands.prepare_datasets`."""

from fedreid.commands.prepare_datasets import cli

if __name__ == "__main__":
    cli()
