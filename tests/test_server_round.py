"""A round split in two (begin / finish) for transports: lost clients, rejected updates, reply order."""

import copy
import math

import pytest
import torch
from fl_helpers import tiny_config, write_prepared, write_world

from fedreid.fl.server import RoundFailedError
from fedreid.fl.simulation import build_federation
from fedreid.fl.state import states_equal
from fedreid.fl.update import Update, check_update


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = write_world(tmp_path_factory.mktemp("prepared"))
    write_prepared(root, "dsc", num_ids=3, seed=5)
    return root


def federation(world, *overrides):
    return build_federation(tiny_config(world, ["eval.every=100", *overrides], names=("dsa", "dsb", "dsc")))


def train_all(fed, plan):
    return [fed.clients[k].fit(fed.work_model, fed.server.payload_for(k), dict(plan.instructions)) for k in plan.ids]


def poisoned(update: Update, key: str, value: torch.Tensor) -> Update:
    state = dict(update.state)
    state[key] = value
    return Update(update.client, state, update.num_samples, dict(update.metadata))


def first_float_key(update: Update) -> str:
    return next(k for k, v in update.state.items() if v.is_floating_point())


def test_begin_finish_equals_run_round(world):
    a, b = federation(world), federation(world)
    rec_a = a.server.run_round(lambda k, p, ins: a.clients[k].fit(a.work_model, p, ins))
    plan = b.server.begin_round()
    updates = train_all(b, plan)
    rec_b = b.server.finish_round(plan, list(reversed(updates)))  # replies in any order
    assert rec_a["clients"] == rec_b["clients"] == [b.server.client_names[k] for k in plan.ids]
    assert states_equal(a.server.global_state, b.server.global_state)
    assert "failed" not in rec_b


def test_lost_client_round_completes_with_the_rest(world):
    fed = federation(world, "fl.min_clients=2")
    plan = fed.server.begin_round()
    updates = train_all(fed, plan)
    lost = updates.pop(1)
    record = fed.server.finish_round(plan, updates, {lost.client: "connection lost"})
    assert record["clients"] == [u.client for u in updates]
    assert record["failed"] == {lost.client: "connection lost"}
    assert lost.client not in record["weights"]
    assert record["comm"]["received_bytes"] == sum(u.nbytes for u in updates)
    assert fed.server.round == 1


def test_nan_and_wrong_shape_updates_are_rejected_not_averaged(world, caplog):
    fed = federation(world)
    plan = fed.server.begin_round()
    updates = train_all(fed, plan)
    key = first_float_key(updates[0])
    bad_nan = poisoned(updates[0], key, torch.full_like(updates[0].state[key], math.nan))
    bad_shape = poisoned(updates[1], key, torch.zeros(3, 1))
    with caplog.at_level("WARNING"):
        record = fed.server.finish_round(plan, [bad_nan, bad_shape, updates[2]])
    assert record["clients"] == [updates[2].client]
    assert "non-finite" in record["failed"][updates[0].client]
    assert "shape" in record["failed"][updates[1].client]
    assert all(bool(v.isfinite().all()) for v in fed.server.global_state.values() if v.is_floating_point())
    # With one update left, the global state is that update's state (weights 1).
    assert states_equal(fed.server.global_state, updates[2].state)
    assert updates[0].client in caplog.text and "rejected" in caplog.text


def test_too_few_updates_fail_the_round_and_change_nothing(world):
    fed = federation(world, "fl.min_clients=3")
    before = copy.deepcopy(fed.server.global_state)
    plan = fed.server.begin_round()
    updates = train_all(fed, plan)
    with pytest.raises(RoundFailedError, match="2 of 3 .*min_clients=3.*gone"):
        fed.server.finish_round(plan, updates[:2], {updates[2].client: "gone"})
    assert fed.server.round == 0
    assert states_equal(fed.server.global_state, before)


def test_check_update_names_the_problem(world):
    fed = federation(world)
    plan = fed.server.begin_round()
    update = train_all(fed, plan)[0]
    ref = fed.server.global_state
    assert check_update(update, ref) is None
    missing = Update(update.client, {k: v for k, v in update.state.items() if k != next(iter(ref))},
                     update.num_samples)
    assert "missing" in check_update(missing, ref)
    meta = Update(update.client, update.state, update.num_samples, {"cdw_distance": float("inf")})
    assert "cdw_distance" in check_update(meta, ref)
    feats = Update(update.client, update.state, update.num_samples,
                   {"kd_features": torch.tensor([[0.0, math.nan]])})
    assert "kd_features" in check_update(feats, ref)
