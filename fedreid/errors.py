"""The root of fedreid's input errors.

Every error raised because of what a user gave (a config value, a file, a
folder layout, a dataset) derives from :class:`FedReIDError` as well as from
the built-in type that fits it (``ValueError``, ``OSError``...), so library
callers can catch either and the tools print it as one line
(:func:`fedreid.utils.cli.run_main`) instead of a traceback. The built-in
OSErrors about a path the user gave (missing, already existing, not permitted,
a folder where a file was expected or the reverse) are printed the same way
without wrapping (``fedreid.utils.cli.USER_PATH_ERRORS``).

:class:`EvalDataError` (bad features, ids or evaluation options) is defined
here because both feature extraction (:mod:`fedreid.inference`) and the
metrics (:mod:`fedreid.eval`) raise it.
"""

from __future__ import annotations


class FedReIDError(Exception):
    """Bad input; the message names the file, key or value and what was expected."""


class ConfigError(FedReIDError, ValueError):
    """A bad configuration key or value; the message names the key.

    ``key``: the full dotted key at fault, where known (a config file's
    loader uses it to name the file's line).
    """

    key: str | None = None


class EvalDataError(FedReIDError, ValueError):
    """Bad evaluation input (empty sets, mismatched lengths, NaN/inf features, no query with a match...).

    A :class:`~fedreid.errors.FedReIDError`, so the tools print it as one
    line, and a ``ValueError``, so library callers catching that keep working.
    The message names the array or option and what was expected.
    """


__all__ = ["ConfigError", "EvalDataError", "FedReIDError"]
