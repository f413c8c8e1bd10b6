"""Metrics logs: jsonl/csv rewritten on resume, TensorBoard events purged past the checkpoint."""

import pytest

from fedreid.utils.logging import MetricsLogger, read_metrics

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is part of the [test] extra; without it the TensorBoard path cannot run",
)


def scalars(run_dir, tag):
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_and_resume_purges_rounds_logged_after_the_checkpoint(tmp_path):
    first = MetricsLogger(tmp_path, tensorboard=True)
    first.reset([])
    for r, loss in [(1, 3.0), (2, 2.0), (3, 1.5)]:
        first.log({"round": r, "train_loss": loss, "eval": {"dsa": {"mAP": loss / 10}}})
    first.close()
    assert scalars(tmp_path, "train_loss") == [(1, 3.0), (2, 2.0), (3, 1.5)]
    assert [s for s, _ in scalars(tmp_path, "eval/dsa/mAP")] == [1, 2, 3]

    # Killed after logging rounds 2 and 3 but with only round 1 checkpointed: resume redoes 2.
    resumed = MetricsLogger(tmp_path, tensorboard=True)
    resumed.reset(read_metrics(tmp_path)[:1])
    resumed.log({"round": 2, "train_loss": 2.5})
    resumed.close()
    assert scalars(tmp_path, "train_loss") == [(1, 3.0), (2, 2.5)]
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]


def test_tensorboard_off_writes_no_events(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.reset([])
    logger.log({"round": 1, "train_loss": 1.0})
    logger.close()
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path) == [{"round": 1, "train_loss": 1.0}]


def test_tensorboard_means_client_charts_and_hparams(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.reset([])
    for r in (1, 2):
        logger.log({"round": r, "client_metrics": {"a": {"train_loss": 2.0 / r}, "b": {"train_loss": 3.0 / r}},
                    "weights": {"a": 0.4, "b": 0.6},
                    "eval": {"dsa": {"rank1": 0.2 * r, "mAP": 0.1 * r}, "dsb": {"rank1": 0.4 * r, "mAP": 0.3 * r}}})
    logger.log_hparams({"train": {"lr": 0.05, "objective": "fedavg"}, "data": {"datasets": ["dsa", "dsb"]}},
                       {"rank1": 0.6, "mAP": 0.4})
    logger.close()
    assert scalars(tmp_path, "eval_mean/rank1") == [(1, pytest.approx(0.3)), (2, pytest.approx(0.6))]
    assert [v for _, v in scalars(tmp_path, "client_metrics/b/train_loss")] == [3.0, 1.5]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "custom_scalars__config__" in acc.PluginTagToContent("custom_scalars")
    layout = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    assert b"client_metrics/[^/]+/train_loss" in layout and b"weights/[^/]+" in layout
    hparams_runs = [p for p in (tmp_path / "tensorboard").rglob("events.*") if "hparams" in str(p)]
    assert hparams_runs  # add_hparams writes its own run beside the scalars


def test_an_evaluations_pictures_show_in_the_runs_tensorboard(tmp_path):
    from PIL import Image

    from fedreid.utils.logging import add_pictures

    pictures = []
    for name, colour in (("market1501_best_q3", (0, 200, 0)), ("cmc", (200, 0, 0))):
        pictures.append(tmp_path / f"{name}.png")
        Image.new("RGB", (12, 8), colour).save(pictures[-1])
    assert add_pictures(tmp_path, pictures, 9) == 0  # a run without TensorBoard events: nothing written
    assert not (tmp_path / "tensorboard").exists()
    (tmp_path / "tensorboard").mkdir()
    assert add_pictures(tmp_path, pictures, 9) == 2
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == ["ranked_lists/cmc", "ranked_lists/market1501_best_q3"]
    image = acc.Images("ranked_lists/cmc")[0]
    assert image.step == 9 and (image.width, image.height) == (12, 8)
