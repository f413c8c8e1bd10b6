"""A round split in two (begin / finish) for transports: lost clients, rejected updates, reply order."""

import copy
import math

import pytest
import torch
from fl_helpers import tiny_config, write_prepared, write_world

from fedreid.fl.federation import build_federation
from fedreid.fl.local.base import OBJECTIVE_PAYLOAD
from fedreid.fl.local.scaffold import DELTA_C_KEY
from fedreid.fl.server import RoundFailedError
from fedreid.fl.server_hooks import ServerHook
from fedreid.fl.state import state_nbytes, states_equal
from fedreid.fl.update import Update, check_update, tensor_nbytes


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
    nested = Update(update.client, update.state, update.num_samples,
                    {"deltas": [{"a": torch.zeros(2)}, {"b": torch.tensor([math.inf])}]})
    assert "'deltas' holds non-finite" in check_update(nested, ref)
    key = first_float_key(update)
    retyped = poisoned(update, key, update.state[key].to(torch.float64))
    assert check_update(retyped, ref) == f"{key} has dtype torch.float64, expected torch.float32"
    # the first poisoned key of the state's order is the one named
    floats = [k for k, v in update.state.items() if v.is_floating_point()]
    later, last = floats[len(floats) // 2], floats[-1]
    twice = poisoned(poisoned(update, last, torch.full_like(update.state[last], math.inf)),
                     later, torch.full_like(update.state[later], math.nan))
    assert check_update(twice, ref) == f"{later} holds non-finite values"


@pytest.mark.parametrize("key, value, why", [
    ("train_loss", "abc", "expected a number, got str"),
    ("cdw_distance", "abc", "expected a number, got str"),
    ("steps", True, "expected a number, got bool"),
    ("time_train", math.nan, "is nan"),
    ("local_eval", {"market": {"mAP": math.inf}}, "is inf"),
    ("note", object(), "holds a object"),
])
def test_metadata_the_server_cannot_record_leaves_that_client_out(world, key, value, why):
    # a remote client's metadata: np.mean("abc") or float("abc") in finish_round stopped the whole server
    fed = federation(world, "fl.cdw=true")
    plan = fed.server.begin_round()
    updates = train_all(fed, plan)
    bad = Update(updates[0].client, updates[0].state, updates[0].num_samples, {**updates[0].metadata, key: value})
    record = fed.server.finish_round(plan, [bad, *updates[1:]])
    assert record["clients"] == [u.client for u in updates[1:]]
    assert list(record["failed"]) == [bad.client]
    assert record["failed"][bad.client].startswith(f"update rejected: metadata {key!r}: {why}")


def test_traffic_counts_scaffold_control_variates_both_ways(world):
    # Down: the model and SCAFFOLD's server control variate c, to each sampled client; up: each client's
    # shared state and its Delta c. The paper's measure (2 x model x K) is kept on its own.
    fed = federation(world, "train.objective=scaffold")
    server = fed.server
    records = []
    for _ in range(2):
        model_bytes = state_nbytes(server.global_state)
        c_bytes = tensor_nbytes(server.hooks[0].control)  # empty before the first round
        plan = server.begin_round()
        updates = train_all(fed, plan)
        record = server.finish_round(plan, updates)
        records.append(record)
        comm, k = record["comm"], len(plan.ids)
        delta_c = sum(tensor_nbytes(u.metadata[DELTA_C_KEY]) for u in updates)
        assert delta_c > 0
        assert comm["sent"] == {"model": model_bytes * k, **({OBJECTIVE_PAYLOAD: c_bytes * k} if c_bytes else {})}
        assert comm["received"] == {"model": sum(u.nbytes for u in updates), DELTA_C_KEY: delta_c}
        assert comm["sent_bytes"] == (model_bytes + c_bytes) * k
        assert comm["received_bytes"] == sum(u.nbytes for u in updates) + delta_c
        assert comm["metadata_bytes"] == delta_c
        assert comm["total_bytes"] == comm["sent_bytes"] + comm["received_bytes"]
        assert comm["paper_bytes"] == 2 * model_bytes * k
    assert tensor_nbytes(server.hooks[0].control) > 0 and OBJECTIVE_PAYLOAD in records[1]["comm"]["sent"]
    assert records[1]["comm"]["cumulative_bytes"] == sum(r["comm"]["total_bytes"] for r in records)
    assert records[1]["comm"]["cumulative_paper_bytes"] == sum(r["comm"]["paper_bytes"] for r in records)
    assert records[1]["comm"]["cumulative_bytes"] > records[1]["comm"]["cumulative_paper_bytes"]
    # The counters survive a checkpoint.
    again = federation(world, "train.objective=scaffold").server
    again.load_state_dict(server.state_dict())
    assert (again.total_bytes, again.total_paper_bytes, again.run_id) == (
        server.total_bytes, server.total_paper_bytes, server.run_id)


def test_a_hooks_check_leaves_the_bad_update_out(world):
    # finish_round asks every hook about every update before aggregating.
    fed = federation(world, "fl.min_clients=1")

    class Picky(ServerHook):
        name = "picky"

        def instructions(self, round_index):
            return {}

        def check_update(self, round_index, update, model):
            return "wants more" if update.client == "dsb" else None

        def after_aggregate(self, round_index, model, updates):
            assert [u.client for u in updates] != [] and all(u.client != "dsb" for u in updates)
            return None

    fed.server.hooks.append(Picky())
    plan = fed.server.begin_round()
    record = fed.server.finish_round(plan, train_all(fed, plan))
    assert record["failed"] == {"dsb": "update rejected: picky: wants more"}
    assert sorted(record["clients"]) == ["dsa", "dsc"]


def test_a_broken_scaffold_delta_c_leaves_that_client_out(world):
    fed = federation(world, "train.objective=scaffold", "fl.min_clients=1")
    plan = fed.server.begin_round()
    updates = train_all(fed, plan)
    first = updates[0]
    delta = dict(first.metadata[DELTA_C_KEY])
    name = next(iter(delta))
    delta[name] = delta[name].reshape(-1)[:1]
    broken = Update(first.client, first.state, first.num_samples, {**first.metadata, DELTA_C_KEY: delta})
    dropped = Update(updates[1].client, updates[1].state, updates[1].num_samples,
                     {k: v for k, v in updates[1].metadata.items() if k != DELTA_C_KEY})
    record = fed.server.finish_round(plan, [broken, dropped, *updates[2:]])
    assert record["failed"][first.client].startswith(f"update rejected: scaffold: {DELTA_C_KEY}[{name}] has shape")
    assert record["failed"][updates[1].client] == f"update rejected: scaffold: no {DELTA_C_KEY}"
    assert record["clients"] == [u.client for u in updates[2:]]
