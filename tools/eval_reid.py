#!/usr/bin/env python
"""``fedreid eval`` from a checkout: the tool is :mod:`fedreid.commands.eval_reid`."""

from fedreid.commands.eval_reid import cli

if __name__ == "__main__":
    cli()
