"""Aggregation math against hand-computed examples."""

from collections import OrderedDict

import pytest
import torch

from fedreid.fl.aggregate import aggregate, cdw_weights, size_weights
from fedreid.fl.state import (
    StateError,
    clone_state,
    split_state,
    state_nbytes,
    states_equal,
    weighted_average,
)
from fedreid.fl.update import PrivateStateError, Update, check_no_private


def st(w, mean, var, nbt):
    return OrderedDict(
        [
            ("backbone.w", torch.tensor(w, dtype=torch.float32)),
            ("bottleneck.1.running_mean", torch.tensor(mean, dtype=torch.float32)),
            ("bottleneck.1.running_var", torch.tensor(var, dtype=torch.float32)),
            ("bottleneck.1.num_batches_tracked", torch.tensor(nbt, dtype=torch.long)),
        ]
    )


A = st([1.0, 2.0], [0.0, 4.0], [1.0, 1.0], 7)
B = st([4.0, 8.0], [3.0, 1.0], [4.0, 2.0], 9)


def test_size_weights_fedpav():
    # n = (10, 30) -> w = (0.25, 0.75)
    out = weighted_average([A, B], [10, 30])
    assert torch.allclose(out["backbone.w"], torch.tensor([0.25 * 1 + 0.75 * 4, 0.25 * 2 + 0.75 * 8]))
    assert torch.allclose(out["bottleneck.1.running_mean"], torch.tensor([2.25, 1.75]))
    assert torch.allclose(out["bottleneck.1.running_var"], torch.tensor([3.25, 1.75]))
    assert out["bottleneck.1.num_batches_tracked"].item() == 9  # max
    assert out["bottleneck.1.num_batches_tracked"].dtype == torch.long
    assert out["backbone.w"].dtype == torch.float32


def test_weights_scale_free_and_order_kept():
    a = weighted_average([A, B], [1, 3])
    b = weighted_average([A, B], [0.25, 0.75])
    assert states_equal(a, b)
    assert list(a) == list(A)


def test_bn_first_copies_first_client_buffers():
    out = weighted_average([B, A], [10, 30], bn="first")
    assert torch.allclose(out["backbone.w"], torch.tensor([0.25 * 4 + 0.75 * 1, 0.25 * 8 + 0.75 * 2]))
    assert torch.equal(out["bottleneck.1.running_mean"], B["bottleneck.1.running_mean"])
    assert torch.equal(out["bottleneck.1.running_var"], B["bottleneck.1.running_var"])
    assert out["bottleneck.1.num_batches_tracked"].item() == 9


def test_bn_local_server_average():
    out = weighted_average([A, B], [1, 1], bn="local")
    assert torch.allclose(out["bottleneck.1.running_mean"], torch.tensor([1.5, 2.5]))


def test_bad_inputs_raise():
    with pytest.raises(StateError, match="policy"):
        weighted_average([A], [1], bn="median")
    with pytest.raises(StateError, match="sum to 0"):
        weighted_average([A, B], [0, 0])
    with pytest.raises(StateError, match=">= 0"):
        weighted_average([A, B], [1, -1])
    C = clone_state(B)
    C["backbone.w"] = torch.zeros(3)
    with pytest.raises(StateError, match=r"backbone.w: shape \(3,\)"):
        weighted_average([A, C], [1, 1])
    D = clone_state(B)
    del D["backbone.w"]
    with pytest.raises(StateError, match="missing backbone.w"):
        weighted_average([A, D], [1, 1])


def test_split_and_bytes():
    full = OrderedDict(A)
    full["classifier.weight"] = torch.zeros(5, 2)
    full["classifier.bias"] = torch.zeros(5)
    shared, private = split_state(full, ("classifier.",))
    assert list(private) == ["classifier.weight", "classifier.bias"]
    assert list(shared) == list(A)
    # 3 float tensors of 2 x 4 bytes + one int64
    assert state_nbytes(shared) == 3 * 2 * 4 + 8


def test_update_guard():
    full = clone_state(A)
    full["classifier.weight"] = torch.zeros(5, 2)
    with pytest.raises(PrivateStateError, match="classifier.weight"):
        Update("c0", full, 10)
    with pytest.raises(PrivateStateError):
        check_no_private({"classifier.bias": torch.zeros(1)}, client="x")
    u = Update("c0", clone_state(A), 10, {"train_loss": 1.0, "kd_features": torch.zeros(3, 2)})
    assert u.nbytes == state_nbytes(A) and u.metadata_nbytes == 24
    assert u.scalars() == {"train_loss": 1.0}
    with pytest.raises(ValueError, match="num_samples"):
        Update("c0", clone_state(A), 0)


def test_aggregate_size_and_cdw():
    ua = Update("a", clone_state(A), 10, {"cdw_distance": 0.3})
    ub = Update("b", clone_state(B), 30, {"cdw_distance": 0.1})
    assert size_weights([ua, ub]) == [0.25, 0.75]
    agg = aggregate([ua, ub])
    assert agg.weighting == "size" and agg.weights == [0.25, 0.75] and agg.clients == ["a", "b"]
    agg = aggregate([ua, ub], cdw=True)
    assert agg.weighting == "cdw"
    assert agg.weights == pytest.approx([0.75, 0.25])
    assert torch.allclose(agg.state["backbone.w"], torch.tensor([0.75 * 1 + 0.25 * 4, 0.75 * 2 + 0.25 * 8]))
    assert cdw_weights([1.0, 3.0]) == [0.25, 0.75]
    # all distances 0 -> size weights, with a note
    u0 = Update("a", clone_state(A), 10, {"cdw_distance": 0.0})
    u1 = Update("b", clone_state(B), 30, {"cdw_distance": 0.0})
    agg = aggregate([u0, u1], cdw=True)
    assert agg.weighting == "size" and agg.note
    with pytest.raises(ValueError, match="cdw_distance"):
        aggregate([Update("a", clone_state(A), 1)], cdw=True)
