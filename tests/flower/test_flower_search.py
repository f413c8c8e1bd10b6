"""Federated search over Flower: the records, a site's handler on a real store, the merge, and a real deployment.

Unit tests run the site handler on small :class:`GalleryStore` folders of
random unit features (d=16) and the server side over ``FakeGrid`` (Flower's
own ``Message`` and records, the real ``client_app``, no sockets). The
deployment test starts a SuperLink and three SuperNodes on 127.0.0.1 with
TLS and node authentication, searches, kills one site's SuperNode and
searches again with ``tools/flower_fed.py search``; every process is stopped
by the deployment's ``with`` block (and the tool's process group by the test).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flower_fakes import FakeGrid
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.config import parse_config_args
from flwr.common.constant import ErrorCode
from PIL import Image
from search_world import FP, SITES, D, exact_answer, exact_merge, make_store, triples, unit_rows

from fedreid.config import ConfigError
from fedreid.flower import app as flower_app
from fedreid.flower.launch import (
    LaunchError,
    LocalDeployment,
    TLSFiles,
    search_run_config_string,
    session_run_config_string,
)
from fedreid.flower.search import (
    RESULT_FORMAT,
    NodeReply,
    SearchSettings,
    SitePolicy,
    answer_query,
    decode_vector,
    encode_vector,
    federated_search,
    fingerprint_problem,
    format_result,
    judge_replies,
    make_query,
    make_thumbnail,
    merge_answers,
    read_feature_file,
    read_fingerprint_file,
    registered_sites,
    serve_search,
    site_reply,
)
from fedreid.flower.search_codec import (
    HITS_RECORD,
    REPLY_RECORD,
    THUMBNAILS_RECORD,
    Hit,
    SearchCodecError,
    SearchFilters,
    SearchQuery,
    SiteAnswer,
    decode_hits,
    decode_query,
    encode_hits,
    encode_query,
    is_search_query,
)
from fedreid.flower.search_session import SessionClient, SessionError, SessionSettings, serve_session
from fedreid.flower.security import make_node_key, make_tls_files
from fedreid.retrieval.store import GalleryStore
from fedreid.utils.text import printable

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "flower_fed.py"
@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    return {
        "sa": make_store(root / "sa", 12, 1, images=True, site="sa"),
        "sb": make_store(root / "sb", 7, 2, fp_where="top", site="sb"),
        "sc": make_store(root / "sc", 20, 3, site="sc"),
    }


@pytest.fixture
def query():
    return unit_rows(1, 99)[0]


# ----------------------------------------------------------------------------- codec


def test_codec_round_trips_queries_and_answers_exactly(query):
    filters = SearchFilters(cameras=[2, 0], sites=["north"], time_window=(1000.5, None))
    q = SearchQuery(query, 7, filters, FP, thumbnails=True)
    back = decode_query(encode_query(q))
    assert back.feature.dtype == np.float32 and np.array_equal(back.feature, query)
    assert (back.k, back.filters, back.fingerprint, back.thumbnails) == (7, filters, FP, True)
    assert is_search_query(encode_query(q)) and not is_search_query(RecordDict())
    assert decode_query(encode_query(SearchQuery(query, 1))).filters == SearchFilters()

    jpeg = b"\xff\xd8\xff\xe0" + b"x" * 50
    hits = (Hit("sa", 5, 0.75, camera=1, timestamp=12.5, name="a.jpg", row_site="north", thumbnail=jpeg),
            Hit("sa", 9, np.float32(0.1).item(), name="b.jpg"))
    answer = decode_hits(encode_hits(SiteAnswer("sa", hits)), k=2)
    assert answer.ok and answer.hits == hits
    assert decode_hits(encode_hits(SiteAnswer("sa", hits)), thumbnails=False).hits[0].thumbnail is None
    refused = decode_hits(encode_hits(SiteAnswer("sa", hits, error="model fingerprint mismatch")))
    assert refused.error == "model fingerprint mismatch" and refused.hits == ()
    # Only the file name of a path is ever encoded.
    assert decode_hits(encode_hits(SiteAnswer("sa", (Hit("sa", 1, 0.5, name="/srv/g/x/c1.jpg"),)))).hits[0].name == "c1.jpg"


def test_codec_refusals_name_what_was_expected(query):
    with pytest.raises(SearchCodecError, match="k: expected an integer in"):
        SearchQuery(query, 0)
    with pytest.raises(SearchCodecError, match="finite"):
        SearchQuery(np.full(D, np.nan, np.float32), 3)
    with pytest.raises(SearchCodecError, match="one vector"):
        SearchQuery(np.zeros((2, D), np.float32), 3)
    with pytest.raises(SearchCodecError, match="filters: unknown key.*camera"):
        SearchFilters.from_plain({"camera": [1]})
    with pytest.raises(SearchCodecError, match="since .* is after until"):
        SearchFilters(time_window=(5, 1))
    content = encode_query(SearchQuery(query, 3))
    content["fedreid.search.query"]["version"] = 99
    with pytest.raises(SearchCodecError, match="expected version 1, got 99"):
        decode_query(content)
    good = encode_hits(SiteAnswer("sa", (Hit("sa", 1, 0.5), Hit("sa", 2, 0.25))))
    with pytest.raises(SearchCodecError, match="at most k=1"):
        decode_hits(good, k=1)
    for mutate, message in [
        (lambda c: c[REPLY_RECORD].__setitem__("rows", json.dumps([{"camera": None, "timestamp": None,
                                                                      "name": "d/e.jpg", "row_site": None}] * 2)),
         "file name without folders"),
        (lambda c: c.__setitem__(THUMBNAILS_RECORD, ConfigRecord({"0": b"GIF89a"})), "expected a JPEG"),
        (lambda c: c.__setitem__(THUMBNAILS_RECORD, ConfigRecord({"7": b"\xff\xd8\xff"})), "not the index of a hit"),
        (lambda c: c[REPLY_RECORD].__setitem__("status", "maybe"), "status: expected 'ok' or 'error'"),
        (lambda c: c.__delitem__(HITS_RECORD), "no 'fedreid.search.hits' record"),
    ]:
        bad = encode_hits(SiteAnswer("sa", (Hit("sa", 1, 0.5), Hit("sa", 2, 0.25))))
        mutate(bad)
        with pytest.raises(SearchCodecError, match=message):
            decode_hits(bad)


# ----------------------------------------------------------------------------- the site's handler


def test_site_handler_on_a_real_store(stores, query, tmp_path):
    store = stores["sa"]
    answer = answer_query(store, SearchQuery(query, 5, fingerprint=FP), site="sa")
    assert answer.ok and triples(answer.hits) == exact_answer(store, "sa", query, 5)
    assert [h.name for h in answer.hits] == [Path(r["path"]).name for r in store.rows([h.id for h in answer.hits])]
    assert all(h.thumbnail is None for h in answer.hits)  # thumbnails are off by default
    # Filters reach the store; every hit passes them.
    filters = SearchFilters(cameras=[1], time_window=(1003.0, 1010.0))
    got = answer_query(store, SearchQuery(query, 12, filters, FP), site="sa").hits
    assert got and all(h.camera == 1 and 1003.0 <= h.timestamp <= 1010.0 for h in got)
    assert triples(got) == exact_answer(store, "sa", query, 12, cameras=[1], time_window=(1003.0, 1010.0))
    only_north = answer_query(store, SearchQuery(query, 12, SearchFilters(sites=["sa-north"]), FP), site="sa").hits
    assert len(only_north) == 6 and {h.row_site for h in only_north} == {"sa-north"}
    # k larger than the store: every item once, no pads.
    everything = answer_query(stores["sb"], SearchQuery(query, 50, fingerprint=FP), site="sb").hits
    assert len(everything) == 7 and len({h.id for h in everything}) == 7
    # Another model, no fingerprint, another dimension: an error answer, never a ranking.
    other = dict(FP, weights_sha256="cd" * 32)
    refused = answer_query(store, SearchQuery(query, 5, fingerprint=other), site="sa")
    assert not refused.ok and refused.hits == () and "fingerprint mismatch" in refused.error
    assert "weights_sha256 cdcdcdcdcdcdcdcd (query) vs abababababababab (site)" in refused.error
    assert "names no model fingerprint" in answer_query(store, SearchQuery(query, 5), site="sa").error
    assert "16" in answer_query(store, SearchQuery(np.full(8, 8 ** -0.5, np.float32), 5, fingerprint=FP),
                                site="sa").error
    # The fingerprint is found at either place in the header; none recorded is refused.
    assert fingerprint_problem({"meta": {"model_fingerprint": FP}}, FP) is None
    assert fingerprint_problem({"model_fingerprint": FP, "meta": {}}, FP) is None
    assert "records no model fingerprint" in fingerprint_problem({"model_fingerprint": None, "meta": {}}, FP)
    assert "two different" in fingerprint_problem({"model_fingerprint": FP, "meta": {"model_fingerprint": other}}, FP)


def test_a_site_judges_same_model_as_query_and_serve_do(query, tmp_path):
    """An export of the same weights is the same model to a site as to ``query``/``serve`` (check_index_model)."""
    from types import SimpleNamespace

    from fedreid.inference.model_io import check_index_model

    torch_fp = dict(FP)
    onnx_fp = dict(FP, backend="onnx", export_sha256="cd" * 32)  # what an ONNX export's sidecar records
    script_fp = dict(FP, backend="torchscript", export_sha256="ef" * 32)
    export_only = {key: value for key, value in onnx_fp.items() if key != "weights_sha256"}
    other_export = dict(export_only, export_sha256="12" * 32)
    other_weights = dict(onnx_fp, weights_sha256="ee" * 32)
    other_size = dict(FP, height=64)
    prints = [torch_fp, onnx_fp, script_fp, export_only, other_export, other_weights, other_size]
    for recorded, asked in itertools.product(prints, prints):
        header = {"meta": {"model_fingerprint": recorded}}
        served = check_index_model(header, SimpleNamespace(fingerprint=asked, source="m"), "idx", allow_mismatch=True)
        assert (fingerprint_problem(header, asked) is None) == (served is None), (recorded, asked)
    assert fingerprint_problem({"meta": {"model_fingerprint": onnx_fp}}, torch_fp) is None
    assert fingerprint_problem({"model_fingerprint": torch_fp}, script_fp) is None
    problem = fingerprint_problem({"meta": {"model_fingerprint": onnx_fp}}, other_weights)
    assert "weights_sha256 eeeeeeeeeeeeeeee (query) vs abababababababab (site)" in problem
    assert "backend" not in problem and "export_sha256" not in problem
    # Without a weights digest on one side, only the export file itself names the model.
    assert "export_sha256 1212121212121212 (query) vs cdcdcdcdcdcdcdcd (site)" in fingerprint_problem(
        {"meta": {"model_fingerprint": export_only}}, other_export)
    # A store built with the ONNX export ranks a query the PyTorch model computed.
    store = make_store(tmp_path / "onnx", 6, 4, site="sa", fingerprint=onnx_fp)
    answer = answer_query(store, SearchQuery(query, 3, fingerprint=torch_fp), site="sa")
    assert answer.ok and triples(answer.hits) == exact_answer(store, "sa", query, 3)


def store_of_any_norms(monkeypatch, folder, features):
    """A store holding ``features`` as given, norms included: one written before stores refused features off unit norm.

    The store's own check (``fedreid.retrieval.store.NORM_TOLERANCE``) is
    lifted while it is written only, so the site reads it under the real one.
    """
    from fedreid.retrieval import store as store_module

    with monkeypatch.context() as patched:
        patched.setattr(store_module, "NORM_TOLERANCE", np.inf)
        return GalleryStore.create(folder, features, [{"path": f"/g/{i}.jpg"} for i in range(len(features))],
                                   meta={"model_fingerprint": FP})


def test_a_store_of_unnormalised_features_answers_an_error(query, tmp_path, monkeypatch):
    """Scores past a cosine's range are not clipped into fake ties at 1: the site says what is wrong."""
    raw = unit_rows(6, 5) * np.arange(1, 7, dtype=np.float32)[:, None]  # norms 1..6
    store = store_of_any_norms(monkeypatch, tmp_path / "raw", raw)
    answer = answer_query(store, SearchQuery(raw[5] / 6, 3, fingerprint=FP), site="sa")
    assert not answer.ok and answer.hits == () and "not L2-normalised" in answer.error
    unit = make_store(tmp_path / "unit", 6, 5, site="sa")
    assert answer_query(unit, SearchQuery(query, 3, fingerprint=FP), site="sa").ok


def test_scores_past_what_unit_vectors_give_are_an_error_not_clipped_ties(query, tmp_path, monkeypatch):
    """A store's scores are exact float32 inner products: past the store's norm rule and rounding, an error.

    The store holds features of norm 1.04 (an older store: the store's own check is lifted while it is
    written), the query's own vector among them: clipped to 1 its scores would tie and rank by id.
    """
    feats = np.concatenate([query[None], unit_rows(7, 8)]) * np.float32(1.04)
    store = store_of_any_norms(monkeypatch, tmp_path / "raw", feats)
    assert store.search(query[None], 1).scores[0, 0] > 1.03  # what the store gives: not a cosine
    answer = answer_query(store, SearchQuery(query, 3, fingerprint=FP), site="sa")
    assert not answer.ok and answer.hits == () and "not L2-normalised" in answer.error
    # Features within the norm a store takes (GalleryStore.create's own check) are answered, scores at most 1.
    edge = GalleryStore.create(tmp_path / "edge", feats / 1.04 * np.float32(1.0009),
                               [{"path": f"/g/{i}.jpg"} for i in range(8)], meta={"model_fingerprint": FP})
    answer = answer_query(edge, SearchQuery(query, 3, fingerprint=FP), site="sa")
    assert answer.ok and answer.hits[0].id == 0 and answer.hits[0].score == 1.0
    # Unit features give the query's own vector a score within float32 rounding of 1: answered, at most 1.
    unit = GalleryStore.create(tmp_path / "unit", feats / np.linalg.norm(feats, axis=1, keepdims=True),
                               [{"path": f"/g/{i}.jpg"} for i in range(8)], meta={"model_fingerprint": FP})
    answer = answer_query(unit, SearchQuery(query, 3, fingerprint=FP), site="sa")
    assert answer.ok and answer.hits[0].id == 0 and 1 - 1e-6 <= answer.hits[0].score <= 1.0
    assert decode_hits(encode_hits(answer), k=3).hits == answer.hits  # the server takes it
    # A query whose norm is off 1 within the codec's tolerance scales every score alike: still an answer.
    longer = SearchQuery(query * np.float32(1.0009), 3, fingerprint=FP)
    answer = answer_query(unit, longer, site="sa")
    assert answer.ok and answer.hits[0].id == 0 and answer.hits[0].score == 1.0


def test_thumbnails_only_where_the_site_allows_and_the_query_asks(stores, query):
    store = stores["sa"]
    allowed = SitePolicy(thumbnails=True, thumbnail_size=24)
    assert all(h.thumbnail is None for h in
               answer_query(store, SearchQuery(query, 3, fingerprint=FP), site="sa", policy=allowed).hits)
    assert all(h.thumbnail is None for h in
               answer_query(store, SearchQuery(query, 3, fingerprint=FP, thumbnails=True), site="sa").hits)
    hits = answer_query(store, SearchQuery(query, 3, fingerprint=FP, thumbnails=True), site="sa", policy=allowed).hits
    assert len(hits) == 3 and all(h.thumbnail.startswith(b"\xff\xd8\xff") for h in hits)
    import io

    with Image.open(io.BytesIO(hits[0].thumbnail)) as thumb:
        assert max(thumb.size) <= 24 and thumb.format == "JPEG"
        assert not thumb.getexif()  # the source's EXIF (a description) is not carried over
    # Through the records too, and a site without images still answers (no thumbnail).
    reply = site_reply(encode_query(SearchQuery(query, 3, fingerprint=FP, thumbnails=True)), site="sa",
                       store_folder=store.folder, policy=allowed)
    assert all(h.thumbnail for h in decode_hits(reply, k=3).hits)
    reply = site_reply(encode_query(SearchQuery(query, 3, fingerprint=FP, thumbnails=True)), site="sc",
                       store_folder=stores["sc"].folder, policy=allowed)
    assert [h.thumbnail for h in decode_hits(reply).hits] == [None] * 3


def test_a_gallery_file_replaced_by_a_link_sends_no_thumbnail(query, tmp_path, caplog):
    """Thumbnails are read as the service reads images: a regular file inside the gallery roots, or none at all."""
    store = make_store(tmp_path / "s", 6, 1, images=True, site="sa")
    secret = tmp_path / "elsewhere" / "secret.jpg"
    secret.parent.mkdir()
    Image.new("RGB", (48, 96), (250, 5, 5)).save(secret)
    paths = {int(i): Path(r["path"]) for i, r in zip(store.ids, store.rows(store.ids.tolist()))}
    paths[1].unlink()
    paths[1].symlink_to(secret)  # the gallery file, later replaced by a link to an image outside the gallery
    paths[2].unlink()  # a missing file: no thumbnail either, as before
    allowed = SitePolicy(thumbnails=True, thumbnail_size=24)
    with caplog.at_level("WARNING", logger="fedreid.flower.search"):
        hits = answer_query(store, SearchQuery(query, 6, fingerprint=FP, thumbnails=True), site="sa",
                            policy=allowed).hits
    thumbs = {h.id: h.thumbnail for h in hits}
    assert thumbs[1] is None and thumbs[2] is None
    assert all(thumbs[i].startswith(b"\xff\xd8\xff") for i in (0, 3, 4, 5))
    assert make_thumbnail(secret.read_bytes(), 24) not in thumbs.values()
    assert "outside the gallery" in caplog.text and "missing on the server" in caplog.text
    # The reasons only: a path, file name or id in the site's log would outlive the item's erasure.
    for gone in (paths[1], paths[2]):
        assert gone.name not in caplog.text and str(gone.parent) not in caplog.text
    assert "secret" not in caplog.text and all(f"store id {i}" not in caplog.text for i in (1, 2))
    # The node's gallery-root is where relative paths lie, and the only folder they are read from.
    images = tmp_path / "relative_images"
    images.mkdir()
    for name in ("a.jpg", "b.jpg"):
        Image.new("RGB", (48, 96), (10, 80, 160)).save(images / name)
    (images / "c.jpg").symlink_to(secret)
    relative = GalleryStore.create(tmp_path / "rel", unit_rows(3, 2), [{"path": n} for n in ("a.jpg", "b.jpg", "c.jpg")],
                                   meta={"model_fingerprint": FP})
    policy = SitePolicy(thumbnails=True, thumbnail_size=24, image_root=images)
    got = {relative.rows([h.id])[0]["path"]: h.thumbnail for h in
           answer_query(relative, SearchQuery(query, 3, fingerprint=FP, thumbnails=True), site="sa",
                        policy=policy).hits}
    assert got["a.jpg"] and got["b.jpg"] and got["c.jpg"] is None


def test_site_reply_refusals_carry_no_local_path(stores, query, tmp_path):
    content = encode_query(SearchQuery(query, 3, fingerprint=FP))
    no_store = decode_hits(site_reply(content, site="sa", store_folder=None))
    assert "no gallery store" in no_store.error
    broken = tmp_path / "secret_place" / "store"
    broken.mkdir(parents=True)
    (broken / "header.json").write_text("{")
    answer = decode_hits(site_reply(content, site="sa", store_folder=broken))
    assert "cannot be opened" in answer.error and "secret_place" not in answer.error
    bad = encode_query(SearchQuery(query, 3, fingerprint=FP))
    del bad["fedreid.search.feature"]
    assert "malformed query" in decode_hits(site_reply(bad, site="sa", store_folder=stores["sa"].folder)).error
    # A normal answer holds no folder of the site either.
    reply = site_reply(content, site="sa", store_folder=stores["sa"].folder)
    text = repr({k: dict(v) for k, v in reply.items() if isinstance(v, ConfigRecord)})
    assert str(stores["sa"].folder.parent) not in text and "cam" in text


@pytest.mark.parametrize("filters, message", [
    ('{"cameras":[%d]}' % 10**40, "filters.cameras (each a camera) must be an integer from -2147483648 to 2147483647"),
    ('{"time_window":[%d,null]}' % 10**400, "filters.time_window[]: expected a finite number"),
    ('{"time_window":[null,1e15]}', "filters.time_window: until must be seconds since the epoch"),
    ('{"sites":["a\\u0000b"]}', "filters.sites (each a site) must be a name"),
    ('{"cameras":"1"}', "filters.cameras: expected a list"),
])
def test_a_bad_filter_gets_a_clear_error_record_from_the_client_app(stores, query, filters, message):
    """The ClientApp checks a query's filters with the gallery's own rules and answers with an error record."""
    content = encode_query(SearchQuery(query, 3, fingerprint=FP))
    content["fedreid.search.query"]["filters"] = filters  # as a hostile or broken server could send it
    with FakeGrid(flower_app.client_app, {1: {"client": "sa", "gallery-store": str(stores["sa"].folder)}}) as grid:
        [mid] = grid.push_messages([Message(content=content, dst_node_id=1, message_type="query")])
        [reply] = grid.pull_messages([mid])
    assert not reply.has_error()  # an answer, not a ClientApp failure
    answer = decode_hits(reply.content)
    assert not answer.ok and answer.error.startswith("malformed query: ") and message in answer.error, answer.error


def test_an_unexpected_failure_on_a_site_is_an_error_record_without_its_paths(stores, query, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError(f"disk trouble under {stores['sa'].folder}")

    monkeypatch.setattr("fedreid.flower.search.answer_query", broken)
    answer = decode_hits(site_reply(encode_query(SearchQuery(query, 3, fingerprint=FP)), site="sa",
                                    store_folder=stores["sa"].folder))
    assert not answer.ok and "unexpected" in answer.error and str(stores["sa"].folder) not in answer.error
    # The gallery's own rule refuses such a number in words too (it is the rule the filters are checked with).
    from fedreid.retrieval import fields

    with pytest.raises(fields.GalleryMetadataError, match="timestamp must be seconds since the epoch"):
        fields.timestamp(10**400)


# ----------------------------------------------------------------------------- the merge


def test_merge_orders_by_score_breaks_ties_by_site_and_id_and_cuts_at_k():
    a = SiteAnswer("b-site", (Hit("b-site", 4, 0.9), Hit("b-site", 2, 0.5), Hit("b-site", 1, 0.5)))
    b = SiteAnswer("a-site", (Hit("a-site", 7, 0.5), Hit("a-site", 3, 0.95), Hit("a-site", 8, 0.1)))
    c = SiteAnswer("c-site", error="model fingerprint mismatch")
    merged = merge_answers([a, c, b], 5)
    assert triples(merged) == [("a-site", 3, 0.95), ("b-site", 4, 0.9), ("a-site", 7, 0.5), ("b-site", 1, 0.5),
                               ("b-site", 2, 0.5)]
    assert merge_answers([b, a], 5) == merged  # the order answers came in does not matter
    assert len(merge_answers([a, b], 2)) == 2 and merge_answers([c], 3) == []


def test_federated_search_over_the_grid_lists_missing_sites(stores, query, tmp_path):
    make_store(tmp_path / "other", 5, 7, fingerprint=dict(FP, weights_sha256="ee" * 32))
    nodes = {101: {"client": "sa", "gallery-store": str(stores["sa"].folder), "search-thumbnails": "true"},
             102: {"client": "sb", "gallery-store": str(stores["sb"].folder)},
             103: {"client": "sc", "gallery-store": str(stores["sc"].folder)},
             104: {"client": "sd", "gallery-store": str(tmp_path / "other")},  # another model's features
             105: {"client": "se"},  # no store
             106: {"client": "sf", "gallery-store": str(stores["sa"].folder)},  # vanished node
             107: {"client": "sg", "gallery-store": str(stores["sa"].folder)},  # the SuperLink's error reply
             108: {"client": "sh", "gallery-store": str(stores["sa"].folder)},  # too many hits
             109: {"client": "sa", "gallery-store": str(stores["sb"].folder)}}  # a second "sa"

    def tamper(node, msg, reply):
        if node == 106:
            return None
        if node == 107:
            return Message(Error(ErrorCode.NODE_UNAVAILABLE, "the destination node is offline"), reply_to=msg)
        if node == 108:
            hits = tuple(Hit("sh", i, 0.1) for i in range(9))
            return Message(encode_hits(SiteAnswer("sh", hits)), reply_to=msg)
        return reply

    k = 8
    with FakeGrid(flower_app.client_app, nodes, tamper=tamper) as grid:
        result = federated_search(grid, grid.get_node_ids(), query, k, None, 0.5, fingerprint=FP, thumbnails=True,
                                  expected_sites=["sa", "sb", "sc", "sz"], poll_seconds=0.05)
        sent = grid.sent
    assert all(m.metadata.message_type == "query" and m.metadata.ttl == 0.5 for m in sent)
    expected = exact_merge([exact_answer(stores[s], s, query, k) for s in SITES], k)
    assert triples(result.results) == expected
    assert [(a.site, a.node_id) for a in result.answered] == [("sa", 101), ("sb", 102), ("sc", 103)]
    assert {h.thumbnail is not None for h in result.results if h.site == "sa"} == {True}
    assert {h.thumbnail for h in result.results if h.site != "sa"} == {None}
    missing = {m.node_id: m for m in result.missing}
    assert missing[104].code == "refused" and "fingerprint mismatch" in missing[104].reason
    assert missing[105].code == "refused" and "no gallery store" in missing[105].reason
    assert missing[106].code == "no-reply" and "0.5 s" in missing[106].reason and missing[106].site is None
    assert missing[107].code == "unavailable" and "offline" in missing[107].reason
    assert missing[108].code == "malformed" and "at most k=8" in missing[108].reason
    assert missing[109].code == "duplicate" and missing[109].site == "sa"
    assert [(m.site, m.code) for m in result.missing if m.node_id is None] == [("sz", "not-answered")]
    assert "106, 107, 108" in missing[None].reason
    plain = result.to_plain()
    assert plain["format"] == RESULT_FORMAT and [r["rank"] for r in plain["results"]] == list(range(1, k + 1))
    lines = format_result(json.loads(json.dumps(plain)))
    assert lines[0].startswith(f"federated search: {k} results (k={k}) from 3 sites (sa, sb, sc); 7 missing")
    assert any(line.startswith("missing: sz: not-answered") for line in lines)


def planted_store(folder: Path, query: np.ndarray) -> GalleryStore:
    """A store whose one item is the query itself (score 1.0: it would rank first anywhere)."""
    return GalleryStore.create(folder, query[None], [{"path": "/srv/x/planted.jpg", "camera": 0}],
                               meta={"model_fingerprint": FP})


def test_a_node_cannot_answer_as_another_site(stores, query, tmp_path):
    """With node authentication a site is the name its key was registered under, whatever its answer says."""
    planted_store(tmp_path / "planted", query)
    nodes = {100: {"client": "sa", "gallery-store": str(tmp_path / "planted")},  # key registered as "sx"
             101: {"client": "sa", "gallery-store": str(stores["sa"].folder)},
             102: {"client": "sb", "gallery-store": str(stores["sb"].folder)},
             103: {"client": "sc", "gallery-store": str(stores["sc"].folder)}}  # key registered without a name
    registered = {100: "sx", 101: "sa", 102: "sb"}
    k = 6
    expected = exact_merge([exact_answer(stores[s], s, query, k) for s in ("sa", "sb")], k)
    with FakeGrid(flower_app.client_app, nodes, registered=registered) as grid:
        assert registered_sites(grid) == registered
        result = federated_search(grid, grid.get_node_ids(), query, k, None, 0.5, fingerprint=FP,
                                  bound_sites=registered_sites(grid), expected_sites=["sa", "sb", "sc"],
                                  poll_seconds=0.05)
        # The ServerApp's mode=search binds the names itself when the run config says node-auth.
        text = search_run_config_string(encode_vector(query), k=k, fingerprint=FP, timeout=0.5, join_timeout=0,
                                        node_auth=True)
        served = serve_search(grid, parse_config_args([text]))
        # Without node authentication the names are the nodes' own: the impostor wins, and the result says so.
        unbound = federated_search(grid, grid.get_node_ids(), query, k, None, 0.5, fingerprint=FP, poll_seconds=0.05)
    assert triples(result.results) == expected and triples(served.results) == expected
    assert "planted.jpg" not in {h.name for h in result.results}
    assert [(a.site, a.node_id, a.verified) for a in result.answered] == [("sa", 101, True), ("sb", 102, True)]
    missing = {m.node_id: m for m in result.missing}
    assert missing[100].code == "wrong-site" and missing[100].site == "sx"
    assert "answers as site 'sa'" in missing[100].reason and "registered as site 'sx'" in missing[100].reason
    assert missing[103].code == "unbound" and missing[103].site is None and "'sc'" in missing[103].reason
    assert [m.site for m in result.missing if m.code == "not-answered"] == ["sc"]
    assert result.authenticated and served.authenticated
    assert "site names: authenticated" in format_result(result.to_plain())[0]
    assert not unbound.authenticated and not any(a.verified for a in unbound.answered)
    assert "site names: as the nodes declare them" in format_result(unbound.to_plain())[0]
    assert unbound.results[0].name == "planted.jpg"  # what node authentication prevents


def test_scores_outside_the_cosine_range_mark_the_answer_malformed(stores, query):
    """A made-up score (1e30) must not rank first: the site's answer is malformed, the others still merge."""
    nodes = {1: {"client": "sa", "gallery-store": str(stores["sa"].folder)},
             2: {"client": "sb", "gallery-store": str(stores["sb"].folder)},
             3: {"client": "sc", "gallery-store": str(stores["sc"].folder)}}
    bad_scores = {2: [1e30, 0.5], 3: [0.3, -1.5]}

    def tamper(node, msg, reply):
        if node in bad_scores:
            hits = tuple(Hit(f"s{node}", i, s) for i, s in enumerate(bad_scores[node]))
            return Message(encode_hits(SiteAnswer(nodes[node]["client"], hits)), reply_to=msg)
        return reply

    k = 5
    with FakeGrid(flower_app.client_app, nodes, tamper=tamper) as grid:
        result = federated_search(grid, grid.get_node_ids(), query, k, None, 0.5, fingerprint=FP, poll_seconds=0.05)
    assert triples(result.results) == exact_answer(stores["sa"], "sa", query, k)
    missing = {m.node_id: m for m in result.missing}
    assert {n: m.code for n, m in missing.items()} == {2: "malformed", 3: "malformed"}
    assert "cosine similarities in [-1.001, 1.001], got 1e+30 (hit 0)" in missing[2].reason
    assert "got -1.5 (hit 1)" in missing[3].reason
    # Within float rounding of +-1 is a cosine; the codec refuses the rest whatever the caller.
    edge = SiteAnswer("sa", (Hit("sa", 1, np.float32(1.0005).item()), Hit("sa", 2, -1.0)))
    assert decode_hits(encode_hits(edge)).hits == edge.hits
    with pytest.raises(SearchCodecError, match="cosine"):
        decode_hits(encode_hits(SiteAnswer("sa", (Hit("sa", 1, 1.01),))))
    # A query is a unit vector (so the scores are cosines), refused otherwise in words.
    with pytest.raises(SearchCodecError, match="L2-normalised vector .* got norm 2"):
        SearchQuery(query * 2, 3)
    # What a site sends stays inside: test_scores_past_what_unit_vectors_give_are_an_error_not_clipped_ties.


FILTERED = {"cameras": [1], "sites": ["lobby"], "time_window": [1000.0, 2000.0]}


@pytest.mark.parametrize("row, message", [
    ({"camera": 9}, "rows[1]: camera 9 is not among the query's cameras [1]"),
    ({"camera": None}, "rows[1]: camera None is not among the query's cameras [1]"),
    ({"timestamp": 5e9}, "rows[1]: timestamp 5000000000.0 is outside the query's time window [1000.0, 2000.0]"),
    ({"timestamp": 999.999}, "rows[1]: timestamp 999.999 is outside"),
    ({"timestamp": 2000.001}, "rows[1]: timestamp 2000.001 is outside"),
    ({"timestamp": None}, "rows[1]: timestamp None is outside"),
    ({"row_site": "garage"}, "rows[1]: site column 'garage' is not among the query's sites ['lobby']"),
    ({"row_site": "Lobby"}, "site column 'Lobby' is not among"),  # the store compares names exactly
    ({"row_site": None}, "site column None is not among"),
])
def test_an_answer_with_a_hit_outside_the_query_filters_is_malformed(query, row, message):
    """A site is untrusted: a hit its store could not have returned for these filters voids its whole answer."""
    q = make_query(query, 5, FILTERED, fingerprint=FP, thumbnails=False)
    passing = {"camera": 1, "timestamp": 1000.0, "row_site": "lobby"}  # both window ends are inclusive
    bad = SiteAnswer("sa", (Hit("sa", 3, 0.9, name="a.jpg", **passing),
                            Hit("sa", 4, 0.8, name="b.jpg", **dict(passing, **row))))
    good = SiteAnswer("sb", (Hit("sb", 2, 0.5, camera=1, timestamp=2000.0, name="c.jpg", row_site="lobby"),))
    result = judge_replies(q, {1: NodeReply(encode_hits(bad)), 2: NodeReply(encode_hits(good))}, timeout=1.0,
                           started=time.monotonic())
    assert triples(result.results) == [("sb", 2, 0.5)]  # none of sa's hits, not even the one that passes
    assert [a.site for a in result.answered] == ["sb"]
    assert [(m.node_id, m.code) for m in result.missing] == [(1, "malformed")]
    assert message in result.missing[0].reason and result.missing[0].reason.startswith("answer rejected: ")
    assert "missing: unknown site (node 1): malformed: answer rejected: rows[1]: " in format_result(result.to_plain())[-1]


def test_the_server_checks_hits_with_the_store_filter_rule(query, tmp_path):
    """What the server lets through is exactly what the site's store selects, NULLs, case and window ends included."""
    values = itertools.product([None, 0, 1, 7], [None, "lobby", "Lobby", "garage"],
                               [None, 999.5, 1000.0, 1500.25, 2000.0, 2000.5])
    rows = [{"path": f"/g/{i:03d}.jpg", "camera": c, "site": s, "timestamp": t} for i, (c, s, t) in enumerate(values)]
    store = GalleryStore.create(tmp_path / "s", unit_rows(len(rows), 8), rows, meta={"model_fingerprint": FP})
    stored = dict(zip(store.ids.tolist(), store.rows(store.ids.tolist())))
    for plain in [{"cameras": [1]}, {"cameras": [0, 7]}, {"cameras": []}, {"sites": ["lobby"]},
                  {"sites": ["Lobby", "garage"]}, {"time_window": [1000.0, 2000.0]}, {"time_window": [None, 1000.0]},
                  {"time_window": [2000.0, None]}, {"time_window": [None, None]}, FILTERED,
                  {"cameras": [0, 1], "sites": ["lobby", "garage"], "time_window": [999.5, 1500.25]}]:
        filters = SearchFilters.from_plain(plain)
        selected = set(store.filtered_ids(**filters.store_kwargs()).tolist())
        admitted = {i for i, r in stored.items() if filters.refusal(r["camera"], r["timestamp"], r["site"]) is None}
        assert admitted == selected, plain
        # The site's honest answer is merged whole.
        answer = answer_query(store, SearchQuery(query, len(rows), filters, FP), site="sa")
        result = judge_replies(make_query(query, len(rows), filters, fingerprint=FP, thumbnails=False),
                               {1: NodeReply(encode_hits(answer))}, timeout=1.0, started=time.monotonic())
        assert result.missing == [] and triples(result.results) == triples(answer.hits), plain
        assert {h.id for h in result.results} == selected


HOSTILE = "\x1b[2J\x1b]0;owned\x07\nmissing: nothing\r\u202egpj.exe"


def test_printable_shows_text_from_elsewhere_on_one_safe_line():
    assert printable("cam1_0001.jpg") == "cam1_0001.jpg" and printable("Zürich-北") == "Zürich-北"
    shown = printable(HOSTILE)
    assert shown == "\\x1b[2J\\x1b]0;owned\\x07\\x0amissing: nothing\\x0d\\u202egpj.exe"
    assert shown.isprintable() and printable("a\\x1b") == "a\\\\x1b"  # a typed escape is not an escape shown
    assert printable("x" * 50, 10) == "x" * 10 + "..." and printable(7) == "7"


def test_what_a_site_sends_is_printed_sanitised(stores, query):
    """Names, site names and errors from sites reach the terminal as one escaped line each."""
    nodes = {1: {"client": "sa", "gallery-store": str(stores["sa"].folder)},
             2: {"client": "sb"}, 3: {"client": "sc"}, 4: {"client": "sd"}}

    def tamper(node, msg, reply):
        if node == 1:  # a hit's file name and the row's site column
            hits = (Hit("sa", 3, 0.5, name=HOSTILE, row_site=HOSTILE),)
            return Message(encode_hits(SiteAnswer("sa", hits)), reply_to=msg)
        if node == 2:  # a refusal's text
            return Message(encode_hits(SiteAnswer("sb", error=HOSTILE)), reply_to=msg)
        if node == 3:  # the ClientApp's failure, as Flower reports it
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, HOSTILE), reply_to=msg)
        return Message(encode_hits(SiteAnswer("sd\x1b[31m", ())), reply_to=msg)  # a site name

    with FakeGrid(flower_app.client_app, nodes, tamper=tamper) as grid:
        result = federated_search(grid, grid.get_node_ids(), query, 3, None, 0.5, fingerprint=FP,
                                  expected_sites=["sa", "s\u202eb"], poll_seconds=0.05)
    missing = {m.node_id: m for m in result.missing}
    assert missing[4].code == "malformed" and "site must be a name" in missing[4].reason  # refused at decoding
    lines = format_result(json.loads(json.dumps(result.to_plain())))
    assert len(lines) == 1 + 2 + len(result.missing)  # header, column names, one hit, one line per missing site
    assert all(line.isprintable() for line in lines), lines
    text = "\n".join(lines)
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x0amissing: nothing" in text and "\\u202egpj.exe" in text
    assert not any(line.startswith("missing: nothing") for line in lines)
    assert "s\\u202eb" in text  # an expected site name as the operator typed it, escaped too


def test_search_mode_of_the_server_app(stores, query, tmp_path):
    text = search_run_config_string(encode_vector(query), k=4, fingerprint=dict(FP, note="it's"),
                                    filters={"cameras": [0, 2]}, timeout=0.5, expect=["sa", "sb"],
                                    out=tmp_path / "r.json", join_timeout=0)
    run_config = {**{"config": "", "overrides": "", "resume": False}, **parse_config_args([text])}
    settings = SearchSettings.from_run_config(run_config)
    assert np.array_equal(settings.feature, query) and settings.fingerprint["note"] == "it's"
    assert (settings.k, settings.filters.cameras, settings.expect) == (4, (0, 2), ("sa", "sb"))
    # ServerSettings knows the search keys (flwr fuses every key of the app's config into the run config).
    flower_app.ServerSettings.from_run_config({**run_config, "out": "r"})
    nodes = {1: {"client": "sa", "gallery-store": str(stores["sa"].folder)}}
    run_config["search-fingerprint"] = json.dumps(FP)
    with FakeGrid(flower_app.client_app, nodes) as grid:
        flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                             run_config=run_config))
        doc = json.loads((tmp_path / "r.json").read_text())
        assert triples(doc["results"]) == exact_answer(stores["sa"], "sa", query, 4, cameras=[0, 2])
        assert [(m["site"], m["code"]) for m in doc["missing"]] == [("sb", "not-answered")]
        result = serve_search(grid, dict(run_config, out=str(tmp_path / "elsewhere" / "r.json")))
        assert len(result.results) == 4 and not (tmp_path / "elsewhere").exists()  # no folder made on this side
        (tmp_path / "notes.json").write_text("{}")
        with pytest.raises(ConfigError, match="not a federated search result"):
            serve_search(grid, dict(run_config, out=str(tmp_path / "notes.json")))
        with pytest.raises(ConfigError, match="mode='explore'"):
            flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                 run_config=dict(run_config, mode="explore")))
    with pytest.raises(ConfigError, match="search-vector"):
        SearchSettings.from_run_config({"mode": "search"})
    with pytest.raises(ConfigError, match="float32"):
        decode_vector("AAAAAAA=")
    with pytest.raises(LaunchError, match="without spaces"):
        search_run_config_string("AAAA", k=1, expect=["a b"])


@pytest.fixture
def socket_dir():
    """A short folder for a Unix socket (a socket path holds at most 107 bytes; pytest's tmp paths can be longer)."""
    folder = Path(tempfile.mkdtemp(prefix="fr-s-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_search_session_answers_query_after_query_and_sees_sites_come_and_go(stores, query, socket_dir):
    sock = socket_dir / "session.sock"
    nodes = {1: {"client": "sa", "gallery-store": str(stores["sa"].folder)},
             2: {"client": "sb", "gallery-store": str(stores["sb"].folder)},
             3: {"client": "sc", "gallery-store": str(stores["sc"].folder)}}
    k = 8
    everyone = exact_merge([exact_answer(stores[s], s, query, k) for s in SITES], k)
    run_config = parse_config_args([session_run_config_string(sock, timeout=0.5, expect=SITES, node_auth=True)])
    with FakeGrid(flower_app.client_app, nodes, registered={1: "sa", 2: "sb", 3: "sc"}) as grid:
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
        thread = threading.Thread(target=flower_app.server_main, args=(grid, context), daemon=True)
        thread.start()
        try:
            client = SessionClient(sock, timeout=30)
            status = client.wait_ready(30)
            assert status["nodes"] == [1, 2, 3] and status["sites"] == {"1": "sa", "2": "sb", "3": "sc"}
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600  # only this user can query
            first = client.search(query, k, fingerprint=FP)
            assert triples(first["results"]) == everyone and first["authenticated"] and first["missing"] == []
            left = grid.nodes.pop(3)  # sc's SuperNode leaves: the next query goes on without it
            second = client.search(query, k, fingerprint=FP, filters={"cameras": [0, 1]})
            assert triples(second["results"]) == exact_merge(
                [exact_answer(stores[s], s, query, k, cameras=[0, 1]) for s in ("sa", "sb")], k)
            assert [(m["site"], m["code"]) for m in second["missing"]] == [("sc", "not-answered")]
            grid.nodes[3] = left  # and comes back (node authentication: the same node id): searched again
            assert triples(client.search(query, k, fingerprint=FP)["results"]) == everyone
            # A refused request is answered in words; the session goes on.
            for request, message in [({"op": "search", "vector": encode_vector(query), "k": 0}, "k: expected"),
                                     ({"op": "search", "vector": encode_vector(query * 3), "fingerprint": FP},
                                      "L2-normalised"),
                                     ({"op": "search", "vector": "%%%"}, "base64"),
                                     ({"op": "dance"}, "unknown op 'dance'")]:
                with pytest.raises(SessionError, match=message):
                    client.request(request)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.connect(str(sock))
                raw.sendall(b"not json\n")
                assert b"not JSON" in raw.recv(4096)
            assert client.status()["queries"] == 3
            assert client.close_session() == 3
            thread.join(30)
        finally:
            if thread.is_alive():
                SessionClient(sock).close_session()
    assert not thread.is_alive() and not sock.exists()  # the socket goes with the session
    with pytest.raises(SessionError, match="no search session at"):
        client.status()
    # A file in the socket's place is never replaced; a path too long for a socket is refused in words.
    sock.write_text("notes")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        serve_session(grid, run_config)
    assert sock.read_text() == "notes"
    with pytest.raises(ConfigError, match="at most 107 bytes"):
        serve_session(grid, dict(run_config, **{"session-socket": "/tmp/" + "x" * 120}))
    with pytest.raises(ConfigError, match="session-socket"):
        SessionSettings.from_run_config({"mode": "search-session"})


def test_query_files_and_node_settings(tmp_path, stores):
    np.save(tmp_path / "q.npy", np.ones((1, D), np.float64) / np.sqrt(D))
    assert read_feature_file(tmp_path / "q.npy").dtype == np.float32
    np.save(tmp_path / "bad.npy", np.ones((2, D)))
    with pytest.raises(ConfigError, match=r"shape \[d\] or \[1, d\]"):
        read_feature_file(tmp_path / "bad.npy")
    # What no query may carry is refused with the file's name: the codec's own checks.
    np.save(tmp_path / "long.npy", np.ones(D))
    with pytest.raises(ConfigError, match=r"long\.npy: feature: expected an L2-normalised vector .* got norm 4\b"):
        read_feature_file(tmp_path / "long.npy")
    np.save(tmp_path / "nan.npy", np.full(D, np.nan))
    with pytest.raises(ConfigError, match=r"nan\.npy: feature: expected finite numbers"):
        read_feature_file(tmp_path / "nan.npy")
    assert read_fingerprint_file(stores["sa"].folder / "header.json") == FP
    assert read_fingerprint_file(stores["sb"].folder / "header.json") == FP
    (tmp_path / "fp.json").write_text(json.dumps(FP))
    assert read_fingerprint_file(tmp_path / "fp.json") == FP
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="model fingerprint"):
        read_fingerprint_file(tmp_path / "list.json")
    node = flower_app.NodeSettings.from_node_config({"client": "sa", "gallery-store": "/srv/g",
                                                     "search-thumbnails": "true", "thumbnail-size": "32"})
    assert node.gallery_store == Path("/srv/g") and node.search_policy == SitePolicy(True, 32) and node.site == "sa"
    assert not flower_app.NodeSettings.from_node_config({"client": "sa"}).search_policy.thumbnails
    with pytest.raises(ConfigError, match="thumbnail-size: expected 16..256"):
        flower_app.NodeSettings.from_node_config({"client": "sa", "thumbnail-size": "4096"})


def test_node_command_passes_the_search_settings(tmp_path, stores):
    done = subprocess.run([sys.executable, str(TOOL), "node", "--client", "sa", "--superlink", "h:1", "--insecure",
                           "--gallery-store", "g", "--search-thumbnails", "--print-only"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert f"gallery-store='{tmp_path / 'g'}'" in done.stdout and "search-thumbnails='true'" in done.stdout
    refused = subprocess.run([sys.executable, str(TOOL), "node", "--client", "sa", "--superlink", "h:1", "--insecure",
                              "--state-dir", "st", "--gallery-store", "nowhere"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "nowhere" in refused.stderr and "Traceback" not in refused.stderr


def test_image_query_gives_the_evaluation_feature_and_the_model_fingerprint(tmp_path, one_torch_thread):
    import torch

    from fedreid.config import ModelConfig, to_dict
    from fedreid.flower.search import image_query
    from fedreid.inference.model_io import load_model
    from fedreid.models.reid import create_reid_model, shared_state

    run = tmp_path / "run"
    run.mkdir()
    model = create_reid_model("resnet18", 0, bottleneck_dim=16, seed=0)
    torch.save({"format": "fedreid.model", "model": to_dict(ModelConfig(backbone="resnet18", bottleneck_dim=16,
                height=32, width=16)), "mode": "fedpav", "round": 1, "state": shared_state(model)},
               run / "model_final.pt")
    Image.new("RGB", (16, 32), (200, 30, 60)).save(tmp_path / "q.jpg")
    feature, fingerprint = image_query(tmp_path / "q.jpg", run)
    assert feature.dtype == np.float32 and feature.shape == (16,)
    assert abs(float(np.linalg.norm(feature)) - 1.0) < 1e-5
    assert fingerprint == load_model(run).fingerprint
    store = make_store(tmp_path / "st", 6, 4, fingerprint=fingerprint)
    assert answer_query(store, SearchQuery(feature, 3, fingerprint=fingerprint), site="sa").ok


@pytest.mark.parametrize("args, message", [
    (["search", "--superlink", "h:1", "--feature", "q.npy"], "--ca CA_FILE"),
    (["search", "--superlink", "h:1", "--insecure", "--feature", "q.npy"], "--feature needs --fingerprint"),
    (["search", "--superlink", "h:1", "--insecure", "--image", "q.jpg"], "--image needs --model"),
    (["search", "--superlink", "h:1", "--insecure", "--feature", "q.npy", "--k", "0"], "--k: expected 1..1000, got 0"),
    (["search", "--superlink", "h:1", "--insecure", "--feature", "q.npy", "--since", "5", "--until", "1"],
     "since 5.0 is after until 1.0"),
    (["search", "--superlink", "h:1", "--insecure", "--feature", "q.npy", "--camera", str(10**40)],
     "filters.cameras (each a camera) must be an integer from -2147483648 to 2147483647"),
    (["search", "--superlink", "h:1", "--insecure", "--node-auth", "--feature", "q.npy"], "--node-auth needs --ca"),
])
def test_search_command_refusals_are_one_clear_line(tmp_path, args, message):
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


_DOOR_REFUSALS = [
    (np.arange(1, D + 1, dtype=np.float32), [],
     r"search: --feature \S*q\.npy: feature: expected an L2-normalised vector .* got norm 38\.6"),
    (np.full(D, np.nan, np.float32), [], r"search: --feature \S*q\.npy: feature: expected finite numbers"),
    (None, ["--timeout", "nan"], r"search: --timeout: expected seconds > 0, got nan"),
    (None, ["--timeout", "inf"], r"search: --timeout: expected seconds > 0, got inf"),
    (None, ["--k", "1001"], r"search: --k: expected 1\.\.1000, got 1001"),
    (None, ["--camera", str(10**40)], r"search: --camera: filters\.cameras"),
]
_ONE_RUN, _SESSION = ["--superlink", "h:1", "--insecure"], ["--session", "no.sock"]


@pytest.mark.parametrize("where, feature, options, message", [
    *[(_ONE_RUN, *case) for case in _DOOR_REFUSALS],
    *[(_SESSION, *case) for case in _DOOR_REFUSALS],
    (_ONE_RUN, None, ["--join-timeout", "nan"], r"search: --join-timeout: expected seconds >= 0, got nan"),
    (_ONE_RUN, None, ["--join-timeout", "-1"], r"search: --join-timeout: expected seconds >= 0, got -1"),
])
def test_the_search_command_refuses_what_the_server_app_would_before_starting_anything(
        tmp_path, monkeypatch, where, feature, options, message):
    """Each value ``mode=search`` refuses inside a started run is refused by the command first, naming the option."""
    from fedreid.commands.flower_fed import main
    from fedreid.flower import search_client

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(search_client, "search_in_one_run", start)
    monkeypatch.setattr(search_client, "search_in_session", start)
    np.save(tmp_path / "q.npy", unit_rows(1, 3)[0] if feature is None else feature)
    (tmp_path / "fp.json").write_text(json.dumps(FP))
    args = ["search", *where, "--feature", str(tmp_path / "q.npy"), "--fingerprint", str(tmp_path / "fp.json"),
            *options]
    with pytest.raises(ConfigError, match=message) as refused:
        main(args)
    assert "\n" not in str(refused.value)
    # The same command with good values goes on to the search.
    np.save(tmp_path / "q.npy", unit_rows(1, 3)[0])
    with pytest.raises(Started):
        main(args[: len(where) + 5])


def test_the_session_command_refuses_timeouts_the_server_app_would_before_starting(tmp_path, monkeypatch):
    from fedreid.commands.flower_fed import main
    from fedreid.flower import search_client

    monkeypatch.setattr(search_client, "run_session", lambda **kw: pytest.fail("a session was started"))
    base = ["session", "--superlink", "h:1", "--insecure", "--socket", str(tmp_path / "s.sock")]
    for option, value, message in (("--timeout", "nan", "session: --timeout: expected seconds > 0, got nan"),
                                   ("--timeout", "inf", "session: --timeout: expected seconds > 0, got inf"),
                                   ("--idle-timeout", "nan", "session: --idle-timeout: expected seconds >= 0, "
                                                             "got nan")):
        with pytest.raises(ConfigError, match=message):
            main([*base, option, value])


def test_the_server_app_and_the_command_share_one_rule_for_k_and_seconds():
    from fedreid.flower.search import check_k, check_seconds, checked_timeout

    for bad in ("2.5", 2.5, float("nan"), "ten", True, 0, 1001):
        with pytest.raises(ConfigError, match="search-k: expected"):
            SearchSettings.from_run_config({"search-vector": encode_vector(unit_rows(1, 3)[0]), "search-k": bad})
        with pytest.raises(ConfigError, match="--k: expected"):
            check_k(bad, "--k")
    assert check_k("7", "k") == 7 and check_k(1000, "k") == 1000
    for bad in ("nan", float("inf"), -1, 0, "soon", 10**400):
        with pytest.raises(ConfigError, match="--timeout: expected seconds"):
            check_seconds(bad, "--timeout")
    assert check_seconds(0, "x", zero=True) == 0.0 and check_seconds("2.5", "x") == 2.5
    with pytest.raises(ConfigError, match="search timeout: expected seconds > 0, got inf"):
        checked_timeout(float("inf"))  # what federated_search and the site links apply to a query's timeout


# ----------------------------------------------------------------------------- a real deployment


def run_tool(args, timeout):
    tool = subprocess.Popen([sys.executable, str(TOOL), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = tool.communicate(timeout=timeout)
    finally:
        if tool.poll() is None:  # timed out or interrupted: the tool stops its flwr run on SIGTERM
            tool.terminate()
            try:
                tool.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(tool.pid, signal.SIGKILL)
                tool.wait(timeout=10)
    return tool.returncode, stdout, stderr


def test_search_over_tls_and_node_auth_then_with_a_site_killed(stores, query, tmp_path):
    make_tls_files(tmp_path / "tls")
    keys = {s: make_node_key(tmp_path / "keys", s)["private"] for s in SITES}
    per_node = {s: {"gallery_store": str(stores[s].folder)} for s in SITES}
    per_node["sa"]["search_thumbnails"] = "true"
    np.save(tmp_path / "q.npy", query)
    (tmp_path / "fp.json").write_text(json.dumps(FP))
    k = 10
    with LocalDeployment(tmp_path / "dep", SITES, tls=TLSFiles.from_dir(tmp_path / "tls"), node_keys=keys,
                         per_node=per_node) as dep:
        text = search_run_config_string(encode_vector(query), k=k, fingerprint=FP, timeout=60, expect=SITES,
                                        out=tmp_path / "first.json", join_timeout=120, node_auth=True)
        rc = dep.cli.run(text, log=tmp_path / "first.log", timeout=300)
        first_log = (tmp_path / "first.log").read_text(errors="replace")
        dep.stop_process("node-sc", signal.SIGKILL)  # the site's SuperNode and its ClientApp, no goodbye
        rc2, stdout, stderr = run_tool(["search", "--superlink", dep.superlink, "--ca", tmp_path / "tls" / "ca.crt",
                                        "--feature", tmp_path / "q.npy", "--fingerprint", tmp_path / "fp.json",
                                        "--k", k, "--timeout", 45, "--join-timeout", 5, "--thumbnails", "--node-auth",
                                        "--expect", "sa", "--expect", "sb", "--expect", "sc",
                                        "--out", tmp_path / "second.json"], timeout=300)
    assert rc == 0, first_log[-3000:]
    first = json.loads((tmp_path / "first.json").read_text())
    everyone = [exact_answer(stores[s], s, query, k) for s in SITES]
    assert triples(first["results"]) == exact_merge(everyone, k)
    assert sorted(a["site"] for a in first["answered"]) == list(SITES) and first["missing"] == []
    # The names are the ones the SuperLink registered the nodes' keys under (LocalDeployment: the client names).
    assert first["authenticated"] and all(a["verified"] for a in first["answered"])
    assert "federated search: 10 results (k=10) from 3 sites" in first_log  # the ServerApp's log reaches flwr run
    # sc's SuperNode is gone: the others' results still come, and sc is reported.
    assert rc2 == 0, stdout + stderr
    second = json.loads((tmp_path / "second.json").read_text())
    assert triples(second["results"]) == exact_merge(everyone[:2], k)
    sc_node = next(a["node_id"] for a in first["answered"] if a["site"] == "sc")
    gone = {m["node_id"]: m for m in second["missing"]}
    assert gone[sc_node]["code"] in ("no-reply", "unavailable"), second["missing"]
    assert gone[None]["site"] == "sc" and str(sc_node) in gone[None]["reason"]
    assert {bool(r["thumbnail_jpeg_base64"]) for r in second["results"] if r["site"] == "sa"} == {True}
    assert {r["thumbnail_jpeg_base64"] for r in second["results"] if r["site"] == "sb"} == {None}
    assert "from 2 sites (sa, sb)" in stdout and "missing: sc: not-answered" in stdout
    assert f"missing: sc (node {sc_node})" in stdout  # under node authentication a silent node's site is known


def test_a_search_session_over_tls_and_node_auth_with_a_site_leaving_and_rejoining(stores, query, tmp_path,
                                                                                 socket_dir):
    make_tls_files(tmp_path / "tls")
    keys = {s: make_node_key(tmp_path / "keys", s)["private"] for s in SITES}
    per_node = {s: {"gallery_store": str(stores[s].folder)} for s in SITES}
    np.save(tmp_path / "q.npy", query)
    (tmp_path / "fp.json").write_text(json.dumps(FP))
    sock, k = socket_dir / "s.sock", 10
    everyone = [exact_answer(stores[s], s, query, k) for s in SITES]
    search = ["search", "--session", sock, "--feature", tmp_path / "q.npy", "--fingerprint", tmp_path / "fp.json",
              "--k", k, "--timeout", 30]
    with LocalDeployment(tmp_path / "dep", SITES, tls=TLSFiles.from_dir(tmp_path / "tls"), node_keys=keys,
                         per_node=per_node) as dep:
        session = subprocess.Popen([sys.executable, str(TOOL), "session", "--superlink", dep.superlink, "--ca",
                                    str(tmp_path / "tls" / "ca.crt"), "--node-auth", "--socket", str(sock),
                                    "--timeout", "30", *[a for s in SITES for a in ("--expect", s)]],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            SessionClient(sock).wait_ready(240, alive=lambda: session.poll() is None)
            rc1, out1, err1 = run_tool([*search, "--out", tmp_path / "first.json"], timeout=120)
            # sc leaves (its SuperNode stopped: it signs off). After a kill, Flower refuses the same key until
            # the SuperLink has marked the old connection offline (its heartbeat), so a rejoin waits for that.
            dep.stop_process("node-sc", signal.SIGTERM)
            rc2, out2, err2 = run_tool([*search, "--timeout", 10], timeout=120)
            dep.start_node("sc")  # and comes back with its key: the session picks it up, no restart
            deadline, back = time.monotonic() + 240, None
            while time.monotonic() < deadline:
                plain = SessionClient(sock).search(query, k, fingerprint=FP, timeout=10)
                if sorted(a["site"] for a in plain["answered"]) == list(SITES):
                    back = plain
                    break
                time.sleep(1.0)
        finally:
            session.send_signal(signal.SIGTERM)  # the tool closes its session (the run ends) and exits
            try:
                stdout, stderr = session.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(session.pid, signal.SIGKILL)
                stdout, stderr = session.communicate(timeout=10)
    assert rc1 == 0, out1 + err1
    first = json.loads((tmp_path / "first.json").read_text())
    assert triples(first["results"]) == exact_merge(everyone, k) and first["authenticated"]
    assert "from 3 sites (sa, sb, sc)" in out1 and "site names: authenticated" in out1
    assert rc2 == 0 and "from 2 sites (sa, sb)" in out2 and "missing: sc" in out2, out2 + err2
    assert back is not None and triples(back["results"]) == exact_merge(everyone, k)
    assert "search session open at" in stdout and "search session closed after" in stderr, stdout + stderr
    assert not sock.exists()
