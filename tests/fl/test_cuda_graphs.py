"""``train.cuda_graphs``: the backbone's forward and backward replayed as a CUDA graph."""

import copy
import pickle

import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_world

from fedreid.config import TrainConfig
from fedreid.fl.local.cuda_graphs import graph_captures, graphed_backbone
from fedreid.fl.local.sgd import train_local
from fedreid.fl.simulation import run_simulation
from fedreid.models.reid import create_reid_model
from fedreid.utils.precision import FP32, resolve_precision
from fedreid.utils.seeding import deterministic_mode, forked_torch_rng

IDS = 6


def _model():
    return create_reid_model("resnet18", IDS, pretrained=None, seed=0)


def _loader(epoch):
    """Three full batches of 8 and a partial one of 5 (drop_last off: the partial batch runs eagerly)."""
    g = torch.Generator().manual_seed(epoch)
    images = torch.randn(29, 3, 64, 32, generator=g)
    labels = torch.randint(0, IDS, (29,), generator=g)
    return [{"image": images[i:i + 8], "label": labels[i:i + 8]} for i in range(0, 29, 8)]


def _train(model, device, precision, *, graphs: bool, epochs: int = 2):
    cfg = TrainConfig(local_epochs=epochs, batch_size=8, lr=0.05, drop_last=False, cuda_graphs=graphs)
    with forked_torch_rng(0, torch.device(device)):  # the same dropout masks in the eager head
        return train_local(model, _loader, cfg, device=device, precision=precision)


def test_cuda_graphs_change_nothing_off_cuda():
    eager, graphed = _model(), _model()
    a = _train(eager, "cpu", FP32, graphs=False)
    with graphed_backbone(graphed, 8, enabled=True):
        assert "forward" not in graphed.backbone.__dict__  # a CPU backbone keeps its own forward
    b = _train(graphed, "cpu", FP32, graphs=True)
    assert a.epoch_losses == b.epoch_losses and a.accuracy == b.accuracy
    for (name, p), q in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(p, q), name
    assert graph_captures(graphed.backbone) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision_name", ["fp32", "bf16"])
def test_graphed_training_matches_eager_training_on_cuda(precision_name):
    cuda = torch.device("cuda")
    precision = resolve_precision(precision_name, cuda)
    with deterministic_mode(True):
        eager, graphed = _model(), _model()
        a = _train(eager, cuda, precision, graphs=False)
        b = _train(graphed, cuda, precision, graphs=True)
    assert graph_captures(graphed.backbone) == 1
    assert "forward" not in graphed.backbone.__dict__  # the eager forward is back after training
    assert b.steps == a.steps == 8
    # the graph replays the eager kernels; the tolerance only allows for cuDNN's choice of algorithm
    atol = 1e-4 if precision_name == "fp32" else 2e-2
    assert b.epoch_losses == pytest.approx(a.epoch_losses, abs=atol * 10)
    for (name, p), q in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if name.endswith("num_batches_tracked"):
            # capturing runs the backbone four more times; its BatchNorm counts are restored
            assert int(q) == int(p) == 8, name
        else:
            torch.testing.assert_close(q, p, rtol=1e-3 if precision_name == "fp32" else 0.05, atol=atol,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
def test_a_graph_is_reused_across_calls_and_never_copied():
    cuda = torch.device("cuda")
    precision = resolve_precision("bf16", cuda)
    model = _model().to(cuda)
    _train(model, cuda, precision, graphs=True, epochs=1)
    other = _model()
    model.load_state_dict(other.state_dict())  # a new client's payload: copied into the same tensors
    _train(model, cuda, precision, graphs=True, epochs=1)
    assert graph_captures(model.backbone) == 1
    twin = copy.deepcopy(model)
    assert graph_captures(twin.backbone) == 0
    assert graph_captures(pickle.loads(pickle.dumps(model)).backbone) == 0
    result = _train(twin, cuda, precision, graphs=True, epochs=1)
    assert graph_captures(twin.backbone) == 1 and result.steps == 4
    assert all(torch.isfinite(p).all() for p in twin.parameters())


@pytest.mark.gpu
def test_graphed_clients_in_worker_processes_equal_the_sequential_graphed_run(tmp_path):
    """Two rounds of the two-client world with CDW and KD: N=2 workers, each with its own graph, as N=1."""
    world = write_world(tmp_path / "prepared")
    common = ["run.device=cuda", "train.cuda_graphs=true", "fl.rounds=2", "fl.cdw=true", "fl.kd=true",
              "fl.kd_every=2"]
    one = run_simulation(tiny_config(world, common), tmp_path / "n1", progress=False)
    two = run_simulation(tiny_config(world, common + ["run.concurrent_clients=2"]), tmp_path / "n2",
                         progress=False)
    for record in two:
        for metrics in record["client_metrics"].values():
            metrics.pop("gpu_peak_bytes")
    assert strip_time(two) == strip_time(one)
    eager = run_simulation(tiny_config(world, common[:1] + common[2:]), tmp_path / "eager", progress=False)
    assert [r["train_loss"] for r in one] == pytest.approx([r["train_loss"] for r in eager], rel=0.05)


@pytest.mark.gpu
def test_host_state_copies_a_cuda_state_exactly_in_a_few_transfers():
    from fedreid.fl.state import clone_state, host_state

    model = _model().cuda().to(memory_format=torch.channels_last)
    state = model.state_dict()
    fast, plain = host_state(state), clone_state(state)
    assert list(fast) == list(plain)
    for key, value in plain.items():
        assert fast[key].device.type == "cpu" and fast[key].dtype == value.dtype and fast[key].is_pinned()
        assert torch.equal(fast[key], value), key
    cpu = {k: v.cpu() for k, v in state.items()}
    copied = host_state(cpu)  # a host state: clone_state's independent copies
    assert all(torch.equal(copied[k], cpu[k]) and copied[k].data_ptr() != cpu[k].data_ptr() for k in cpu)
