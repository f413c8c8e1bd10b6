"""Index kinds of the gallery store: one class per FAISS index family, in a registry.

A gallery store (:mod:`fedreid.retrieval.store`) builds its index from a FAISS
factory string and records the index's *kind* in its header (``flat``,
``ivf``, ``hnsw``, ``other``). Everything the store does differently by
family lives in that family's :class:`IndexKind`:

* which FAISS classes it is (below the store's ``IndexIDMap2`` and any
  pre-transform such as OPQ or PCA): :attr:`IndexKind.classes`;
* the factory strings that build it, for error messages: :attr:`IndexKind.factories`;
* its search parameters, their defaults and the ``SearchParameters`` object
  FAISS takes: :attr:`IndexKind.search_keys`, :meth:`IndexKind.default_params`,
  :meth:`IndexKind.search_parameters`;
* the values :meth:`GalleryStore.tune` tries: :meth:`IndexKind.tune_grid`;
* the fewest training vectors and the seeding of its training:
  :meth:`IndexKind.training_need`, :meth:`IndexKind.before_training`;
* whether a filtered search is always exact and a removal rebuilds the
  segment's index (FAISS graphs cannot remove): :attr:`IndexKind.exact_filters`,
  :attr:`IndexKind.rebuild_on_remove` (fast-scan codes of any kind too:
  :func:`rebuilds_on_remove`).

Adding a family is one subclass registered in :data:`INDEX_KINDS`
(``docs/extending.md``, "Add an index kind").
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import faiss

from fedreid.registry import Registry

__all__ = [
    "DEFAULT_EF_SEARCH",
    "DEFAULT_NPROBE",
    "EF_SEARCH_CANDIDATES",
    "INDEX_KINDS",
    "NPROBE_CANDIDATES",
    "IndexKind",
    "accepts_search_parameters",
    "index_kind",
    "inner_ivf",
    "innermost",
    "is_kind_name",
    "kind_named",
    "rebuilds_on_remove",
    "search_keys",
    "supported_factories",
    "unsupported_reason",
]

DEFAULT_NPROBE = 8
DEFAULT_EF_SEARCH = 64
NPROBE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
EF_SEARCH_CANDIDATES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
#: What :func:`supported_factories` adds after the kinds' own factory strings.
PRE_TRANSFORMS = (
    "each optionally after OPQ<m>[_<d>], PCA[R]<d>, RR<d> or L2norm (e.g. Flat, IVF1024,PQ64, OPQ64,IVF1024,PQ64, "
    "HNSW32)"
)


class IndexKind:
    """A family of FAISS indexes the gallery store can build, search, update and tune.

    Subclass it, set :attr:`name`, :attr:`classes` and :attr:`factories`, override
    what differs from the defaults (an exact, untrained index with no search
    parameter), and register the class in :data:`INDEX_KINDS`. Every class the
    kind claims must search with the inner-product metric, take the store's
    ``IndexIDMap2`` around it, and keep every other item's id on ``remove_ids``
    (or set :attr:`rebuild_on_remove`).
    """

    #: The kind's name, recorded in the store's header (``kind``): never rename a released one.
    name: str = ""
    #: The FAISS class names (exact: a subclass may search or remove differently) of the innermost index.
    classes: tuple[str, ...] = ()
    #: The factory strings that build it, as listed in the "supported:" part of error messages.
    factories: str = ""
    #: The search parameters a store of this kind takes (besides ``refine``, which every kind takes).
    search_keys: tuple[str, ...] = ()
    #: A filtered search is always exact over the allowed items' stored vectors (an HNSW graph search
    #: restricted to a few items can return fewer than k).
    exact_filters: bool = False
    #: A removal rebuilds the segment's index from the remaining stored vectors (FAISS cannot remove from it).
    rebuild_on_remove: bool = False
    #: FAISS's search takes ``SearchParameters`` (and so an id selector); without, a filtered search is exact
    #: over the allowed items' stored vectors. (A plain ``IndexPQ`` of the ``other`` kind takes none either.)
    takes_search_parameters: bool = True

    @classmethod
    def matches(cls, inner: Any) -> bool:
        """Whether ``inner`` (the downcast innermost index) is one of this kind's classes."""
        return type(inner).__name__ in cls.classes

    @classmethod
    def default_params(cls, index: Any) -> dict[str, int]:
        """The search parameters of a new store over ``index`` (the trained ``IndexIDMap2`` template)."""
        return {}

    @classmethod
    def search_parameters(cls, search: Mapping[str, int]) -> Any:
        """The ``faiss.SearchParameters`` of the store's ``search`` parameters (a selector is set by the caller)."""
        return faiss.SearchParameters()

    @classmethod
    def tune_grid(cls, template: Any) -> tuple[Optional[str], list[int]]:
        """``(parameter, values in the order tried)`` for :meth:`GalleryStore.tune`; ``(None, [])``: nothing to tune."""
        return None, []

    @classmethod
    def training_need(cls, index: Any) -> tuple[int, str]:
        """The fewest training vectors the untrained ``index`` (``IndexIDMap2``) can be trained on, and why."""
        return 1, ""

    @classmethod
    def before_training(cls, index: Any, seed: int, clustering_index: Any = None) -> None:
        """Seed the training of ``index`` (``IndexIDMap2``); ``clustering_index``: what a k-means assigns with."""

    @classmethod
    def after_training(cls, index: Any) -> None:
        """Undo what :meth:`before_training` set that must not be written with the index."""


#: The index kinds, by the name a store's header records.
INDEX_KINDS: Registry[type[IndexKind]] = Registry("index kind")


def _pq_need(index: Any) -> tuple[int, str]:
    pq = getattr(index, "pq", None)
    if pq is not None:
        return int(pq.ksub), f"PQ with {pq.ksub} centroids per sub-quantizer"
    return 1, ""


@INDEX_KINDS.register
class FlatKind(IndexKind):
    """Exact search over the stored vectors (``Flat``)."""

    name = "flat"
    classes = ("IndexFlat", "IndexFlatIP")
    factories = "Flat"


@INDEX_KINDS.register
class IVFKind(IndexKind):
    """Inverted lists (``IVF<lists>``) over flat, PQ (also fast-scan) or SQ codes; ``nprobe`` lists searched."""

    name = "ivf"
    classes = ("IndexIVFFlat", "IndexIVFPQ", "IndexIVFScalarQuantizer", "IndexIVFPQFastScan")
    factories = "IVF<lists>[_HNSW<M>],Flat|PQ<m>[x<bits>][fs]|SQ<bits>"
    search_keys = ("nprobe",)

    @classmethod
    def default_params(cls, index: Any) -> dict[str, int]:
        return {"nprobe": int(min(DEFAULT_NPROBE, inner_ivf(index).nlist))}

    @classmethod
    def search_parameters(cls, search: Mapping[str, int]) -> Any:
        return faiss.SearchParametersIVF(nprobe=int(search["nprobe"]))

    @classmethod
    def tune_grid(cls, template: Any) -> tuple[Optional[str], list[int]]:
        nlist = int(inner_ivf(template).nlist)
        return "nprobe", sorted({min(v, nlist) for v in NPROBE_CANDIDATES})

    @classmethod
    def training_need(cls, index: Any) -> tuple[int, str]:
        ivf = inner_ivf(index)
        need, why = int(ivf.nlist), f"IVF with {ivf.nlist} lists"
        pq_need, pq_why = _pq_need(faiss.downcast_index(ivf))
        return (pq_need, pq_why) if pq_need > need else (need, why)

    @classmethod
    def before_training(cls, index: Any, seed: int, clustering_index: Any = None) -> None:
        ivf = inner_ivf(index)
        ivf.cp.seed = int(seed)
        pq = getattr(faiss.downcast_index(ivf), "pq", None)
        if pq is not None:
            pq.cp.seed = int(seed)
        if clustering_index is not None:
            ivf.clustering_index = clustering_index

    @classmethod
    def after_training(cls, index: Any) -> None:
        inner_ivf(index).clustering_index = None  # never written with the index


@INDEX_KINDS.register
class HNSWKind(IndexKind):
    """A graph (``HNSW<M>``) over flat or SQ codes; ``efSearch`` candidates kept while searching."""

    name = "hnsw"
    classes = ("IndexHNSWFlat", "IndexHNSWSQ")
    factories = "HNSW<M>[,Flat|SQ<bits>]"
    search_keys = ("efSearch",)
    exact_filters = True
    rebuild_on_remove = True

    @classmethod
    def default_params(cls, index: Any) -> dict[str, int]:
        return {"efSearch": DEFAULT_EF_SEARCH}

    @classmethod
    def search_parameters(cls, search: Mapping[str, int]) -> Any:
        return faiss.SearchParametersHNSW(efSearch=int(search["efSearch"]))

    @classmethod
    def tune_grid(cls, template: Any) -> tuple[Optional[str], list[int]]:
        return "efSearch", list(EF_SEARCH_CANDIDATES)


@INDEX_KINDS.register
class CodesKind(IndexKind):
    """Compressed codes scanned in full (``PQ<m>``, ``SQ<bits>``): no search parameter."""

    name = "other"
    classes = ("IndexPQ", "IndexScalarQuantizer")
    factories = "PQ<m>; SQ<bits>"

    @classmethod
    def training_need(cls, index: Any) -> tuple[int, str]:
        return _pq_need(faiss.downcast_index(index.index))


# --------------------------------------------------------------------------
# Looking kinds up
# --------------------------------------------------------------------------


def innermost(index: Any) -> Any:
    """The index below the store's ``IndexIDMap2`` and any ``IndexPreTransform`` (downcast)."""
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return inner


def inner_ivf(index: Any) -> Any:
    """The IVF inside an ``IndexIDMap2`` (through any pre-transform such as OPQ), or None."""
    return faiss.try_extract_index_ivf(faiss.downcast_index(index.index))


def index_kind(index: Any) -> str:
    """The name of the kind whose classes include ``index``'s innermost class; ``"unsupported"`` when none."""
    inner = innermost(index)
    for kind in INDEX_KINDS.values():
        if kind.matches(inner):
            return kind.name
    return "unsupported"


def rebuilds_on_remove(index: Any) -> bool:
    """Whether a removal from ``index`` (the store's ``IndexIDMap2``) rebuilds it from the remaining stored vectors.

    True for a kind with :attr:`IndexKind.rebuild_on_remove` and for every
    fast-scan index (``PQ<m>x4fs`` codes, with or without IVF or OPQ).
    """
    if kind_named(index_kind(index)).rebuild_on_remove:
        return True
    # FAISS packs fast-scan codes 32 to a block, interleaved, and its remove_ids shrinks a list by whole
    # blocks only: the freed slots of the last block keep the codes that were there (the erased item's, or
    # the one moved into its place), and write_index writes them. Zeroing those slots in place would depend
    # on FAISS's packing layout; encoding the remaining stored vectors again with the same trained index is
    # deterministic, gives exactly the codes they had, and leaves every unused slot zero, as a fresh build does.
    fast_scan = tuple(getattr(faiss, name) for name in ("IndexFastScan", "IndexIVFFastScan") if hasattr(faiss, name))
    return isinstance(innermost(index), fast_scan)


def kind_named(name: str) -> type[IndexKind]:
    """The registered kind called ``name`` (a store header's ``kind``)."""
    return INDEX_KINDS.get(name)


def supported_factories() -> str:
    """The factory strings of every registered kind, for error messages."""
    return "; ".join([kind.factories for kind in INDEX_KINDS.values() if kind.factories] + [PRE_TRANSFORMS])


def unsupported_reason(index: Any) -> Optional[str]:
    """None when ``index`` (the store's ``IndexIDMap2``) is of a registered kind with the inner-product metric;
    else the FAISS class name of what it holds."""
    kind = index_kind(index)
    if kind != "unsupported" and innermost(index).metric_type == faiss.METRIC_INNER_PRODUCT:
        return None
    return type(innermost(index)).__name__


def accepts_search_parameters(index: Any) -> bool:
    """Whether the store's index takes ``SearchParameters`` (with a selector): a plain PQ takes none, nor a kind
    whose :attr:`IndexKind.takes_search_parameters` is False."""
    if isinstance(innermost(index), faiss.IndexPQ):
        return False
    name = index_kind(index)
    return name not in INDEX_KINDS or INDEX_KINDS[name].takes_search_parameters


def search_keys(name: str) -> tuple[str, ...]:
    """The search parameters of the kind called ``name`` (none for a name no kind has)."""
    return INDEX_KINDS[name].search_keys if isinstance(name, str) and name in INDEX_KINDS else ()


def is_kind_name(name: Any) -> bool:
    """Whether ``name`` is a registered kind's name (a store header's ``kind``)."""
    return isinstance(name, str) and name in INDEX_KINDS
