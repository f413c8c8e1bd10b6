"""task: classification on the same engine: partitioned digits, objectives, accuracy, resume."""

import numpy as np
import pytest
import torch

from fedreid.config import ConfigError, load_config
from fedreid.fl.classification import CLASS_COUNTS
from fedreid.fl.federation import build_classification_federation
from fedreid.fl.simulation import PARTITION_PICTURE, resume, run_simulation
from fedreid.utils.checkpoint import load_checkpoint

BASE = [
    "task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "classification.num_clients=5",
    "classification.alpha=0.5", "train.batch_size=32", "train.drop_last=false", "train.local_epochs=1",
    "train.weight_decay=0", "train.nesterov=false", "fl.rounds=3", "eval.every=1", "run.device=cpu",
    "run.tensorboard=false",
]


class Kill(RuntimeError):
    pass


def cfg_with(*extra):
    return load_config(None, BASE + list(extra))


def test_digits_train_and_test_are_disjoint():
    from fedreid.fl.classification import load_train_test

    train, test = load_train_test(cfg_with())
    seen = {image.tobytes() for image in train.images}  # the 1,797 digits images are all distinct
    assert len(train) + len(test) == 1797 and not any(image.tobytes() in seen for image in test.images)


def test_an_empty_test_split_is_refused_before_training():
    from fedreid.fl.classification import load_train_test

    with pytest.raises(ConfigError, match=r"test split is empty \(classification.test_fraction=0.002"):
        load_train_test(cfg_with("classification.test_fraction=0.002"))
    with pytest.raises(ConfigError, match=r"training split is empty \(classification.test_fraction=0.9999 holds out "
                                          r"every image\)"):
        load_train_test(cfg_with("classification.test_fraction=0.9999"))


def test_image_folders_whose_splits_name_other_classes_are_refused(tmp_path):
    import cv2

    from fedreid.fl.classification import load_train_test

    image = np.zeros((8, 8, 3), np.uint8)
    for split, classes in (("train", ("a", "b", "c")), ("test", ("a", "c"))):
        for cls in classes:
            (tmp_path / split / cls).mkdir(parents=True)
            cv2.imwrite(str(tmp_path / split / cls / "0.png"), image)
    # class "c" would be label 2 in training and label 1 in the test split
    with pytest.raises(ConfigError, match=r"test split's classes \['a', 'c'\] differ from the training split's"):
        load_train_test(cfg_with("classification.dataset=imagefolder", f"classification.root={tmp_path}"))


def test_image_folders_whose_splits_differ_in_image_size_are_refused(tmp_path):
    import cv2

    from fedreid.fl.classification import load_train_test

    for split, side in (("train", 8), ("test", 12)):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            cv2.imwrite(str(tmp_path / split / cls / "0.png"), np.zeros((side, side, 3), np.uint8))
    with pytest.raises(ConfigError, match=r"the test split's images are 12 x 12 x 3, the training split's 8 x 8 x 3"):
        load_train_test(cfg_with("classification.dataset=imagefolder", f"classification.root={tmp_path}"))


def test_fedreids_within_round_step_lr_is_refused_where_a_classification_run_would_reach_it():
    with pytest.raises(ConfigError, match=r"train.lr_step_size=40: FedReID's StepLR would cut the learning rate by "
                                          r"train.lr_gamma after epoch 40 of 50 local epochs a round"):
        cfg_with("train.local_epochs=50")
    assert cfg_with("train.local_epochs=50", "train.lr_step_size=50").train.lr_step_size == 50
    assert load_config(None, ["train.local_epochs=50"]).task == "reid"  # FedReID's own schedule


def test_the_local_training_baseline_is_refused_where_nothing_would_evaluate_it():
    # AccuracyEvaluator has no per-client test data: a local run trained and recorded losses only
    with pytest.raises(ConfigError, match=r"^fl.mode=local: the local-training baseline evaluates each client's "
                                          r"model on that client's own dataset.*set fl.mode=federated$"):
        cfg_with("fl.mode=local")


def test_a_test_fraction_for_a_dataset_with_its_own_test_split_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"^classification.test_fraction: only digits is split here; mnist is tested "
                                          r"on its own test split, so test_fraction=0.3 would be ignored$"):
        cfg_with("classification.dataset=mnist", "classification.test_fraction=0.3")
    assert cfg_with("classification.test_fraction=0.3").classification.test_fraction == 0.3  # digits


def test_a_batch_of_one_image_is_refused_for_a_batchnorm_model_only():
    from fedreid.fl.client import ClientError

    # client002 holds 289 digits: with batches of 32 its last batch is one image
    with pytest.raises(ClientError, match=r"client 'client002': .* gives 289 images a batch of one image"):
        build_classification_federation(cfg_with("model.backbone=resnet18"))
    build_classification_federation(cfg_with("model.backbone=resnet18", "train.drop_last=true"))
    build_classification_federation(cfg_with())  # cnn_lmd has no BatchNorm


def test_partitioned_clients_cover_the_training_split_once():
    fed = build_classification_federation(cfg_with())
    indices = np.concatenate([np.asarray(s.records) for s in fed.splits])
    assert len(indices) == len(np.unique(indices)) == 1438  # digits train split
    assert fed.class_counts.shape == (5, 10) and fed.class_counts.sum() == 1438
    for client, row in zip(fed.clients, fed.class_counts):
        assert client.num_classes == 10 and client.class_counts() == row.tolist()


def test_fedavg_learns_and_writes_accuracy_and_partition(tmp_path):
    hist = run_simulation(cfg_with("fl.rounds=5", "train.local_epochs=2"), tmp_path / "run", progress=False)
    acc = [r["eval"]["test"]["accuracy"] for r in hist]
    assert acc[-1] > 0.5 and acc[-1] > acc[0]  # 10 classes: chance is 0.1
    assert (tmp_path / "run" / PARTITION_PICTURE).is_file()
    assert hist[0]["comm"]["sent_bytes"] == hist[0]["comm"]["received_bytes"] > 0


@pytest.mark.parametrize("objective", ["scaffold", "fedlmd_tf"])
def test_resume_is_bit_identical(tmp_path, objective):
    cfg = cfg_with(f"train.objective={objective}")
    full = run_simulation(cfg, tmp_path / "full", progress=False)

    def killer(event, info):
        if event == "client_end" and info["round"] == 1 and info["client"] == "client002":
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    strip = [{k: v for k, v in r.items() if k != "time"} for r in full]
    assert [{k: v for k, v in r.items() if k != "time"} for r in again] == strip
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["server"]["global_state"]
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["server"]["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_class_counts_travel_on_request_with_bounded_noise():
    fed = build_classification_federation(cfg_with("classification.count_noise=0.1"))
    client = fed.clients[0]
    update = client.fit(fed.work_model, fed.server.global_state, {"round": 0, CLASS_COUNTS: True})
    true = np.asarray(client.class_counts(), dtype=float)
    sent = update.metadata[CLASS_COUNTS].numpy()
    assert np.all(np.abs(sent - true) <= 0.1 * true + 1e-9) and np.all(sent[true == 0] == 0)
    assert CLASS_COUNTS not in client.fit(fed.work_model, fed.server.global_state, {"round": 0}).metadata


def test_classification_config_errors():
    with pytest.raises(ConfigError, match="set fl.aggregation=fedavg"):
        load_config(None, ["task=classification"])
    with pytest.raises(ConfigError, match="fl.kd: a FedReID method"):
        load_config(None, ["task=classification", "fl.aggregation=fedavg", "fl.kd=true"])
    with pytest.raises(ConfigError, match="classification.dataset: unknown 'svhn'"):
        load_config(None, ["classification.dataset=svhn"])


def test_fedftg_on_top_of_a_client_objective_resumes_exactly(tmp_path):
    cfg = cfg_with("fl.rounds=2", "train.objective=fedprox", "fl.fedftg=true",
                   "fl.fedftg_options={iterations: 2, global_steps: 2, batch_size: 16}")
    full = run_simulation(cfg, tmp_path / "full", progress=False)
    assert all("fedftg" in r and r["fedftg"]["fedftg_md_after"] >= 0 for r in full)
    ckpt = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert "fedftg" in ckpt["server"]["hooks"]

    def killer(event, info):
        if event == "round_end" and info["round"] == 0:
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    drop_time = [{k: v for k, v in r.items() if k != "time"} for r in full]
    assert [{k: v for k, v in r.items() if k != "time"} for r in again] == drop_time
    a, b = ckpt["server"]["global_state"], load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["server"]["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="fl.fedftg_options"):
        cfg_with("fl.fedftg=true", "fl.fedftg_options={iterationz: 2}")


def test_learning_rate_decays_per_round(tmp_path):
    hist = run_simulation(cfg_with("train.lr=0.04", "train.lr_round_decay=0.5"), tmp_path / "decay", progress=False)
    for rec, expected in zip(hist, (0.04, 0.02, 0.01)):
        assert [m["lr"] for m in rec["client_metrics"].values()] == pytest.approx([expected] * 5)


def test_a_fresh_run_in_a_reused_folder_draws_its_partition_and_drops_partial_writes(tmp_path):
    """A run killed before its first checkpoint leaves a folder a new run may take: not its picture or temp files."""
    def killer(event, info):
        if event == "client_end" and info["round"] == 0:
            raise Kill()

    run = tmp_path / "run"
    with pytest.raises(Kill):
        run_simulation(cfg_with("classification.alpha=0.1"), run, progress=False, callbacks=[killer])
    stale = (run / PARTITION_PICTURE).read_bytes()
    partial = [run / ".checkpoint.pt.k1ll3d_x.tmp", run / ".metrics.jsonl.a0b1c2d3.tmp"]
    for path in partial:
        path.write_bytes(b"half a write")
    kept = run / ".notes.tmp"  # not an atomic write's name
    kept.write_text("mine")
    run_simulation(cfg_with("classification.partition=iid", "fl.rounds=1"), run, progress=False)
    clean = tmp_path / "clean"
    run_simulation(cfg_with("classification.partition=iid", "fl.rounds=1"), clean, progress=False)
    assert (run / PARTITION_PICTURE).read_bytes() != stale
    assert (run / PARTITION_PICTURE).read_bytes() == (clean / PARTITION_PICTURE).read_bytes()
    assert not any(path.exists() for path in partial) and kept.read_text() == "mine"


# ---------------------------------------------------------------- CIFAR python batches are pickles


def _python2_cifar_batch(rows: np.ndarray, labels: list[int]) -> bytes:
    """What Python 2's ``cPickle.dump(batch, f, 2)`` wrote for the release: str keys, str array data."""
    import struct

    raw = rows.tobytes()
    return (b"\x80\x02}q\x00(U\x04data"
            b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01b\x87R"
            b"(K\x01K" + bytes([rows.shape[0]]) + b"M\x00\x0c\x86cnumpy\ndtype\nU\x02u1K\x00K\x01\x87R"
            b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T" + struct.pack("<I", len(raw)) + raw
            + b"tbU\x06labels](" + b"".join(b"K" + bytes([k]) for k in labels) + b"eu.")


def test_cifar_pickles_read_back_exactly_under_every_protocol(tmp_path):
    import pickle

    from fedreid.data.classification import load_cifar10

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rows = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    batches = {
        "python 2": _python2_cifar_batch(rows, [3, 1, 4]),
        "big-endian Fortran labels": pickle.dumps({"data": rows, "labels": np.asfortranarray(
            np.array([[3], [1], [4]], dtype=">i4"))[:, 0]}, protocol=2),
        "numpy scalar labels": pickle.dumps({"data": rows, "labels": list(np.array([3, 1, 4]))}, protocol=2),
        **{f"protocol {p}": pickle.dumps({"data": rows, "labels": [3, 1, 4]}, protocol=p) for p in (2, 3, 4, 5)},
    }
    expected = rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    for what, payload in batches.items():
        (folder / "test_batch").write_bytes(payload)
        test = load_cifar10(tmp_path, "test")
        assert np.array_equal(test.images, expected) and test.labels.tolist() == [3, 1, 4], what


def test_a_cifar_pickle_cannot_forge_a_pointer_dtype(tmp_path):
    """numpy's dtype state from the file: an object field without reference flags holds the file's bytes
    as a pointer (reading it, e.g. str() of a class name, crashes the process or worse); refused."""
    import pickle

    from fedreid.data.classification import ClassificationDataError, load_cifar10

    forged = np.dtype([("a", "O")])
    forged.__setstate__((3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0))  # flags 0: no references
    assert not forged.hasobject

    scalar = np.float64(0).__reduce__()[0]  # numpy's multiarray.scalar, one of the globals an array needs

    class Forged:
        def __reduce__(self):
            return (scalar, (forged, b"\x41" * 8))  # an np.void whose object field points at 0x4141...

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rows = np.zeros((2, 3072), np.uint8)
    # an entry no loader step reads, so the pointer is never followed before the fix either
    (folder / "test_batch").write_bytes(pickle.dumps({"data": rows, "labels": [0, 1], "batch_label": Forged()},
                                                     protocol=2))
    raw = (folder / "test_batch").read_bytes()
    with pytest.raises(ClassificationDataError, match=r"test_batch: not a readable CIFAR python pickle "
                                                      r"\(UnpicklingError: refusing dtype 'V8'"):
        load_cifar10(tmp_path, "test")
    assert (folder / "test_batch").read_bytes() == raw  # the file is only read
