"""Federated search over Flower: every site searches its own gallery store, the server merges the answers.

The deployment is the training one (SuperLink, one SuperNode per site, the
same TLS and node authentication). A search is a Flower ``query`` message
to each site's SuperNode whose content is a search query
(:mod:`fedreid.flower.search_codec`); the ClientApp's query handler
(:mod:`fedreid.flower.app`) tells it from the training "which client are
you?" question by that content and answers with :func:`site_reply`.

* Site side, independent of the transport: :func:`answer_query` searches a
  :class:`~fedreid.retrieval.store.GalleryStore` for a decoded
  :class:`~fedreid.flower.search_codec.SearchQuery`; :func:`site_reply` does
  decode -> open the store -> answer -> encode for the ClientApp. The store
  folder and the thumbnail policy are node settings (``gallery-store``,
  ``search-thumbnails``, ``thumbnail-size``, ``gallery-root``).
* Server side: :func:`federated_search` sends the query to the given nodes
  and collects the answers until ``timeout``; :func:`merge_answers` ranks
  them. :func:`serve_search` is the ServerApp's ``mode=search`` (run config
  in :class:`SearchSettings`); ``tools/flower_fed.py search`` submits it.

Model check: a site compares the query's model fingerprint with the one its
store recorded (``header["meta"]["model_fingerprint"]`` or
``header["model_fingerprint"]``) and answers with an error record, not a
ranking, when they differ or either is missing: features of another model
would give a meaningless ranking. "Differ" is the rule of ``query`` and
``serve`` (:func:`fedreid.inference.model_io.fingerprint_differences`): how
the features were computed (PyTorch, an ONNX or TorchScript export) does not
count when both fingerprints record the weights' digest.

Privacy: the server computes the query feature itself (from an image with
the model, or a given vector); a site receives only that vector, ``k``, the
filters and the fingerprint. A site's answer holds, per hit, its store id,
score, camera, timestamp, the store's site column and the image's file name;
a small JPEG thumbnail (EXIF and other metadata dropped by re-encoding) only
where the site's own node config allows it and the query asked, and only of
a regular file inside the store's recorded gallery roots (or the node's
``gallery-root``), read as the search service reads images. Gallery
images, stored vectors, identities and paths beyond the file name never leave
a site; a site's error messages omit its local paths (the full error is in
the site's own log).

Which site answered: with node authentication (``node-auth=true``: the
SuperLink runs ``--enable-supernode-auth``), a node's site is the name its
public key was registered under (``flwr supernode register --name SITE``,
``tools/flower_fed.py register --site SITE``), read from the SuperLink
(:func:`registered_sites`), never the name its answer claims. An answer
claiming another site is left out (``wrong-site``), as is an answer from a
node whose key was registered without a name (``unbound``); so a node cannot
plant hits under another site's name, nor push the real site out as a
"duplicate". Without node authentication names are as the nodes declare
them and the result says so (:attr:`FederatedResult.authenticated` False).

Missing sites: a node that does not answer within ``timeout``, whose
SuperNode is gone (the SuperLink's error reply), whose ClientApp failed, that
refused the query (error record) or whose answer is malformed (including a
hit outside the query's filters) is listed in
:attr:`FederatedResult.missing` with the reason; the search goes on with the
others. Expected sites (``expected_sites``) that no node answered as are
listed too. Messages carry a TTL of ``timeout``: a site that comes back later
does not run a stale query.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedreid.config import ConfigError
from fedreid.flower.search_codec import (
    MAX_K,
    MAX_THUMBNAIL_BYTES,
    Hit,
    SearchCodecError,
    SearchFilters,
    SearchQuery,
    SiteAnswer,
    decode_hits,
    decode_query,
    encode_hits,
    encode_query,
    file_name,
)
from fedreid.inference.model_io import fingerprint_differences
from fedreid.utils.text import printable

log = logging.getLogger("fedreid.flower.search")

__all__ = [
    "RESULT_FORMAT",
    "SitePolicy",
    "AnsweredSite",
    "MissingSite",
    "FederatedResult",
    "SearchSettings",
    "store_fingerprint",
    "fingerprint_problem",
    "make_thumbnail",
    "thumbnail_roots",
    "gallery_thumbnail",
    "answer_query",
    "site_reply",
    "merge_answers",
    "registered_sites",
    "NodeReply",
    "federated_search",
    "judge_replies",
    "make_query",
    "check_k",
    "check_seconds",
    "serve_search",
    "format_result",
    "encode_vector",
    "decode_vector",
    "read_feature_file",
    "read_fingerprint_file",
    "image_query",
    "run_config_flag",
]

RESULT_FORMAT = "fedreid-federated-search"
#: Run-config keys of ``mode=search`` (besides ``mode``, ``out`` and ``join-timeout``).
SEARCH_KEYS = ("search-vector", "search-fingerprint", "search-filters", "search-k", "search-timeout",
               "search-thumbnails", "search-expect")
THUMBNAIL_SIZES = (16, 256)
#: A result lists the nodes the query did not reach first, then those that did not answer, then the rest.
_MISSING_ORDER = {"not-sent": 0, "no-reply": 1}


# =========================================================================== site side


@dataclass(frozen=True)
class SitePolicy:
    """What a site lets a search take away: thumbnails (off unless its node config says ``search-thumbnails``).

    ``thumbnail_size``: the longest side in pixels (16..256); ``image_root``:
    where the store's relative image paths lie (default: the store folder).
    """

    thumbnails: bool = False
    thumbnail_size: int = 64
    image_root: Optional[Path] = None

    def __post_init__(self) -> None:
        low, high = THUMBNAIL_SIZES
        if not low <= int(self.thumbnail_size) <= high:
            raise ConfigError(f"thumbnail-size: expected {low}..{high} pixels, got {self.thumbnail_size}")


def store_fingerprint(header: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The model fingerprint a store header records (``meta.model_fingerprint`` or ``model_fingerprint``); None.

    Raises :class:`SearchCodecError` when the header records two different ones.
    """
    meta = header.get("meta") if isinstance(header.get("meta"), Mapping) else {}
    found = [fp for fp in (meta.get("model_fingerprint"), header.get("model_fingerprint"))
             if isinstance(fp, Mapping) and fp]
    if len(found) == 2 and dict(found[0]) != dict(found[1]):
        raise SearchCodecError("the store header records two different model fingerprints "
                               "(meta.model_fingerprint and model_fingerprint)")
    return dict(found[0]) if found else None


def fingerprint_problem(header: Mapping[str, Any], fingerprint: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why a query of model ``fingerprint`` must not be ranked against the store of ``header``; None when it may.

    "Same model" is :func:`fedreid.inference.model_io.fingerprint_differences`,
    the rule ``query`` and ``serve`` apply: how the features were computed
    (``backend``, ``export_sha256``) is not compared when both fingerprints
    record the weights' digest, so a store built with an ONNX export answers a
    query computed by the PyTorch model of the same weights, and the reverse.
    """
    try:
        recorded = store_fingerprint(header)
    except SearchCodecError as exc:
        return str(exc)
    if recorded is None:
        return "this site's store records no model fingerprint, so the query's model cannot be checked"
    if not fingerprint:
        return "the query names no model fingerprint; this site answers only queries of its store's model"
    diffs = fingerprint_differences(fingerprint, recorded, ("query", "site"))
    if diffs:
        return "model fingerprint mismatch, the query's features are not comparable with this site's: " + "; ".join(diffs)
    return None


def make_thumbnail(source: str | Path | bytes, size: int) -> Optional[bytes]:
    """A JPEG of the image ``source`` (a path, or the file's bytes) whose longest side is at most ``size`` px.

    Metadata is dropped; None when the image cannot be decoded. A path is
    opened as given (links followed): a site reads its gallery files through
    :func:`gallery_thumbnail` instead.
    """
    from PIL import Image, UnidentifiedImageError

    shown = f"{len(source)} bytes" if isinstance(source, bytes) else source
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.draft("RGB", (int(size), int(size)))  # a JPEG decodes at a reduced scale: big photos stay cheap
            image = image.convert("RGB")
            image.thumbnail((int(size), int(size)))
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=75)  # a fresh encode: no EXIF, ICC or comments carried over
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        log.warning("no thumbnail for %s: %s", shown, exc)
        return None
    data = out.getvalue()
    return data if len(data) <= MAX_THUMBNAIL_BYTES else None


def _image_path(row_path: str, store_folder: Path, policy: SitePolicy) -> Path:
    path = Path(row_path)
    return path if path.is_absolute() else (policy.image_root or store_folder) / path


def thumbnail_roots(header: Mapping[str, Any], policy: SitePolicy) -> list[Path]:
    """The folders a site reads thumbnail sources from: the store's recorded gallery roots and ``policy.image_root``.

    The recorded roots are :func:`fedreid.retrieval.gallery_rows.recorded_gallery_roots`,
    the folders the search service serves images from; ``image_root`` (the
    node's ``gallery-root``) is the operator's own statement of where the
    images lie, its links resolved now.
    """
    from fedreid.retrieval.gallery_rows import recorded_gallery_roots

    roots = recorded_gallery_roots(header)
    return roots + ([Path(os.path.realpath(policy.image_root))] if policy.image_root is not None else [])


def gallery_thumbnail(path: Path, roots: Sequence[Path], size: int) -> Optional[bytes]:
    """:func:`make_thumbnail` of the gallery file ``path``, read as the search service reads an item's image; or None.

    Contract: only a regular file whose real path (links resolved) lies
    inside one of ``roots`` is read (the service's reader,
    ``fedreid.retrieval.service.read_file_inside``): a file replaced by a
    link to an image outside them, a folder on its path replaced by such a
    link, a FIFO or a missing file give no thumbnail, never another file's.
    The site's log gets the reason only, no path, file name or id: a log line
    would outlive a later erasure of the item.
    """
    from fedreid.retrieval.guard import _RequestError
    from fedreid.retrieval.service import read_file_inside

    try:
        data = read_file_inside(path, roots, "its image file")
    except _RequestError as exc:
        log.warning("no thumbnail for a hit: %s", exc.message)
        return None
    return make_thumbnail(data, size)


def answer_query(store: Any, query: SearchQuery, *, site: str, policy: SitePolicy = SitePolicy()) -> SiteAnswer:
    """This site's answer to ``query`` from ``store`` (a :class:`~fedreid.retrieval.store.GalleryStore`).

    Contract: the fingerprint must match the store's (else an error answer,
    see :func:`fingerprint_problem`) and the feature must have the store's
    dimension (else an error answer); then the store's top ``query.k`` under
    ``query.filters``, best first, -1 pads dropped (fewer hits when fewer
    items pass).

    Scores: the store's scores are exact float32 inner products of the query
    with the stored vectors for every index kind (an approximate index only
    picks the candidates, :meth:`~fedreid.retrieval.store.GalleryStore.search`),
    so ``|score| <= |query| * (1 + tol)`` plus what float32 math adds to an
    inner product with a vector of that norm
    (:func:`~fedreid.retrieval.exact.score_error_bound`, the bound the store's
    exact search uses) when every stored feature is L2-normalised as a store
    takes them (norm within ``tol``, :data:`fedreid.retrieval.store.NORM_TOLERANCE`).
    A score past that bound
    means the store holds features that are not L2-normalised, which a
    store refuses at create and add but an older store may hold: the answer
    is an error, since clipped such scores would tie at 1 and rank by id,
    and unclipped they are no cosines. Within the bound scores are clipped
    to [-1, 1], the range the server accepts; that moves a score by float32
    rounding plus the norm errors the store and the codec
    (:data:`~fedreid.flower.search_codec.NORM_TOLERANCE`) admit, nothing else.

    Each hit carries id, score, camera, timestamp, file name and
    the row's site column; a thumbnail only when ``policy.thumbnails`` and
    ``query.thumbnails``, and only of a regular file inside
    :func:`thumbnail_roots` (:func:`gallery_thumbnail`; otherwise the hit has
    none). Nothing else of the store is read into the answer.
    """
    from fedreid.retrieval.exact import score_error_bound
    from fedreid.retrieval.store import NORM_TOLERANCE

    problem = fingerprint_problem(store.header, query.fingerprint)
    if problem is None and query.feature.shape[0] != store.dim:
        problem = f"the query's feature has {query.feature.shape[0]} dimensions, this site's store holds {store.dim}"
    if problem is not None:
        return SiteAnswer(site, error=problem)
    result = store.search(query.feature[None, :], query.k, **query.filters.store_kwargs())
    keep = result.ids[0] >= 0
    ids, scores = result.ids[0][keep], result.scores[0][keep]
    largest = float(np.max(np.abs(scores), initial=0.0))
    largest_norm = 1.0 + NORM_TOLERANCE
    bound = (float(np.linalg.norm(query.feature.astype(np.float64))) * largest_norm
             + float(score_error_bound(query.feature[None, :], largest_norm)[0]))
    if largest > bound:
        return SiteAnswer(site, error=f"this site's store gives a score of {largest:.7g} where unit vectors give at "
                                      f"most {bound:.7g}: its features are not L2-normalised; build it again with "
                                      "the index tool")
    scores = np.clip(scores, -1.0, 1.0)
    rows = store.rows(ids.tolist())
    thumbnails = policy.thumbnails and query.thumbnails
    roots = thumbnail_roots(store.header, policy) if thumbnails else []
    hits = []
    for item, score, row in zip(ids.tolist(), scores.tolist(), rows):
        if row is None:  # the index and the table disagree: the store's own checks should prevent this
            raise SearchCodecError(f"store id {item} has no metadata row")
        thumb = None
        if thumbnails:
            thumb = gallery_thumbnail(_image_path(row["path"], Path(store.folder), policy), roots,
                                      policy.thumbnail_size)
        hits.append(Hit(site=site, id=int(item), score=float(score),
                        camera=None if row.get("camera") is None else int(row["camera"]),
                        timestamp=None if row.get("timestamp") is None else float(row["timestamp"]),
                        name=file_name(row["path"]), row_site=row.get("site"), thumbnail=thumb))
    return SiteAnswer(site, tuple(hits))


def site_reply(content: RecordDict, *, site: str, store_folder: Optional[Path],
               policy: SitePolicy = SitePolicy(), read: Optional[Callable[[Callable[[Any], Any]], Any]] = None
               ) -> RecordDict:
    """A site's reply content to a search query: decode, read the store, :func:`answer_query`, encode.

    ``read``: how the store is read: ``read(fn)`` returns ``fn(store)`` on an
    open :class:`~fedreid.retrieval.store.GalleryStore` (a site link keeps its
    store open between queries); None: ``store_folder`` is opened for this
    query (a ClientApp lives for one message).

    Every refusal is an error record (see :mod:`fedreid.flower.search_codec`)
    whose text holds no local path; the full error goes to this site's log.
    A query the codec refuses (e.g. a filter value outside the gallery's
    rules, :mod:`fedreid.retrieval.fields`) is answered ``malformed query:
    <what was expected>``; any other failure while answering is answered
    with an error record too (never a ClientApp exception, whose text Flower
    would pass on with the site's paths), its traceback in the site's log.
    """
    from fedreid.retrieval.store import GalleryStore, GalleryStoreError

    def refuse(reason: str) -> RecordDict:
        log.warning("search refused: %s", reason)
        return encode_hits(SiteAnswer(site, error=reason))

    try:
        query = decode_query(content)
    except SearchCodecError as exc:
        return refuse(f"malformed query: {exc}")
    except Exception:  # noqa: BLE001 -- the codec's checks missed something: still a record, not a traceback
        log.exception("search: the query could not be decoded")
        return refuse("malformed query: it could not be read (the details are in the site's log)")
    if store_folder is None:
        return refuse("this site has no gallery store (its node config sets no gallery-store)")
    if read is None:
        try:
            store = GalleryStore.open(store_folder)
        except Exception as exc:  # noqa: BLE001 -- GalleryStoreError, OSError, and whatever faiss or SQLite raise
            log.error("search: gallery store %s cannot be opened: %s", store_folder, exc)
            return refuse("this site's gallery store cannot be opened (the details are in the site's log)")

        def read(fn: Callable[[Any], Any]) -> Any:
            return fn(store)
    try:
        answer = read(lambda store: answer_query(store, query, site=site, policy=policy))
    except (GalleryStoreError, SearchCodecError) as exc:
        log.error("search in %s failed: %s", store_folder, exc)
        folder = str(Path(os.path.abspath(store_folder)))
        return refuse(f"the search failed: {str(exc).replace(folder, '<store>').replace(str(store_folder), '<store>')}")
    except Exception:  # noqa: BLE001 -- the site's boundary: the server gets a record, the site keeps the details
        log.exception("search in %s failed unexpectedly", store_folder)
        return refuse("the search failed with an unexpected error (the details are in the site's log)")
    if answer.ok:
        log.info("search: k=%d, filters %s: %d hits (%d thumbnails)", query.k, query.filters.to_plain(),
                 len(answer.hits), sum(h.thumbnail is not None for h in answer.hits))
    else:
        log.warning("search refused: %s", answer.error)
    return encode_hits(answer)


# =========================================================================== server side


@dataclass(frozen=True)
class AnsweredSite:
    """A node that answered with a ranking (``hits`` of them, possibly 0).

    ``verified``: ``site`` is the name the node's authenticated key was
    registered under (False: the name the node declared itself).
    """

    site: str
    node_id: int
    hits: int
    verified: bool = False


@dataclass(frozen=True)
class MissingSite:
    """A site or node whose results are not in the list, and why.

    ``code``: ``no-reply`` (not within the timeout), ``unavailable`` (the
    SuperLink says the node or message is gone), ``node-error`` (its ClientApp
    failed), ``refused`` (the site's error record, e.g. a model mismatch),
    ``malformed`` (the answer failed the checks), ``not-sent`` (the SuperLink
    did not take the query), ``duplicate`` (a second node answering as a site
    already answered), ``not-answered`` (an expected site no node answered as);
    with node authentication also ``wrong-site`` (the answer claims another
    site than the one the node's key is registered as) and ``unbound`` (the
    node's key is registered under no site name). ``site`` is the node's
    registered site where known, else the site its answer named, else None.
    """

    site: Optional[str]
    node_id: Optional[int]
    code: str
    reason: str


@dataclass
class FederatedResult:
    """The merged ranking (``results``, at most ``k``), the sites that answered, and the ``missing`` ones.

    ``authenticated``: every answer kept was checked against the site name
    its node's key is registered as (node authentication); False: the names
    are as the nodes declared them.
    """

    results: list[Hit]
    answered: list[AnsweredSite]
    missing: list[MissingSite]
    k: int = 0
    timeout: float = 0.0
    seconds: float = 0.0
    query: dict[str, Any] = field(default_factory=dict)
    authenticated: bool = False
    #: How the query reached the sites: ``flower`` (query messages) or ``site-links`` (:mod:`fedreid.flower.site_link`).
    transport: str = "flower"

    def to_plain(self) -> dict[str, Any]:
        """The JSON document of the result (thumbnails as base64 JPEG)."""
        return {
            "format": RESULT_FORMAT, "version": 1, "k": self.k, "timeout": self.timeout,
            "seconds": round(self.seconds, 3), "query": self.query, "authenticated": self.authenticated,
            "transport": self.transport,
            "results": [dict(rank=i + 1, **hit.to_plain()) for i, hit in enumerate(self.results)],
            "answered": [vars(a).copy() for a in self.answered],
            "missing": [vars(m).copy() for m in self.missing],
        }


def merge_answers(answers: Iterable[SiteAnswer], k: int) -> list[Hit]:
    """The best ``k`` hits of all answers: score descending, ties by site name then store id (deterministic).

    Error answers contribute nothing. Scores are the sites' float32 inner
    products, compared as they are (the same model, checked by fingerprint).
    """
    hits = [hit for answer in answers if answer.ok for hit in answer.hits]
    hits.sort(key=lambda h: (-h.score, h.site, h.id))
    return hits[: max(int(k), 0)]


def registered_sites(grid: Grid) -> dict[int, str]:
    """Node id -> the site name its key was registered under on the SuperLink, for the connected nodes.

    The name is Flower's ``NodeInfo.name``, set when the operator registers
    the node's public key (``flwr supernode register KEY --name SITE``).
    Only meaningful where the SuperLink authenticates SuperNodes
    (``--enable-supernode-auth``): without it a node is not made to prove it
    holds a registered key. Nodes registered without a name are left out.
    """
    return {int(info.node_id): str(info.name) for info in grid.get_nodes() if getattr(info, "name", "")}


def _error_code(code: int) -> str:
    unavailable = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
    return "unavailable" if code in unavailable else "node-error"


@dataclass(frozen=True)
class NodeReply:
    """What a transport got back from one node for a query: its reply ``content``, or why there is none.

    ``code`` and ``reason`` (no content) become that node's :class:`MissingSite`:
    ``unavailable`` (the node or the message is gone, or the site cannot be
    reached), ``node-error`` (the node failed to answer), ``not-sent`` (the
    SuperLink did not take the query) or ``malformed`` (what came back is not
    a record).
    """

    content: Optional[RecordDict] = None
    code: str = ""
    reason: str = ""


def federated_search(grid: Grid, node_ids: Iterable[int], feature: Any, k: int,
                     filters: Optional[SearchFilters | Mapping[str, Any]] = None, timeout: float = 30.0, *,
                     fingerprint: Optional[Mapping[str, Any]], thumbnails: bool = False,
                     expected_sites: Sequence[str] = (), poll_seconds: float = 0.5,
                     bound_sites: Optional[Mapping[int, str]] = None) -> FederatedResult:
    """Send one query to every node of ``node_ids`` over ``grid`` (a Flower ``Grid``) and merge the answers.

    Contract: each node gets a ``query`` message (TTL ``timeout``) holding
    ``feature`` (float32 [d]), ``k``, ``filters`` and ``fingerprint``; replies
    are collected until all came or ``timeout`` seconds passed (polling every
    ``poll_seconds``; Flower's ``send_and_receive`` polls every 3 s and cannot
    tell which push failed). The answers are judged by :func:`judge_replies`.
    The grid is only used for these messages; what leaves the server is
    listed in the module docstring.
    """
    query = make_query(feature, k, filters, fingerprint=fingerprint, thumbnails=thumbnails)
    timeout = checked_timeout(timeout)
    started = time.monotonic()
    nodes = sorted({int(n) for n in node_ids})
    messages = [Message(content=encode_query(query), dst_node_id=node, message_type=MessageType.QUERY,
                        group_id="search", ttl=timeout) for node in nodes]
    replies: dict[int, Optional[NodeReply]] = {}
    pending: dict[str, int] = {}
    for mid, node in zip(list(grid.push_messages(messages)) if messages else [], nodes):
        if mid:
            pending[mid] = node
        else:
            replies[node] = NodeReply(code="not-sent", reason="the SuperLink did not accept the query")
    while pending:
        for reply in grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.has_error():
                replies[node] = NodeReply(code=_error_code(reply.error.code),
                                          reason=str(reply.error.reason or f"error code {reply.error.code}"))
            else:
                replies[node] = NodeReply(reply.content)
        if not pending or time.monotonic() - started >= timeout:
            break
        time.sleep(min(poll_seconds, max(timeout - (time.monotonic() - started), 0.0)))
    for node in pending.values():
        replies[node] = None
    return judge_replies(query, replies, timeout=timeout, started=started, expected_sites=expected_sites,
                         bound_sites=bound_sites)


def make_query(feature: Any, k: int, filters: Optional[SearchFilters | Mapping[str, Any]], *,
               fingerprint: Optional[Mapping[str, Any]], thumbnails: bool) -> SearchQuery:
    """The :class:`SearchQuery` every transport sends (its fields checked by the codec)."""
    if not isinstance(filters, SearchFilters):
        filters = SearchFilters.from_plain(filters)
    return SearchQuery(feature=feature, k=k, filters=filters, fingerprint=fingerprint, thumbnails=bool(thumbnails))


def checked_timeout(timeout: Any) -> float:
    """A query's timeout: :func:`check_seconds` (finite, > 0), or a ConfigError."""
    return check_seconds(timeout, "search timeout")


def judge_replies(query: SearchQuery, replies: Mapping[int, Optional[NodeReply]], *, timeout: float,
                  started: float, expected_sites: Sequence[str] = (),
                  bound_sites: Optional[Mapping[int, str]] = None, transport: str = "flower") -> FederatedResult:
    """The :class:`FederatedResult` of one query from what each node sent back, whatever carried it.

    ``replies``: node id -> its :class:`NodeReply`, or None when none came
    within ``timeout`` (``started``: ``time.monotonic()`` when the query left).
    A node that does not contribute is a :class:`MissingSite` with the reason,
    never an exception; so is each ``expected_sites`` name no node answered
    as. ``results`` are :func:`merge_answers` of the valid answers (each
    checked by :func:`~fedreid.flower.search_codec.decode_hits`, against
    ``query.filters`` too: an answer with any hit outside them is
    ``malformed``, none of its hits merged).

    ``bound_sites`` (node id -> site: :func:`registered_sites` under node
    authentication, or the site a direct link is configured for): when given,
    an answer counts only from a node listed there and only under that name:
    a node whose answer (ranking or refusal) names another site is
    ``wrong-site``, an unlisted node ``unbound``, and neither takes the name
    from the node it claims to be. None: the names the nodes declare are used
    (``authenticated`` False in the result).
    """
    nodes = sorted(int(n) for n in replies)
    bound = None if bound_sites is None else {int(n): str(s) for n, s in bound_sites.items()}
    missing: list[MissingSite] = []
    answers: list[SiteAnswer] = []
    answered: list[AnsweredSite] = []
    first_node: dict[str, int] = {}
    for node in nodes:
        reply = replies[node]
        known = None if bound is None else bound.get(node)  # who the node is, by its key (None: unknown)
        if reply is None:
            missing.append(MissingSite(known, node, "no-reply", f"no reply within {timeout:g} s"))
            continue
        if reply.content is None:
            missing.append(MissingSite(known, node, reply.code, reply.reason))
            continue
        try:
            answer = decode_hits(reply.content, k=query.k, thumbnails=query.thumbnails, filters=query.filters)
        except SearchCodecError as exc:
            missing.append(MissingSite(known, node, "malformed", f"answer rejected: {exc}"))
            continue
        if bound is not None and known is None:
            missing.append(MissingSite(None, node, "unbound",
                                       f"answers as site {answer.site!r}, but its key is registered under no site "
                                       "name (register it with --site NAME); its answer is left out"))
            continue
        if known is not None and answer.site != known:
            # Checked before the duplicate rule: an impostor must not take the name from the real site's node.
            missing.append(MissingSite(known, node, "wrong-site",
                                       f"answers as site {answer.site!r}, but its key is registered as site "
                                       f"{known!r}; its answer is left out"))
            continue
        if answer.site in first_node:
            missing.append(MissingSite(answer.site, node, "duplicate",
                                       f"answers as site {answer.site!r}, which node {first_node[answer.site]} "
                                       "already answered as; its hits are left out"))
            continue
        first_node[answer.site] = node
        if not answer.ok:
            missing.append(MissingSite(answer.site, node, "refused", str(answer.error)))
            continue
        answers.append(answer)
        answered.append(AnsweredSite(answer.site, node, len(answer.hits), verified=known is not None))
    missing.sort(key=lambda m: (_MISSING_ORDER.get(m.code, 2), m.node_id if m.node_id is not None else -1))
    unnamed = sorted(m.node_id for m in missing if m.site is None and m.node_id is not None)
    for site in expected_sites:
        if site in first_node:
            continue
        own = [m for m in missing if m.site == site and m.node_id is not None]  # its node is known, and failed
        why = ("; ".join(f"its node {m.node_id}: {m.code}" for m in own) if own
               else f"nodes that did not say which site they are: {', '.join(map(str, unnamed))}" if unnamed
               else "no node of the SuperLink is this site: not connected" if transport == "flower"
               else "no site link is this site: not in the links file")
        missing.append(MissingSite(site, None, "not-answered", f"no node answered as this site ({why})"))
    answered.sort(key=lambda a: (a.site, a.node_id))
    results = merge_answers(answers, query.k)
    described = {"dim": int(query.feature.shape[0]), "filters": query.filters.to_plain(),
                 "fingerprint": query.fingerprint, "thumbnails": query.thumbnails, "nodes": nodes}
    return FederatedResult(results, answered, missing, k=query.k, timeout=timeout,
                           seconds=time.monotonic() - started, query=described, authenticated=bound is not None,
                           transport=transport)


# =========================================================================== the ServerApp's mode=search


def encode_vector(feature: Any) -> str:
    """A feature vector as run-config text: base64 of its little-endian float32 bytes (exact)."""
    vec = np.asarray(feature, dtype="<f4").reshape(-1)
    return base64.b64encode(vec.tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    """Inverse of :func:`encode_vector`."""
    try:
        raw = base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("search-vector: expected base64 of float32 numbers (tools/flower_fed.py search "
                          "writes it)") from None
    if not raw or len(raw) % 4:
        raise ConfigError(f"search-vector: expected a whole number of float32 values, got {len(raw)} bytes")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


_YES, _NO = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def run_config_flag(config: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """The yes/no value ``key`` of a Flower run or node config: a TOML bool, or true/false, yes/no, on/off, 1/0.

    Anything else is a :class:`ConfigError` naming ``key``: a misspelt value
    must not switch a feature off without a word.
    """
    value = config.get(key, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _YES or text in _NO:
        return text in _YES
    raise ConfigError(f"flower config: {key}: expected true or false, got {value!r}")


def check_seconds(value: Any, what: str, *, zero: bool = False) -> float:
    """``value`` as a duration: finite seconds > 0 (``zero``: >= 0), else a one-line :class:`ConfigError` naming ``what``.

    The rule of every search timeout, wherever it is given (run config,
    ``flower_fed.py search`` options, a transport's query).
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: expected seconds, got {value!r:.80}") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ConfigError(f"{what}: expected seconds {'>= 0' if zero else '> 0'}, got {seconds}")
    return seconds


def check_k(value: Any, what: str) -> int:
    """``value`` as a result length: a whole number in 1..:data:`MAX_K`, else a one-line :class:`ConfigError`."""
    try:
        whole = not isinstance(value, bool) and float(value) == int(value)
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise ConfigError(f"{what}: expected a whole number in 1..{MAX_K}, got {value!r:.80}")
    if not 1 <= int(value) <= MAX_K:
        raise ConfigError(f"{what}: expected 1..{MAX_K}, got {int(value)}")
    return int(value)


def run_config_seconds(config: Mapping[str, Any], key: str, default: float, *, zero: bool = False) -> float:
    """The duration ``key`` of a Flower run config: :func:`check_seconds` of its value."""
    return check_seconds(config.get(key, default), f"flower run config: {key}", zero=zero)


@dataclass(frozen=True)
class SearchSettings:
    """The run config of ``mode=search`` (``flwr run ... --run-config``).

    ``search-vector`` (required: :func:`encode_vector` of the query feature),
    ``search-fingerprint`` (JSON object), ``search-filters`` (JSON object:
    cameras, sites, time_window), ``search-k``, ``search-timeout`` (seconds
    the sites have), ``search-thumbnails``, ``search-expect`` (site names,
    space separated: reported when none answers), ``node-auth`` (the
    SuperLink authenticates SuperNodes: each answer is bound to the site its
    node's key is registered as, :func:`registered_sites`), ``join-timeout`` (seconds to
    wait for nodes to be connected: all expected ones, else one), ``out`` (the
    result JSON on the server machine, in an existing folder; optional: the
    ranked list is logged either way).
    """

    feature: np.ndarray
    k: int = 10
    fingerprint: Optional[dict[str, Any]] = None
    filters: SearchFilters = field(default_factory=SearchFilters)
    timeout: float = 30.0
    thumbnails: bool = False
    expect: tuple[str, ...] = ()
    join_timeout: float = 30.0
    out: Optional[Path] = None
    node_auth: bool = False

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "SearchSettings":
        text = str(run_config.get("search-vector", "")).strip()
        if not text:
            raise ConfigError("flower run config: mode=search needs 'search-vector' (the query feature; "
                              "tools/flower_fed.py search fills it)")

        def parsed(key: str) -> Any:
            raw = str(run_config.get(key, "")).strip()
            if not raw:
                return None
            try:
                return json.loads(raw)
            except ValueError as exc:
                raise ConfigError(f"flower run config: {key} is not JSON ({exc})") from None

        try:
            filters = SearchFilters.from_plain(parsed("search-filters"))
        except SearchCodecError as exc:
            raise ConfigError(f"flower run config: search-filters: {exc}") from None
        k = check_k(run_config.get("search-k", 10), "flower run config: search-k")
        timeout = run_config_seconds(run_config, "search-timeout", 30.0)
        out = str(run_config.get("out", "")).strip()
        return cls(feature=decode_vector(text), k=k, fingerprint=parsed("search-fingerprint"), filters=filters,
                   timeout=timeout, thumbnails=run_config_flag(run_config, "search-thumbnails"),
                   expect=tuple(shlex.split(str(run_config.get("search-expect", "")))),
                   join_timeout=run_config_seconds(run_config, "join-timeout", 30.0, zero=True), out=Path(out) if out else None,
                   node_auth=run_config_flag(run_config, "node-auth"))


def _check_result_path(path: Path) -> None:
    """Refuse (before searching) to overwrite a file that is not an earlier search result (its folder must exist)."""
    if not path.parent.is_dir():
        return  # not this host's folder (see serve_search)
    if path.is_symlink() or path.is_dir():
        raise ConfigError(f"out={path}: expected a JSON file path, it is a folder or a link")
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and earlier.get("format") == RESULT_FORMAT):
            raise ConfigError(f"out={path} exists and is not a federated search result; choose another file "
                              "(nothing was changed)")


def wait_for_nodes(grid: Grid, count: int, wait: float, poll_seconds: float = 0.5) -> list[int]:
    """The connected node ids, once at least ``count`` are connected or ``wait`` seconds passed."""
    deadline = time.monotonic() + max(float(wait), 0.0)
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= count or time.monotonic() >= deadline:
            return nodes
        time.sleep(poll_seconds)


def serve_search(grid: Grid, run_config: Mapping[str, Any]) -> FederatedResult:
    """The ServerApp's ``mode=search``: one :func:`federated_search` of every connected node; logs, writes ``out``."""
    from fedreid.utils.io import write_json_atomic

    settings = SearchSettings.from_run_config(run_config)
    if settings.out is not None:
        _check_result_path(settings.out)
    nodes = wait_for_nodes(grid, max(len(settings.expect), 1), settings.join_timeout)
    log.info("search: k=%d, %d-d feature, %d connected nodes, timeout %g s", settings.k,
             settings.feature.shape[0], len(nodes), settings.timeout)
    result = federated_search(grid, nodes, settings.feature, settings.k, settings.filters, settings.timeout,
                              fingerprint=settings.fingerprint, thumbnails=settings.thumbnails,
                              expected_sites=settings.expect,
                              bound_sites=registered_sites(grid) if settings.node_auth else None)
    plain = result.to_plain()
    for line in format_result(plain):
        log.info("%s", line)
    if settings.out is not None and settings.out.parent.is_dir():
        write_json_atomic(settings.out, plain)
        log.info("search result written to %s", settings.out)
    elif settings.out is not None:  # e.g. a folder of the machine `flwr run` was started on: nothing is created here
        log.warning("out=%s: its folder does not exist on the server machine; the result is only in this log",
                    settings.out)
    return result


def format_result(plain: Mapping[str, Any]) -> list[str]:
    """The lines that show a result document (:meth:`FederatedResult.to_plain`): ranked list, then missing sites.

    Contract: one line per entry whatever the sites sent. Every text that
    came from a site (site names, file names, refusal and error texts) is
    shown through :func:`~fedreid.utils.text.printable`: control characters
    (ANSI escapes, newlines), bidi overrides and the like appear escaped, so
    a site can neither drive the operator's terminal nor forge a line.
    """
    results, answered, missing = plain["results"], plain["answered"], plain["missing"]
    if not plain.get("authenticated"):
        names = "site names: as the nodes declare them (no node authentication)"
    elif plain.get("transport") == "site-links":
        names = "site names: bound to the site links (TLS certificate and token of each)"
    else:
        names = "site names: authenticated (registered node keys)"
    sites = ", ".join(printable(a["site"], 64) for a in answered) or "none"
    lines = [f"federated search: {len(results)} results (k={plain['k']}) from {len(answered)} sites "
             f"({sites}); {len(missing)} missing; {names}"]
    if results:
        lines.append(f"{'rank':>4}  {'score':>8}  {'site':<12} {'id':>8}  {'camera':>6}  {'time':>12}  name")
    for hit in results:
        camera = "-" if hit["camera"] is None else str(hit["camera"])
        stamp = "-" if hit["timestamp"] is None else f"{hit['timestamp']:.3f}"
        thumb = "  [thumbnail]" if hit.get("thumbnail_jpeg_base64") else ""
        lines.append(f"{hit['rank']:>4}  {hit['score']:>8.4f}  {printable(hit['site'], 64):<12} {hit['id']:>8}  "
                     f"{camera:>6}  {stamp:>12}  {printable(hit['name'])}{thumb}")
    for m in missing:
        who = printable(m["site"], 64) if m["site"] is not None else "unknown site"
        node = f" (node {m['node_id']})" if m["node_id"] is not None else ""
        lines.append(f"missing: {who}{node}: {printable(m['code'], 32)}: {printable(m['reason'], 600)}")
    return lines


# =========================================================================== the query feature


def read_feature_file(path: str | Path) -> np.ndarray:
    """A query feature from a ``.npy`` file (float [d] or [1, d]); read without pickles.

    The feature must be what a query may carry (:class:`SearchQuery`'s own
    checks: finite, at most :data:`~fedreid.flower.search_codec.MAX_DIM`
    values, L2-normalised), else a :class:`ConfigError` naming the file.
    """
    path = Path(path)
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: expected a NumPy .npy file of one float32 feature [d] ({exc})") from None
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.floating) \
            or not (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[0] == 1)) or arr.size == 0:
        raise ConfigError(f"{path}: expected one float feature of shape [d] or [1, d], got "
                          f"{getattr(arr, 'dtype', type(arr).__name__)} {getattr(arr, 'shape', '')}")
    arr = arr.reshape(-1).astype(np.float32)
    try:  # the query's own checks, so a file no site would be sent is refused before any run starts
        SearchQuery(feature=arr, k=1)
    except SearchCodecError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return arr


def read_fingerprint_file(path: str | Path) -> dict[str, Any]:
    """A model fingerprint from JSON: the fingerprint itself, or a document holding one.

    Accepted: ``{"weights_sha256": ...}``; a store header or model sidecar with
    ``model_fingerprint`` or ``meta.model_fingerprint``.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: expected a JSON model fingerprint ({exc})") from None
    if isinstance(doc, dict):
        try:
            held = store_fingerprint(doc)
        except SearchCodecError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        fp = held if held is not None else doc
        if fp and all(isinstance(v, (str, int, float, bool)) or v is None for v in fp.values()):
            return dict(fp)
    raise ConfigError(f"{path}: expected a JSON object of a model fingerprint (e.g. weights_sha256, backbone, ...) "
                      "or a store header / model sidecar holding model_fingerprint")


def image_query(image: str | Path, model: str | Path, device: str = "cpu") -> tuple[np.ndarray, dict[str, Any]]:
    """The query feature of ``image`` by ``model`` (a run folder or model file) and the model's fingerprint.

    The feature is the evaluation one (flip-averaged, L2-normalised
    :func:`fedreid.inference.model_io.model_features`), as the sites' stores hold.
    """
    from fedreid.inference.images import image_features
    from fedreid.inference.model_io import load_model

    loaded = load_model(model, device)
    if not loaded.fingerprint:
        raise ConfigError(f"model {model} has no fingerprint; the sites cannot check it")
    fs = image_features(loaded, [Path(image)], batch_size=1, device=device, where=str(image), identical_ok=True)
    return np.asarray(fs.features[0], dtype=np.float32), dict(loaded.fingerprint)
