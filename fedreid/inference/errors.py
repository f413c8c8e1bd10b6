"""The input error of the evaluation tool and the modules behind it (model files, images, devices, exports).

Errors for bad inputs are :class:`FileNotFoundError` (a missing path),
:class:`EvalInputError` (a :class:`~fedreid.errors.ConfigError`) or
:class:`~fedreid.errors.EvalDataError` (bad features or ids, re-raised
with the dataset and the file or model they came from); all are printed
as one line by ``run_main`` and name the offending path or value.
"""

from __future__ import annotations

from fedreid.errors import ConfigError

__all__ = ["EvalInputError"]


class EvalInputError(ConfigError):
    """A bad input of the evaluation tool (unreadable model, unknown dataset, empty folder...)."""
