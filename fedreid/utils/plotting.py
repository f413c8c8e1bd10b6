"""Figures without pyplot: a bare matplotlib ``Figure`` on its own Agg canvas.

Library code draws through :func:`agg_figure` and never calls
``matplotlib.use`` or pyplot, so the backend of the process that calls it (a
notebook's, a Flower app's, a user's script) stays what it was, and no figure
is left in pyplot's registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["agg_figure"]


def agg_figure(nrows: int = 1, ncols: int = 1, **figure_kw: Any) -> tuple["Figure", Any]:
    """``(figure, axes)``: ``Figure(**figure_kw)`` on an Agg canvas and ``figure.subplots(nrows, ncols)``.

    ``axes`` is one ``Axes`` for a 1 x 1 grid, else an array of them (as
    ``Figure.subplots`` gives). Save with ``figure.savefig``; nothing to close.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**figure_kw)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(nrows, ncols)
