"""Evaluation protocols over one dataset's features: a registry of :class:`EvalProtocol` classes.

A protocol is how one dataset's query and gallery features become the
reported numbers. The built-ins:

* ``standard``: single-query CMC/mAP over the whole filtered gallery
  (:func:`fedreid.eval.metrics.evaluate`, or ``evaluate_scores`` after
  :func:`fedreid.eval.rerank.k_reciprocal_rerank` when re-ranking is asked);
* ``cuhk03``: the old CUHK03 single-gallery-shot CMC with the standard mAP
  (:func:`~fedreid.eval.metrics.evaluate_cuhk03_single_shot`, the protocol
  of torchreid's ``eval_cuhk03``).

Each is a subclass of :class:`EvalProtocol` registered in
:data:`EVAL_PROTOCOLS` (a :class:`fedreid.registry.Registry`); the tool's
``--protocol`` choices, the checks of its options, the evaluation, the CMC
plot's title and the lines of ``results.json`` and ``report.md`` are looked
up there, so a new protocol is one class plus its registration
(``docs/extending.md``, "Add an evaluation protocol").

Memory: metrics come from the block-wise :func:`~fedreid.eval.metrics.evaluate`
(no query x gallery matrix); the ranked-list pictures need the scores of the
few drawn queries only (:func:`fedreid.eval.query_picking.query_scores`). The
one exception is re-ranking, whose algorithm needs the full matrices (guarded
by :func:`fedreid.eval.rerank.estimate_rerank_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

import numpy as np

from fedreid.eval.metrics import AP_MODES, DEFAULT_BLOCK_BYTES, EvalDataError
from fedreid.eval.rerank import DEFAULT_MAX_BYTES as DEFAULT_RERANK_BYTES
from fedreid.inference.dataset_features import DatasetFeatures, _check_dataset_features
from fedreid.inference.errors import EvalInputError
from fedreid.options import NoOptions, build_options
from fedreid.registry import Registry

__all__ = [
    "CMC_RANKS",
    "CUHK03_REPEATS",
    "EVAL_PROTOCOLS",
    "PROTOCOLS",
    "Cuhk03Protocol",
    "EvalProtocol",
    "StandardProtocol",
    "build_protocol",
    "check_protocol",
    "evaluate_dataset",
    "register_protocol",
    "report_note",
    "summary_row",
]

#: Ranks evaluated (rank 1..CMC_RANKS for the CMC plot; the table shows 1/5/10).
CMC_RANKS = 20
#: Samplings averaged by the CUHK03 protocol (as torchreid's ``eval_cuhk03``).
CUHK03_REPEATS = 10


class EvalProtocol:
    """One evaluation protocol: how a dataset's features become its metrics.

    A subclass sets :attr:`name` (its ``--protocol`` value and the
    ``protocol`` of ``results.json``), :attr:`title` (the CMC plot's),
    :attr:`help` (its part of ``--protocol``'s help), optionally an
    :attr:`Options` dataclass (built by :func:`build_protocol`), and
    implements :meth:`evaluate`; it is registered with
    :func:`register_protocol`. The defaults of :meth:`check`,
    :meth:`default_ap`, :meth:`describe`, :meth:`report_fields` and
    :meth:`report_note` follow from :attr:`ap_modes` and
    :attr:`supports_rerank`.
    """

    #: ``--protocol`` value, registry key, ``results.json``'s ``protocol``.
    name: ClassVar[str] = ""
    #: The options dataclass; :func:`build_protocol` builds and checks it.
    Options: ClassVar[type] = NoOptions
    #: Title of the CMC plot (``cmc.png``) when the run is not re-ranked.
    title: ClassVar[str] = "CMC"
    #: What it reports, shown after its name in ``--protocol``'s help ("" for nothing).
    help: ClassVar[str] = ""
    #: The AP forms (``--ap``) it reports; the first is its default when the config's is not among them.
    ap_modes: ClassVar[tuple[str, ...]] = AP_MODES
    #: Whether ``--rerank`` (k-reciprocal re-ranking) may run with it; its :meth:`evaluate` then
    #: also takes ``rerank_max_bytes``, the re-ranking's memory limit, when re-ranking.
    supports_rerank: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options

    @classmethod
    def check(cls, *, ap: str, rerank: bool) -> None:
        """Refuse options this protocol cannot honour (:class:`EvalInputError`), before anything runs."""
        if rerank and not cls.supports_rerank:
            raise EvalInputError(f"--rerank is not available with --protocol {cls.name}")
        if ap not in cls.ap_modes:
            raise EvalInputError(
                f"--protocol {cls.name} reports the {' or '.join(cls.ap_modes)} AP, not --ap {ap}"
            )

    @classmethod
    def default_ap(cls, configured: str) -> str:
        """The AP form when ``--ap`` is not given: the config's ``eval.ap`` if this protocol reports it."""
        return configured if configured in cls.ap_modes else cls.ap_modes[0]

    def evaluate(
        self,
        feats: DatasetFeatures,
        *,
        ap: str,
        rerank: bool,
        seed: int,
        ranks: Sequence[int],
        max_block_bytes: int,
    ) -> tuple[dict[str, Any], Optional[np.ndarray]]:
        """``(result, reranked)`` for checked features, as :func:`evaluate_dataset` returns them.

        ``result`` holds ``rank{k}`` for every k in ``ranks``, ``mAP``, the
        counts of :func:`fedreid.eval.metrics.evaluate` (``num_queries``,
        ``num_valid_queries``, ``num_queries_without_match``), ``ranks`` and
        ``per_query`` (for the pictures); ``reranked`` is the query x gallery
        similarity the pictures must show, or None (they recompute the
        feature scores of the drawn queries). Bad features or ids raise
        :class:`~fedreid.eval.metrics.EvalDataError`.
        """
        raise NotImplementedError

    def describe(self, seed: int) -> str:
        """What the tool prints after the AP form (``"standard AP<this>"``)."""
        return ""

    def report_fields(self, seed: int) -> dict[str, Any]:
        """Keys added to ``results.json`` (after the others)."""
        return {}

    @classmethod
    def report_note(cls, results: Mapping[str, Any]) -> str:
        """Text added to ``report.md``'s description of a ``results.json`` this protocol wrote."""
        return ""


#: Every evaluation protocol by name; ``--protocol`` offers its names in registration order.
#: The built-ins are defined below; a protocol in a module of its own is
#: registered by adding that module to ``locations`` (imported on the first lookup).
EVAL_PROTOCOLS: Registry[type[EvalProtocol]] = Registry("evaluation protocol", locations=())


def register_protocol(cls: type[EvalProtocol]) -> type[EvalProtocol]:
    """Class decorator: add ``cls`` to :data:`EVAL_PROTOCOLS` under ``cls.name``."""
    return EVAL_PROTOCOLS.register(cls)


@register_protocol
class StandardProtocol(EvalProtocol):
    """Single-query CMC/mAP over the whole filtered gallery, either AP form, optionally re-ranked."""

    name = "standard"
    supports_rerank = True

    def evaluate(self, feats, *, ap, rerank, seed, ranks, max_block_bytes, rerank_max_bytes=DEFAULT_RERANK_BYTES):
        from fedreid.eval.metrics import evaluate, evaluate_scores

        q, g = feats.query, feats.gallery
        ids = (q.pids, g.pids, q.camids, g.camids)
        common = {"ranks": ranks, "return_per_query": True, "max_block_bytes": max_block_bytes}
        if not rerank:
            return evaluate(q.features, g.features, *ids, ap=ap, **common), None
        from fedreid.eval.rerank import k_reciprocal_rerank

        reranked = k_reciprocal_rerank(q.features, g.features, max_bytes=rerank_max_bytes)
        np.negative(reranked, out=reranked)  # distance -> similarity, in place (no second Q x G array)
        return evaluate_scores(reranked, *ids, ap=ap, **common), reranked


@dataclass
class Cuhk03Options:
    """Options of the ``cuhk03`` evaluation protocol."""

    #: One-image-per-identity samplings averaged (torchreid's ``eval_cuhk03`` draws 10).
    num_repeats: int = CUHK03_REPEATS

    def validate(self, prefix: str) -> None:
        if self.num_repeats < 1:
            raise EvalInputError(f"{prefix}.num_repeats: expected >= 1, got {self.num_repeats}")


@register_protocol
class Cuhk03Protocol(EvalProtocol):
    """The old CUHK03 single-gallery-shot CMC (standard mAP), as torchreid's ``eval_cuhk03``.

    The samplings draw from ``numpy.random.default_rng(seed)``, a fresh
    generator per dataset so the figures do not depend on which other
    datasets are evaluated; standard AP only, no re-ranking.
    """

    name = "cuhk03"
    Options = Cuhk03Options
    title = "CMC (CUHK03 single-gallery-shot)"
    help = "single-gallery-shot CMC, 10 seeded samplings"
    ap_modes = ("standard",)

    @classmethod
    def check(cls, *, ap: str, rerank: bool) -> None:
        if rerank:
            raise EvalInputError("--rerank is not available with --protocol cuhk03 (it samples the raw feature scores)")
        if ap != "standard":
            raise EvalInputError(
                f"--protocol cuhk03 reports the standard AP (as torchreid's eval_cuhk03), not --ap {ap}"
            )

    def evaluate(self, feats, *, ap, rerank, seed, ranks, max_block_bytes):
        from fedreid.eval.metrics import evaluate_cuhk03_single_shot

        q, g = feats.query, feats.gallery
        result = evaluate_cuhk03_single_shot(
            q.features, g.features, q.pids, g.pids, q.camids, g.camids,
            rng=np.random.default_rng(seed), num_repeats=self.options.num_repeats,
            ranks=ranks, return_per_query=True, max_block_bytes=max_block_bytes,
        )
        return result, None

    def describe(self, seed: int) -> str:
        return f", CUHK03 single-gallery-shot CMC, seed {seed}"

    def report_fields(self, seed: int) -> dict[str, Any]:
        return {"seed": int(seed), "repeats": int(self.options.num_repeats)}

    @classmethod
    def report_note(cls, results: Mapping[str, Any]) -> str:
        repeats, seed = results.get("repeats", "?"), results.get("seed", "?")
        return f", CUHK03 single-gallery-shot CMC ({repeats} samplings, seed {seed})"


#: The built-in protocols' names (``standard``: single-query CMC/mAP over the
#: whole filtered gallery; ``cuhk03``: the old CUHK03 single-gallery-shot CMC).
#: :data:`EVAL_PROTOCOLS` is the live list.
PROTOCOLS = tuple(EVAL_PROTOCOLS.keys())


def build_protocol(name: str, options: Optional[Mapping[str, Any]] = None) -> EvalProtocol:
    """The registered protocol ``name`` with its options built from ``options`` (checked; defaults when None)."""
    cls = _protocol_class(name)
    values = {} if options is None else options
    return cls(build_options(cls.Options, values, "protocol_options", repr(cls.name)))


def _protocol_class(protocol: str) -> type[EvalProtocol]:
    if protocol not in EVAL_PROTOCOLS:
        raise EvalInputError(
            f"unknown protocol {protocol!r}: expected one of {', '.join(EVAL_PROTOCOLS.keys())}"
        )
    return EVAL_PROTOCOLS[protocol]


def check_protocol(protocol: str, ap: str, rerank: bool) -> EvalProtocol:
    """The protocol ``protocol`` (default options) once ``ap`` and ``rerank`` are checked against it.

    An unknown name, an AP form it does not report or a re-ranking it cannot
    run is an :class:`EvalInputError` naming the option; ``tools/eval_reid.py
    evaluate`` calls it before any folder is made or feature extracted.
    """
    cls = _protocol_class(protocol)
    cls.check(ap=ap, rerank=rerank)
    return build_protocol(protocol)


def protocol_help() -> str:
    """``--protocol``'s help: every registered protocol, the first as the default."""
    parts = []
    for i, (name, cls) in enumerate(EVAL_PROTOCOLS.items()):
        parts.append(name + (" (default)" if i == 0 else "") + (f": {cls.help}" if cls.help else ""))
    return " or ".join(parts)


def report_note(results: Mapping[str, Any]) -> str:
    """What ``report.md`` adds about the protocol of an evaluation's ``results.json`` ("" if unknown)."""
    name = results.get("protocol")
    if not isinstance(name, str) or name not in EVAL_PROTOCOLS:
        return ""
    return EVAL_PROTOCOLS[name].report_note(results)


def evaluate_dataset(
    feats: DatasetFeatures,
    *,
    ap: str = "standard",
    rerank: bool = False,
    protocol: str = "standard",
    seed: int = 0,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    rerank_max_bytes: int = DEFAULT_RERANK_BYTES,
) -> tuple[dict[str, Any], Optional[np.ndarray]]:
    """``(result, reranked)``: the metrics dict (rank1..rank20, mAP, counts, per_query) and re-ranked scores.

    ``protocol``: a name in :data:`EVAL_PROTOCOLS` (its :meth:`EvalProtocol.evaluate`
    computes the result). ``reranked`` is the query x gallery similarity
    (minus the re-ranked distance) when ``rerank``: the re-ranker builds it
    anyway, and the pictures must show that ranking. Otherwise it is None:
    the metrics run block-wise in :func:`~fedreid.eval.metrics.evaluate`
    (peak memory set by ``max_block_bytes``, not by Q x G), and
    :func:`~fedreid.eval.query_picking.query_scores` later computes the rows
    of the few queries drawn. ``rerank_max_bytes``: the memory re-ranking may
    take (:class:`~fedreid.eval.rerank.RerankMemoryError` above it, before
    anything large is allocated).

    ``protocol="cuhk03"``: the single-gallery-shot CMC
    (:func:`~fedreid.eval.metrics.evaluate_cuhk03_single_shot`,
    :data:`CUHK03_REPEATS` samplings from ``numpy.random.default_rng(seed)``,
    a fresh generator per dataset so the figures do not depend on which other
    datasets are evaluated); standard AP only, no re-ranking.

    Bad features or ids raise :class:`~fedreid.eval.metrics.EvalDataError`
    naming the dataset and :attr:`DatasetFeatures.source`; degenerate
    features (:func:`~fedreid.inference.features.check_features`) are among them.
    """
    proto = check_protocol(protocol, ap, rerank)
    ranks = tuple(range(1, CMC_RANKS + 1))
    try:
        _check_dataset_features(feats)
        extra = {"rerank_max_bytes": rerank_max_bytes} if rerank else {}  # supports_rerank's contract
        result, reranked = proto.evaluate(
            feats, ap=ap, rerank=rerank, seed=seed, ranks=ranks, max_block_bytes=max_block_bytes, **extra
        )
    except EvalDataError as exc:
        where = feats.source or "features given in memory"
        raise type(exc)(f"dataset {feats.name!r} ({where}): {exc}") from None
    result["num_gallery"] = int(feats.gallery.features.shape[0])
    result["protocol"] = protocol
    return result, reranked


def summary_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of an :func:`evaluate_dataset` result."""
    row: dict[str, Any] = {k: float(result[k]) for k in ("rank1", "rank5", "rank10", "mAP")}
    row["cmc"] = [float(result[f"rank{k}"]) for k in result["ranks"]]
    for key in ("num_queries", "num_valid_queries", "num_queries_without_match", "num_gallery"):
        row[key] = int(result[key])
    return row
