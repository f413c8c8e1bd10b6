#!/usr/bin/env python
"""``fedreid reproduce`` from a checkout: the tool is :mod:`fedreid.commands.reproduce`."""

from fedreid.commands.reproduce import cli

if __name__ == "__main__":
    cli()
