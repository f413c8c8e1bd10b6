"""Per-round metrics: ``metrics.jsonl``, ``metrics.csv``, optional TensorBoard.

``metrics.jsonl`` holds one JSON object per round (nested: per-client
losses, aggregation weights, bytes, times, evaluation results).
``metrics.csv`` is the same rows flattened (``eval.market1501.rank1``); its
columns are the union over rounds, so it is rewritten whole after each round
(small: one line per round). TensorBoard scalars are written when the
``tensorboard`` package is installed (the ``[tensorboard]`` extra) and
``tensorboard`` is on; otherwise only the two files. Beside every number of
the record (``eval/market1501/rank1``...) TensorBoard gets the mean Rank-1
and mAP over the evaluated datasets (``eval_mean/rank1``, ``eval_mean/mAP``),
a custom-scalars layout that draws every client's loss and aggregation
weight in one chart each, and, at the end (:meth:`MetricsLogger.log_hparams`),
the run's config beside its final metrics in the HParams tab; evaluating
the run with ``tools/eval_reid.py evaluate`` adds its ranked lists and CMC
plot as images (:func:`add_pictures`).

On resume, :meth:`MetricsLogger.reset` rewrites both files from the
checkpoint's history, dropping rows of a round that was logged but never
checkpointed.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedreid.utils.io import write_text_atomic

METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"


def flatten(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become JSON strings."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _clean(value: Any) -> Any:
    """NaN/inf as None (valid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsLogger:
    """Writes round records under ``run_dir``."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.tensorboard = tensorboard
        self._tb = None
        self._tb_opened = False

    def _open_tensorboard(self, purge_step: int | None) -> None:
        """(Re)open the event writer; ``purge_step`` hides events a resumed run redoes."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_opened = True
        if not self.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard not installed: the jsonl/csv logs are enough
            return
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
        # one chart per quantity with a line per client (regexes over the scalar tags)
        self._tb.add_custom_scalars({
            "clients": {
                "training loss": ["Multiline", [r"client_metrics/[^/]+/train_loss"]],
                "aggregation weight": ["Multiline", [r"weights/[^/]+"]],
                "CDW distance": ["Multiline", [r"client_metrics/[^/]+/cdw_distance"]],
            },
            "evaluation": {
                "Rank-1": ["Multiline", [r"eval/[^/]+/rank1", r"eval_mean/rank1"]],
                "mAP": ["Multiline", [r"eval/[^/]+/mAP", r"eval_mean/mAP"]],
            },
        })

    @property
    def jsonl_path(self) -> Path:
        return self.run_dir / METRICS_JSONL

    @property
    def csv_path(self) -> Path:
        return self.run_dir / METRICS_CSV

    def reset(self, history: Sequence[Mapping[str, Any]] = ()) -> None:
        """Rewrite the files to hold exactly ``history``.

        TensorBoard events cannot be rewritten; instead the writer purges every
        event after the last round of ``history``, so rounds logged by a run
        that was killed before their checkpoint do not show twice.
        """
        self.rows = [dict(r) for r in history]
        self._open_tensorboard(purge_step=self._step(self.rows[-1]) + 1 if self.rows else None)
        text = "".join(json.dumps(_clean(r), default=_json_default) + "\n" for r in self.rows)
        write_text_atomic(self.jsonl_path, text)
        self._write_csv()

    @staticmethod
    def _step(row: Mapping[str, Any]) -> int:
        return int(row["round"])

    def log(self, row: Mapping[str, Any]) -> None:
        row = dict(row)
        self.rows.append(row)
        if not self._tb_opened:
            self._open_tensorboard(purge_step=None)
        with self.jsonl_path.open("a") as fh:
            fh.write(json.dumps(_clean(row), default=_json_default) + "\n")
        self._write_csv()
        if self._tb is not None:
            step = self._step(row)
            for key, value in flatten(row).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "round":
                    self._tb.add_scalar(key.replace(".", "/"), value, step)
            evaluated = [v for v in (row.get("eval") or {}).values() if isinstance(v, Mapping)]
            for metric in ("rank1", "mAP"):
                values = [v[metric] for v in evaluated if isinstance(v.get(metric), (int, float))]
                if values:
                    self._tb.add_scalar(f"eval_mean/{metric}", sum(values) / len(values), step)
            self._tb.flush()

    def log_hparams(self, config: Mapping[str, Any], final: Mapping[str, float]) -> None:
        """The run's config (flattened; lists as text) beside its ``final`` metrics, for TensorBoard's HParams."""
        if self._tb is None:
            return
        hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                   for k, v in flatten(dict(config)).items()}
        self._tb.add_hparams(hparams, {f"final/{k}": float(v) for k, v in final.items()}, run_name="hparams")
        self._tb.flush()

    def _write_csv(self) -> None:
        flat = [flatten(r) for r in self.rows]
        columns: list[str] = []
        for row in flat:
            columns += [c for c in row if c not in columns]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in flat:
            writer.writerow({k: _clean(v) for k, v in row.items()})
        write_text_atomic(self.csv_path, buf.getvalue())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def add_pictures(run_dir: str | Path, pictures: Sequence[str | Path], step: int, prefix: str = "ranked_lists") -> int:
    """Show PNG ``pictures`` (an evaluation's ranked lists, its CMC plot) in the run's TensorBoard at ``step``.

    Only for a run that writes TensorBoard events (its ``tensorboard/``
    folder exists) and when the package is installed; returns how many
    pictures were added (tag ``<prefix>/<file stem>``).
    """
    folder = Path(run_dir) / "tensorboard"
    if not folder.is_dir() or not pictures:
        return 0
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return 0
    import numpy as np
    from PIL import Image

    writer = SummaryWriter(str(folder))
    try:
        for path in pictures:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            writer.add_image(f"{prefix}/{Path(path).stem}", pixels, step, dataformats="HWC")
    finally:
        writer.close()
    return len(pictures)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``."""
    path = Path(run_dir) / METRICS_JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["MetricsLogger", "flatten", "read_metrics"]
