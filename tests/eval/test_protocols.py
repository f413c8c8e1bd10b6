"""Evaluation protocols as a registry, and the public ranking kernel's tie rule and top-k."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pytest

from fedreid.eval import protocols, ranking
from fedreid.eval.metrics import evaluate
from fedreid.inference.dataset_features import DatasetFeatures
from fedreid.inference.errors import EvalInputError
from fedreid.inference.features import FeatureSet

# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------


def test_registry_lists_the_built_in_protocols():
    assert protocols.EVAL_PROTOCOLS.keys() == ["standard", "cuhk03"]
    assert protocols.PROTOCOLS == ("standard", "cuhk03")
    assert protocols.EVAL_PROTOCOLS["standard"] is protocols.StandardProtocol
    assert protocols.EVAL_PROTOCOLS["cuhk03"] is protocols.Cuhk03Protocol
    assert all(issubclass(cls, protocols.EvalProtocol) for cls in protocols.EVAL_PROTOCOLS.values())
    assert protocols.protocol_help() == "standard (default) or cuhk03: single-gallery-shot CMC, 10 seeded samplings"


def test_unknown_protocol_and_refused_options_keep_their_messages():
    with pytest.raises(EvalInputError, match=r"^unknown protocol 'cuhk3': expected one of standard, cuhk03$"):
        protocols.evaluate_dataset(_features(), protocol="cuhk3")
    with pytest.raises(EvalInputError, match="--rerank is not available with --protocol cuhk03"):
        protocols.evaluate_dataset(_features(), protocol="cuhk03", rerank=True)
    with pytest.raises(EvalInputError, match="reports the standard AP .* not --ap official"):
        protocols.evaluate_dataset(_features(), protocol="cuhk03", ap="official")


def test_protocol_options_are_built_and_checked():
    assert protocols.build_protocol("cuhk03").options.num_repeats == protocols.CUHK03_REPEATS
    assert protocols.build_protocol("cuhk03", {"num_repeats": 3}).options.num_repeats == 3
    with pytest.raises(EvalInputError, match="num_repeats: expected >= 1"):
        protocols.build_protocol("cuhk03", {"num_repeats": 0})
    with pytest.raises(EvalInputError, match="unknown protocol"):
        protocols.build_protocol("nope")


def _features(seed: int = 0) -> DatasetFeatures:
    """A small dataset: 4 identities, 2 cameras, 6 queries and 16 gallery items, L2-normalised."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((4, 8))

    def part(pids, camids):
        x = centres[pids] + 0.6 * rng.standard_normal((len(pids), 8))
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        return FeatureSet(x, np.asarray(pids), np.asarray(camids), [f"{i}.jpg" for i in range(len(pids))])

    q_pids = [0, 1, 2, 3, 0, 1]
    g_pids = [p for p in range(4) for _ in range(4)]
    return DatasetFeatures("tiny", part(q_pids, [0] * 6), part(g_pids, [0, 1] * 8), source="test")


@pytest.mark.parametrize("split,field,word", [("gallery", "paths", "paths"), ("query", "paths", "paths"),
                                                ("query", "pids", "ids"), ("gallery", "camids", "cameras")])
def test_ids_cameras_and_paths_need_one_entry_per_feature_row(split, field, word):
    from fedreid.errors import EvalDataError

    feats = _features()
    part = getattr(feats, split)
    rows = part.features.shape[0]
    short = dataclasses.replace(feats, **{split: part._replace(**{field: getattr(part, field)[:1]})})
    with pytest.raises(EvalDataError, match=rf"^dataset 'tiny' \(test\): {split}: {rows} feature rows but 1 {word}"):
        protocols.evaluate_dataset(short)


@dataclass
class MinpOptions:
    """Options of the test's ``minp`` protocol."""

    #: Added to ``results.json``.
    label: str = "with mINP"


class MinpProtocol(protocols.EvalProtocol):
    """Standard CMC/mAP plus mINP: a protocol registered by a test only."""

    name = "minp"
    Options = MinpOptions
    title = "CMC (with mINP)"
    help = "standard CMC/mAP plus mINP"

    def evaluate(self, feats, *, ap, rerank, seed, ranks, max_block_bytes):
        q, g = feats.query, feats.gallery
        result = evaluate(q.features, g.features, q.pids, g.pids, q.camids, g.camids, ap=ap, ranks=ranks,
                          minp=True, return_per_query=True, max_block_bytes=max_block_bytes)
        return result, None

    def report_fields(self, seed):
        return {"label": self.options.label}


@pytest.fixture
def with_minp(monkeypatch):
    registry = protocols.EVAL_PROTOCOLS.copy()
    registry.register(MinpProtocol)
    monkeypatch.setattr(protocols, "EVAL_PROTOCOLS", registry)
    return registry


def test_a_registered_protocol_is_usable_by_the_evaluation(with_minp, tmp_path):
    from fedreid.commands.eval_reid import build_parser
    from fedreid.eval.pipeline import evaluate_and_report
    from fedreid.eval.protocols import PROTOCOLS

    assert "minp" not in PROTOCOLS  # the built-ins; the copy is what the evaluation consults
    feats = _features()
    result, reranked = protocols.evaluate_dataset(feats, protocol="minp")
    q, g = feats.query, feats.gallery
    expected = evaluate(q.features, g.features, q.pids, g.pids, q.camids, g.camids, minp=True,
                        ranks=range(1, protocols.CMC_RANKS + 1))
    assert reranked is None and result["protocol"] == "minp"
    assert result["mINP"] == pytest.approx(expected["mINP"], abs=1e-6)
    assert result["rank1"] == pytest.approx(expected["rank1"], abs=1e-6)
    assert result["num_gallery"] == 16

    report = evaluate_and_report([feats], tmp_path / "eval", protocol="minp", pictures=0)
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["protocol"] == saved["protocol"] == "minp" and saved["label"] == "with mINP"
    assert saved["datasets"]["tiny"]["mAP"] == pytest.approx(expected["mAP"], abs=1e-6)
    with pytest.raises(EvalInputError, match="--rerank is not available with --protocol minp"):
        evaluate_and_report([feats], tmp_path / "eval2", protocol="minp", rerank=True, pictures=0)

    args = build_parser().parse_args(["evaluate", "--features", "f.npz", "--protocol", "minp"])
    assert args.protocol == "minp"
    assert "minp: standard CMC/mAP plus mINP" in protocols.protocol_help()


def test_the_registered_protocol_is_gone_outside_the_test():
    assert "minp" not in protocols.EVAL_PROTOCOLS


# --------------------------------------------------------------------------
# ranking.py: the tie rule and top-k, as before the split
# --------------------------------------------------------------------------

# One row with ties inside the top-k and across its boundary; the expected
# orders are those of the previous private metrics._top_k_rows (stable
# descending sort: among equal scores the lower index first). -0.0 == 0.0.
TIE_ROW = np.array([0.5, 0.9, 0.5, 0.9, 0.1, 0.5, -0.0, 0.0, 0.9, 0.5], dtype=np.float32)
TIE_ORDER = [1, 3, 8, 0, 2, 5, 9, 4, 6, 7]


def test_ranking_order_and_top_k_follow_the_tie_rule():
    assert ranking.ranking_order(TIE_ROW).tolist() == TIE_ORDER
    block = np.stack([TIE_ROW, TIE_ROW[::-1].copy()])
    reversed_order = np.argsort(-TIE_ROW[::-1], kind="stable").tolist()
    for k in (1, 2, 3, 4, 5, 6, 7, 10, 12):
        scores, idx = ranking.top_k_rows(block.copy(), k)
        kk = min(k, TIE_ROW.size)
        assert idx.dtype == np.int64 and idx.shape == (2, kk)
        assert idx[0].tolist() == TIE_ORDER[:kk], k
        assert idx[1].tolist() == reversed_order[:kk], k
        np.testing.assert_array_equal(scores[0], TIE_ROW[TIE_ORDER[:kk]])


def test_order_by_rule_sorts_gathered_candidates():
    scores = np.array([[0.5, 0.9, 0.5, 0.9]], dtype=np.float32)
    indices = np.array([[7, 4, 2, 9]])
    s, i = ranking.order_by_rule(scores, indices)
    assert i.tolist() == [[4, 9, 2, 7]]
    np.testing.assert_array_equal(s, scores[:, [1, 3, 0, 2]])


def _tie_case():
    """One query against TIE_ROW as 1-D features; identity 1 at gallery 0, 3, 7 (7 in the query's camera)."""
    qf = np.ones((1, 1), np.float32)
    gf = TIE_ROW[:, None].copy()
    g_pids = np.array([1, 2, 3, 1, 4, 5, 6, 1, -1, 2])
    g_camids = np.array([1, 1, 1, 1, 1, 1, 1, 0, 1, 1])
    return qf, gf, np.array([1]), g_pids, np.array([0]), g_camids


def test_match_ranks_follow_the_tie_rule():
    qf, gf, q_pids, g_pids, q_camids, g_camids = _tie_case()
    index = ranking.build_match_index(q_pids, g_pids, q_camids, g_camids)
    assert index.good_cols.tolist() == [0, 3] and index.removed_cols.tolist() == [7]
    assert index.junk_cols.tolist() == [8]
    ranks = ranking.match_ranks(ranking.score_blocks(qf, gf), index)
    # Kept items in rule order: 1, 3, 0, 2, 5, 9, 4, 6 (8 is junk, 7 removed): matches 3 and 0 at ranks 2, 3.
    assert ranks.tolist() == [2, 3]


@pytest.mark.gpu
def test_torch_path_on_cuda_follows_the_tie_rule():
    import torch

    qf, gf, q_pids, g_pids, q_camids, g_camids = _tie_case()
    index = ranking.build_match_index(q_pids, g_pids, q_camids, g_camids)
    q, g = (torch.from_numpy(x).cuda() for x in (qf, gf))
    per_query = ranking.torch_per_query_metrics(q, g, index, 1, lambda i, r: i / r)
    assert per_query["first_match_rank"].tolist() == [2]
    assert per_query["ap"].tolist() == pytest.approx([(1 / 2 + 2 / 3) / 2])
    r = evaluate(q, g, q_pids, g_pids, q_camids, g_camids)
    assert r["backend"] == "torch" and r["rank1"] == 0.0 and r["rank5"] == 1.0
