"""The root of fedreid's input errors.

Every error raised because of what a user gave (a config value, a file, a
folder layout, a dataset) derives from :class:`FedReIDError` as well as from
the built-in type that fits it (``ValueError``, ``OSError``...), so library
callers can catch either and the tools print it as one line
(:func:`fedreid.utils.cli.run_main`) instead of a traceback. The built-in
OSErrors about a path the user gave (missing, already existing, not permitted,
a folder where a file was expected or the reverse) are printed the same way
without wrapping (``fedreid.utils.cli.USER_PATH_ERRORS``).
"""

from __future__ import annotations


class FedReIDError(Exception):
    """Bad input; the message names the file, key or value and what was expected."""


__all__ = ["FedReIDError"]
