"""A model's embedding as a module, and dataset batches in the loader contract of feature extraction.

:class:`EmbedModule` makes ``model.embed`` the ``forward`` that
:func:`fedreid.inference.features.extract_features` calls;
:class:`FeatureBatches` renames a dataset loader's batch keys
(``image``/``pid``/``camid``) to that function's loader contract
(``images``/``pids``/``camids``). This module imports torch;
:mod:`fedreid.inference.features` does not.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from torch import Tensor, nn

__all__ = ["EmbedModule", "FeatureBatches"]


class EmbedModule(nn.Module):
    """A module whose ``forward`` is ``model.embed`` (what feature extraction calls)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.embed(x)


class FeatureBatches:
    """Adapts dataset batches (``image``/``pid``/``camid``) to the loader contract of
    :func:`fedreid.inference.features.extract_features` (``images``/``pids``/``camids``)."""

    def __init__(self, loader: Iterable[Mapping[str, Any]]) -> None:
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            yield {"images": batch["image"], "pids": batch["pid"], "camids": batch["camid"]}

    def __len__(self) -> int:
        return len(self.loader)
