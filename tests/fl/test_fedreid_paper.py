"""The FedReID paper's settings: Table 2 scenarios, reporting conventions, reference KD mode, configs.

Zhuang et al., ACM MM 2020: Sec. 4.1 / Table 2 (by camera, by identity, local
training), Sec. 4.2 / Sec. 5.2 reporting (best-3 federated, best local
training, Table 3's local model), Sec. 5.1 KD as the official code runs it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from fl_helpers import tiny_config, write_world
from torch import nn

from fedreid.config import load_config
from fedreid.data.prepared import PreparedDataset, Record, dataset_card
from fedreid.data.scenarios import build_clients, by_identity, camera_count
from fedreid.eval.metrics import evaluate
from fedreid.eval.report import format_paper_summary, local_model_summary, paper_summary, write_report
from fedreid.fl.client import PublicLoaders
from fedreid.fl.evaluation import Evaluator
from fedreid.fl.server_hooks.kd import KDHook, public_features
from fedreid.fl.state import states_equal
from fedreid.utils.seeding import derive_seed

ORIGINAL_PUBLIC_PASS = PublicLoaders.loader  # kept before any test patches it

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "fedreid"
#: Configs that are not paper settings (small CPU runs).
NOT_PAPER = {"demo_synthetic.yaml", "synthetic_fedpav.yaml", "synthetic_local.yaml"}


def reid_dataset(name: str, num_ids: int, cams: int, *, per_cam: int = 1) -> PreparedDataset:
    """A manifest-only prepared dataset (no image files): ``num_ids`` identities in ``cams`` cameras."""
    root = Path("/prepared") / name
    records = [Record(root / f"{pid}_{cam}_{k}.jpg", pid, cam, "train")
               for pid in range(1, num_ids + 1) for cam in range(cams) for k in range(per_cam)]
    records += [Record(root / "q.jpg", 9999, 0, "query"), Record(root / "g.jpg", 9999, 1, "gallery")]
    return PreparedDataset(root, records, dataset_card(records))


# --------------------------------------------------------------------------- Table 2 scenarios


def test_market_by_identity_six_clients_of_exactly_125_ids():
    market = reid_dataset("market1501", 751, 6)
    clients = by_identity(market, 6, np.random.default_rng(0), equal_groups=True)
    assert [c.num_classes for c in clients] == [125] * 6
    id_sets = [set(c.pids) for c in clients]
    assert all(not (a & b) for i, a in enumerate(id_sets) for b in id_sets[i + 1:])
    assert len(set.union(*id_sets)) == 750  # one of the 751 identities is left out
    for client in clients:  # each identity keeps all its images, from every camera
        assert len(client) == 125 * 6 and {r.camid for r in client.records} == set(range(6))


@pytest.mark.parametrize("name, ids, cams, per_client", [("market1501", 751, 6, 125), ("cuhk03np", 767, 2, 383)])
def test_table2_by_identity_configs_default_to_the_camera_count(name, ids, cams, per_client):
    cfg = load_config(CONFIGS / f"table2_{name}_by_identity.yaml")
    assert cfg.scenario.num_clients is None and cfg.scenario.equal_groups
    ds = reid_dataset(name, ids, cams)
    assert camera_count(ds) == cams
    clients = build_clients(cfg.scenario, {name: ds}, np.random.default_rng(0))
    assert [c.num_classes for c in clients] == [per_client] * cams


@pytest.mark.parametrize("name, cams", [("market1501", 6), ("cuhk03np", 2)])
def test_table2_by_camera_and_local_configs(name, cams):
    ds = reid_dataset(name, 20, cams)
    cfg = load_config(CONFIGS / f"table2_{name}_by_camera.yaml")
    clients = build_clients(cfg.scenario, {name: ds}, np.random.default_rng(0))
    assert [c.name for c in clients] == [f"{name}/cam{c}" for c in range(cams)]
    assert cfg.fl.mode == "federated" and cfg.data.datasets == [name]
    local = load_config(CONFIGS / f"table2_{name}_local.yaml")
    assert local.fl.mode == "local" and local.data.datasets == [name] and local.scenario.kind == "by_dataset"
    for c in (cfg, local):  # the paper's default setting (appendix A.1), as fedpav.yaml
        assert (c.model.backbone, c.train.batch_size, c.train.local_epochs, c.fl.rounds) == ("resnet50", 32, 1, 300)


def test_num_clients_validation_names_the_key():
    with pytest.raises(ValueError, match="scenario.num_clients: by_identity needs at least 2 clients"):
        load_config(None, ["scenario.kind=by_identity", "scenario.dataset=a", "scenario.num_clients=1"])


# --------------------------------------------------------------------------- configs


def paper_configs():
    return sorted(p for p in CONFIGS.glob("*.yaml") if p.name not in NOT_PAPER)


def test_every_fedreid_config_loads_and_paper_ones_follow_the_official_code():
    assert len(list(CONFIGS.glob("*.yaml"))) >= 20
    for path in sorted(CONFIGS.glob("*.yaml")):
        load_config(path)
    for path in paper_configs():
        cfg = load_config(path)
        text = path.read_text()
        assert "official" in cfg.eval.extra_ap, path.name
        assert cfg.train.precision == "fp32", path.name  # the official code's arithmetic, on a GPU too
        if cfg.fl.mode == "federated":
            assert cfg.fl.bn == "first", path.name
            assert re.search(r"#.*official code.*\n(?:\s*#.*\n)*\s*bn: first", text), path.name
        if cfg.fl.cdw:
            assert cfg.fl.cdw_mode == "official", path.name
            assert "optimization.py" in text, path.name
        if cfg.fl.kd:
            assert cfg.fl.kd_mode == "train", path.name
            assert "knowledge_distillation" in text, path.name
    names = {p.name for p in paper_configs()}
    assert {"fedpav_kd.yaml", "fedpav_cdw_kd.yaml", "fedpav_cdw.yaml", "local_training.yaml"} <= names
    assert {f"table2_{d}_{k}.yaml" for d in ("market1501", "cuhk03np") for k in ("by_camera", "by_identity", "local")} <= names


def test_local_epoch_configs_keep_e_times_t_at_300():
    for e in (5, 10):
        cfg = load_config(CONFIGS / f"fedpav_e{e}.yaml")
        assert cfg.train.local_epochs * cfg.fl.rounds == 300


def test_citations():
    assert "5.4" not in (ROOT / "fedreid" / "data" / "scenarios.py").read_text()
    assert "5.4" not in (CONFIGS / "by_camera_msmt17.yaml").read_text()
    fedpav = (CONFIGS / "fedpav.yaml").read_text()
    assert "Table 2" not in fedpav and "Sec. 4.2" in fedpav and "Table 4" in fedpav


# --------------------------------------------------------------------------- reporting


def rec(rnd, evals, *, mode="federated", local=None):
    out = {"round": rnd, "mode": mode, "eval": {n: {"rank1": r1, "mAP": m, "mAP_official": m - 0.01}
                                                for n, (r1, m) in evals.items()}}
    if local:
        out["local_eval"] = {c: {c: {"rank1": r1, "mAP": m}} for c, (r1, m) in local.items()}
    return out


def test_local_training_summary_picks_each_datasets_own_best_round():
    history = [
        rec(10, {"market1501": (0.80, 0.60), "viper": (0.30, 0.35)}, mode="local"),
        rec(20, {"market1501": (0.90, 0.70), "viper": (0.20, 0.25)}, mode="local"),
        rec(30, {"market1501": (0.85, 0.65), "viper": (0.25, 0.30)}, mode="local"),
    ]
    s = paper_summary(history)
    assert s["convention"] == "per_dataset"
    assert s["rounds_by_dataset"] == {"market1501": [20], "viper": [10]}
    assert s["datasets"]["market1501"]["rank1"] == pytest.approx(0.90)
    assert s["datasets"]["viper"]["rank1"] == pytest.approx(0.30) and s["datasets"]["viper"]["mAP"] == pytest.approx(0.35)
    # the joint convention would take one round for both (best mean Rank-1: round 20 with top=1)
    joint = paper_summary(history, mode="federated", top=1)
    assert joint["rounds"] == [20] and joint["datasets"]["viper"]["rank1"] == pytest.approx(0.20)
    two = paper_summary(history, local_top=2)
    assert two["rounds_by_dataset"]["viper"] == [10, 30]
    assert two["datasets"]["viper"]["rank1"] == pytest.approx(0.275)
    text = format_paper_summary(s)
    assert "Local training" in text and "market1501 20" in text and "viper 10" in text


def test_federated_summary_is_unchanged_best_three_by_big_four():
    history = [rec(r, {"market1501": (v, v), "viper": (1 - v, 0.5)}) for r, v in
               ((10, 0.5), (20, 0.9), (30, 0.7), (40, 0.8), (50, 0.1))]
    s = paper_summary(history)
    assert s["convention"] == "big_datasets" and s["selected_by"] == ["market1501"]
    assert s["rounds"] == [20, 30, 40]
    assert s["datasets"]["market1501"]["rank1"] == pytest.approx(0.8)


def test_federated_best_three_is_reported_jointly_and_per_dataset(tmp_path):
    history = [rec(r, {"market1501": (v, v), "viper": (w, 0.5)}) for r, v, w in
               ((10, 0.5, 0.9), (20, 0.9, 0.1), (30, 0.7, 0.8), (40, 0.8, 0.2), (50, 0.1, 0.7))]
    joint = paper_summary(history)
    own = paper_summary(history, selection="per_dataset")
    assert joint["rounds_by_dataset"]["viper"] == [20, 30, 40]  # market1501's best rounds
    assert own["rounds_by_dataset"] == {"market1501": [20, 30, 40], "viper": [10, 30, 50]}
    assert own["datasets"]["viper"]["rank1"] == pytest.approx(0.8)
    assert format_paper_summary(own).startswith("Per-dataset reading of Sec. 4.2")
    report = write_report(tmp_path, history).read_text()
    section = report[report.index("## Paper convention"):report.index("## Last evaluation")]
    assert section.index("Mean of the 3 evaluations") < section.index("Per-dataset reading")
    with pytest.raises(ValueError, match="selection must be"):
        paper_summary(history, selection="best")


def test_report_draws_clients_weights_traffic_and_phases(tmp_path):
    history = []
    for r in (1, 2, 3):
        record = rec(r, {"market1501": (0.2 * r, 0.1 * r)}) if r % 2 else {"round": r, "mode": "federated"}
        record.update(
            client_metrics={"a": {"train_loss": 3.0 - r}, "b": {"train_loss": 2.5 - r / 2}},
            weights={"a": 0.3 + 0.1 * r, "b": 0.7 - 0.1 * r}, weighting="cdw",
            comm={"cumulative_bytes": r * 2**21, "total_bytes": 2**21},
            time={"round": 5.0, "aggregate": 0.5, "eval": 1.0 if r % 2 else 0.0, "kd": 1.0 if r == 3 else 0.0},
            train_loss=2.0,
        )
        if r == 3:
            record["kd"] = {"kd_loss": 1.2, "kd_steps": 4, "kd_teachers": 2}
        history.append(record)
    report = write_report(tmp_path, history).read_text()
    assert (tmp_path / "curve_run.png").stat().st_size > 10_000 and "![curve_run](curve_run.png)" in report
    assert "traffic 6.0 MiB in all (2.00 MiB per round on average, 2.00 MiB in the last)" in report


def test_official_ap_next_to_standard_ap_in_the_summary():
    history = [rec(10, {"market1501": (0.8, 0.60)}), rec(20, {"market1501": (0.9, 0.70)})]
    s = paper_summary(history, top=2)
    assert s["datasets"]["market1501"]["mAP_official"] == pytest.approx(0.64)
    table = format_paper_summary(s)
    head = next(line for line in table.splitlines() if line.startswith("| dataset"))
    assert head.split("|")[1:-1] == [" dataset ", " Rank-1 ", " mAP ", " mAP (official) "]
    assert "| market1501 | 85.0 | 65.0 | 64.0 |" in table
    # a history recorded without the official AP still makes a table (no such column)
    old = [{"round": 10, "mode": "federated", "eval": {"market1501": {"rank1": 0.5, "mAP": 0.4}}}]
    assert "official" not in format_paper_summary(paper_summary(old))


def test_local_model_table_best_round_per_client(tmp_path):
    history = [
        rec(10, {"market1501": (0.7, 0.5)}, local={"market1501": (0.80, 0.60), "viper": (0.40, 0.45)}),
        rec(20, {"market1501": (0.8, 0.6)}, local={"market1501": (0.95, 0.75), "viper": (0.35, 0.40)}),
        rec(30, {"market1501": (0.9, 0.7)}, local={"market1501": (0.85, 0.65), "viper": (0.30, 0.35)}),
    ]
    s = local_model_summary(history)
    assert s["rounds_by_client"] == {"market1501": [20], "viper": [10]}
    assert s["clients"]["market1501"] == {"rank1": pytest.approx(0.95), "mAP": pytest.approx(0.75)}
    assert s["clients"]["viper"]["rank1"] == pytest.approx(0.40)
    assert local_model_summary([rec(10, {"market1501": (0.7, 0.5)})]) == {"rounds_by_client": {}, "clients": {}}
    report = write_report(tmp_path, history).read_text()
    section = report[report.index("## Local models before aggregation"):]
    assert "| market1501 (round 20) | 95.0 | 75.0 |" in section
    assert "| viper (round 10) | 40.0 | 45.0 |" in section
    # the paper-convention table shows the official AP column
    assert "mAP (official)" in report[report.index("## Paper convention"):report.index("## Last evaluation")]


def test_local_run_report_uses_the_per_dataset_convention(tmp_path):
    history = [rec(10, {"market1501": (0.9, 0.7), "viper": (0.1, 0.2)}, mode="local"),
               rec(20, {"market1501": (0.8, 0.6), "viper": (0.3, 0.4)}, mode="local")]
    report = write_report(tmp_path, history).read_text()
    assert "| market1501 | 90.0 | 70.0 | 69.0 |" in report and "| viper | 30.0 | 40.0 | 39.0 |" in report


def test_evaluator_records_the_official_ap_over_all_queries(monkeypatch):
    root = Path("/prepared/tiny")
    # query 1 and 2 have a true match in another camera, query 3 has none
    records = [Record(root / f"q{i}.jpg", pid, 0, "query") for i, pid in enumerate((1, 2, 3))]
    records += [Record(root / f"g{i}.jpg", pid, 1, "gallery") for i, pid in enumerate((1, 2, 1, 7))]
    ds = PreparedDataset(root, records, dataset_card(records))
    rng = np.random.default_rng(0)
    feats = {3: torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(3, 4)).astype(np.float32)), dim=1),
             4: torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(4, 4)).astype(np.float32)), dim=1)}
    ev = Evaluator({"tiny": ds}, height=8, width=4)
    split_features = {("tiny", "query"): feats[3], ("tiny", "gallery"): feats[4]}
    monkeypatch.setattr(ev, "split_features", lambda model, names: split_features)
    ids = ([1, 2, 3], [1, 2, 1, 7], [0, 0, 0], [1, 1, 1, 1])
    standard = evaluate(feats[3], feats[4], *ids, ap="standard")
    official = evaluate(feats[3], feats[4], *ids, ap="official")
    row = ev(nn.Identity())["tiny"]
    assert row["mAP"] == pytest.approx(standard["mAP"])
    assert row["mAP_official"] == pytest.approx(official["mAP"])
    assert row["num_queries_without_match"] == 1 and row["num_valid_queries"] == 2
    assert row["mAP_official"] < row["mAP"]  # the unmatched query counts 0 in the official AP
    # and in the official CMC: evaluate.py's loop over compute_mAP divides by all queries
    assert row["rank1_official"] == pytest.approx(official["rank1"])
    assert row["rank1_official"] == pytest.approx(row["rank1"] * 2 / 3)
    assert row["mINP"] == pytest.approx(evaluate(feats[3], feats[4], *ids, ap="standard", minp=True)["mINP"])
    no_extra = Evaluator({"tiny": ds}, height=8, width=4, extra_ap=())
    monkeypatch.setattr(no_extra, "split_features", lambda model, names: split_features)
    assert "mAP_official" not in no_extra(nn.Identity())["tiny"]
    cfg = load_config(None, [])
    assert Evaluator.from_config(cfg, {"tiny": ds}, "cpu").extra_ap == ("official",)
    cfg = load_config(None, ["eval.ap=official"])  # the form equal to eval.ap is not computed twice
    assert Evaluator.from_config(cfg, {"tiny": ds}, "cpu").extra_ap == ()


# --------------------------------------------------------------------------- KD as the reference


class Teacher(nn.Module):
    """embed = Dropout(BatchNorm(Linear(x))), like the IDE bottleneck."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def embed(self, x):
        return self.drop(self.bn(self.fc(x)))


def batches(x, size, order):
    return [{"image": x[order[i:i + size]], "index": order[i:i + size]} for i in range(0, len(order), size)]


def test_public_features_train_mode_uses_dropout_and_batch_stats_without_side_effects():
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(1))
    model = Teacher().eval()
    loader = batches(x, 4, torch.tensor([3, 0, 8, 5, 1, 2, 7, 6, 4]))  # last batch: one image
    bn_before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    rng_before = torch.get_rng_state()
    eval_feats = public_features(model, loader, 9)
    a = public_features(model, loader, 9, mode="train", seed=3)
    b = public_features(model, loader, 9, mode="train", seed=3)
    c = public_features(model, loader, 9, mode="train", seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)  # seeded dropout
    assert not torch.allclose(a[[3, 0, 8, 5]], eval_feats[[3, 0, 8, 5]], atol=1e-3)
    assert torch.allclose(a.norm(dim=1), torch.ones(9))
    # dropout zeroes about half the units of the train-mode features, none in eval mode
    assert (a[[3, 0, 8, 5, 1, 2, 7, 6]] == 0).float().mean() > 0.2 and (eval_feats != 0).all()
    assert torch.allclose(a[4], eval_feats[4])  # a one-image batch is computed in eval mode
    assert all(torch.equal(v, bn_before[k]) for k, v in model.bn.state_dict().items())  # BN stats untouched
    assert not model.training and torch.equal(torch.get_rng_state(), rng_before)
    with pytest.raises(ValueError, match="fl.kd_mode"):
        public_features(model, loader, 9, mode="test")


def test_kd_hook_sends_the_student_loader_seed_in_train_mode():
    seen = []

    def loader_fn(shuffle, seed):
        seen.append((shuffle, seed))
        return batches(torch.randn(4, 3), 2, torch.arange(4))

    hook = KDHook(loader_fn, 4, every=2, seed=5, mode="train")
    assert hook.instructions(0) == {}
    assert hook.instructions(1) == {"kd": True, "kd_seed": derive_seed(derive_seed(5, "kd", 1), "shuffle")}
    assert KDHook(loader_fn, 4, every=2, seed=5).instructions(1) == {"kd": True}  # eval mode: no seed

    class Update:
        def __init__(self):
            self.client, self.metadata = "c", {"kd_features": torch.zeros(4, 4)}

    stats = hook.after_aggregate(1, Teacher(), [Update()])
    assert stats["kd_steps"] == 2 and seen == [(True, hook.instructions(1)["kd_seed"])]
    with pytest.raises(ValueError, match="fl.kd_mode"):
        KDHook(loader_fn, 4, mode="teacher")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"))


def kd_round(world, tmp_path, mode, monkeypatch):
    """One KD round on the tiny world; returns the clients' updates and every public-set pass read."""
    from fedreid.fl.simulation import run_simulation

    built = []
    original = ORIGINAL_PUBLIC_PASS  # not the attribute: an earlier call's patch may still be in place

    def recording(self, shuffle, seed=0):
        built.append((shuffle, seed, [(b["index"].clone(), b["image"].clone()) for b in original(self, shuffle, seed)]))
        return original(self, shuffle, seed)  # the same seed again: the same batches

    monkeypatch.setattr(PublicLoaders, "loader", recording)
    cfg = tiny_config(world, ["fl.rounds=1", "fl.kd=true", "fl.kd_every=1", f"fl.kd_mode={mode}",
                              "eval.local_models=false", "train.batch_size=4"])
    updates = []
    history = run_simulation(cfg, tmp_path / mode, progress=False,
                             callbacks=[lambda ev, info: ev == "client_end" and updates.append(info["update"])])
    assert history[0]["kd"]["kd_teachers"] == 2
    return updates, built


def test_kd_train_mode_end_to_end(world, tmp_path, monkeypatch):
    train_updates, train_loaders = kd_round(world, tmp_path, "train", monkeypatch)
    eval_updates, eval_loaders = kd_round(world, tmp_path, "eval", monkeypatch)
    # train mode: every client's teacher loader and the student's are the same shuffled,
    # augmented batches (one seed); eval mode: clients in dataset order, test transform
    assert len(train_loaders) == 3 and all(shuffle for shuffle, _, _ in train_loaders)
    assert len({seed for _, seed, _ in train_loaders}) == 1
    first = train_loaders[0][2]
    for _, _, other in train_loaders[1:]:
        assert all(torch.equal(i, j) and torch.equal(a, b) for (i, a), (j, b) in zip(first, other))
    assert [shuffle for shuffle, _, _ in eval_loaders] == [False, False, True]
    eval_images = {int(i): img for idx, imgs in eval_loaders[0][2] for i, img in zip(idx, imgs)}
    train_images = {int(i): img for idx, imgs in first for i, img in zip(idx, imgs)}
    assert any(not torch.allclose(train_images[k], eval_images[k]) for k in eval_images)  # augmented
    # the teachers' features differ, the trained models (BN statistics included) do not
    for tu, eu in zip(train_updates, eval_updates):
        assert tu.client == eu.client
        assert not torch.allclose(tu.metadata["kd_features"], eu.metadata["kd_features"], atol=1e-4)
        assert states_equal(tu.state, eu.state)


def test_eval_before_hooks_records_the_aggregate_kd_then_trains(world, tmp_path, monkeypatch):
    """``eval.before_hooks``: the official main.py:train tests before and after knowledge_distillation."""
    from fl_helpers import strip_time

    from fedreid.fl.simulation import run_simulation

    real = Evaluator.__call__

    def with_weights(self, model, names=None):  # the metrics, and which weights they were measured on
        out = real(self, model, names)
        out["weights"] = {"sum": float(sum(p.detach().double().sum() for p in model.parameters()))}
        return out

    monkeypatch.setattr(Evaluator, "__call__", with_weights)
    common = ["fl.rounds=2", "fl.kd_every=2", "eval.every=1", "eval.local_models=false"]
    plain = run_simulation(tiny_config(world, common), tmp_path / "nokd", progress=False)
    after = run_simulation(tiny_config(world, [*common, "fl.kd=true"]), tmp_path / "kd", progress=False)
    both = run_simulation(tiny_config(world, [*common, "fl.kd=true", "eval.before_hooks=true"]),
                          tmp_path / "both", progress=False)
    assert "eval_before_hooks" not in both[0]  # round 1 distils nothing: one evaluation
    before = both[1].pop("eval_before_hooks")
    assert "eval_before_hooks" in both[1]["time"]
    # the extra evaluation changes nothing else; it sees the average KD starts from
    assert strip_time(both) == strip_time(after)
    assert before == plain[1]["eval"] and before["weights"] != after[1]["eval"]["weights"]
    both[1]["eval_before_hooks"] = before
    for record in both:  # the report of the real metrics only
        for key in ("eval", "eval_before_hooks"):
            record.get(key, {}).pop("weights", None)
    report = write_report(tmp_path / "both", both).read_text()
    assert "## Before the server hooks (round 2)" in report
    # which hooks train the global model, and when
    from fedreid.fl.server_hooks.feddf import FedDFHook
    from fedreid.fl.server_hooks.fedgen import FedGenHook

    kd = KDHook(lambda **kw: None, 4, every=2)
    assert [kd.trains_model(r) for r in range(4)] == [False, True, False, True]
    assert FedDFHook().trains_model(0) and not FedGenHook().trains_model(0)


def test_client_in_train_mode_needs_the_round_seed(world):
    from fedreid.fl.client import ClientError
    from fedreid.fl.federation import build_federation

    fed = build_federation(tiny_config(world, ["fl.kd=true", "fl.kd_mode=train"]))
    with pytest.raises(ClientError, match="kd_seed"):
        fed.clients[0].public_loader(None)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_fedreid_config_runs_one_round_on_tiny_data(path, tmp_path):
    """Each shipped config's own settings (scenario, bn, CDW/KD modes, AP forms), on substituted small data.

    The paper's datasets are two tiny prepared sets (``dsa``, 2 cameras; ``dsb``) and the public
    set ``pub``; ResNet-50 at 256x128 becomes timm's ``test_resnet`` at 32x16, one round.
    """
    from fl_helpers import write_prepared

    from fedreid.fl.simulation import run_simulation

    root = tmp_path / "prepared"
    write_prepared(root, "dsa", num_ids=4, cams=2, per_cam=2, seed=0)
    write_prepared(root, "dsb", num_ids=3, cams=2, per_cam=2, seed=1)
    write_prepared(root, "pub", num_ids=3, cams=1, per_cam=2, seed=7)
    cfg = load_config(path)
    overrides = [
        f"data.prepared_root={root}", "model.backbone=test_resnet", "model.pretrained=null",
        "model.bottleneck_dim=16", "model.height=32", "model.width=16", "train.batch_size=4",
        "fl.rounds=1", "fl.kd_every=1", "fl.kd_batch_size=4", "eval.every=1", "eval.batch_size=8",
        "run.device=cpu", "run.tensorboard=false", f"run.out_dir={tmp_path / 'run'}",
    ]
    if cfg.scenario.kind == "by_dataset":
        overrides.append("data.datasets=[dsa,dsb]")
    elif cfg.scenario.kind == "leave_one_out":  # dsa trains, the unseen dsb is evaluated
        overrides += ["data.datasets=[dsa,dsb]", "scenario.target=dsb"]
    else:  # the split dataset becomes dsa (4 identities over its 2 cameras)
        overrides += ["data.datasets=[dsa]", "scenario.dataset=dsa"]
    if cfg.data.public_dataset or cfg.fl.kd:
        overrides.append("data.public_dataset=pub")
    cfg = load_config(path, overrides)
    history = run_simulation(cfg, tmp_path / "run", progress=False)
    record = history[-1]
    assert record["round"] == 1 and record["eval"]
    if cfg.scenario.kind == "leave_one_out":
        assert list(record["eval"]) == ["dsb"] and record["clients"] == ["dsa"]
    metrics = next(iter(record["eval"].values()))
    assert 0 <= metrics["rank1"] <= 1 and 0 <= metrics["mAP"] <= 1
    if "official" in cfg.eval.extra_ap and cfg.eval.ap != "official":
        assert "mAP_official" in metrics
    if cfg.fl.mode == "federated":
        assert record["weighting"] == ("cdw" if cfg.fl.cdw else "size")
        assert ("kd" in record) == cfg.fl.kd


def batches_of(loader):
    return [(b["index"].clone(), b["image"].clone()) for b in loader]


def same_batches(first, second):
    return len(first) == len(second) > 1 and all(
        torch.equal(i, j) and torch.equal(a, b) for (i, a), (j, b) in zip(first, second))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_public_loaders_keep_their_workers_and_give_a_fresh_loaders_batches(world, mode):
    from fedreid.data.datasets import ReIDImageDataset, make_loader
    from fedreid.data.transforms import build_test_transform, build_train_transform
    from fedreid.fl.federation import build_federation

    cfg = tiny_config(world, ["fl.kd=true", f"fl.kd_mode={mode}", "train.workers=2", "fl.kd_batch_size=4"])
    fed = build_federation(cfg)
    client = fed.clients[0]
    (kd,) = [hook for hook in fed.server.hooks if hook.name == "kd"]
    if mode == "train":
        transform = build_train_transform(cfg.model.height, cfg.model.width, seed=0)
    else:
        transform = build_test_transform(cfg.model.height, cfg.model.width)

    def fresh(shuffle, seed):  # what a loader built anew for this KD round gives
        dataset = ReIDImageDataset(client.public_records, None, transform=transform)
        return batches_of(make_loader(dataset, 4, shuffle=shuffle, seed=seed, num_workers=2))

    client_seed = 11 if mode == "train" else None
    first = client.public_loader(client_seed)
    client_batches = batches_of(first)
    workers = [w.pid for w in first._iterator._workers]
    assert same_batches(client_batches, fresh(mode == "train", client_seed or 0))
    # the next KD rounds: the same workers; a new seed gives a fresh loader's batches for it
    if mode == "train":
        assert same_batches(batches_of(client.public_loader(12)), fresh(True, 12))
        assert not same_batches(batches_of(client.public_loader(12)), client_batches)
    again = client.public_loader(client_seed)
    assert same_batches(batches_of(again), client_batches)
    assert [w.pid for w in again._iterator._workers] == workers
    student = kd.public_loader_fn(shuffle=True, seed=5)
    assert same_batches(batches_of(student), fresh(True, 5))
    student_workers = [w.pid for w in student._iterator._workers]
    assert same_batches(batches_of(kd.public_loader_fn(shuffle=True, seed=7)), fresh(True, 7))
    assert [w.pid for w in kd.public_loader_fn(shuffle=True, seed=7)._iterator._workers] == student_workers
