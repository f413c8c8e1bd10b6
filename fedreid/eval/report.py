"""A run's report: curves as in the paper's figures, and its reporting convention.

``write_report(run_dir, history)`` writes ``report.md`` beside PNG curves
(Rank-1 and mAP per dataset against the round, training loss, communication).
The FedReID paper's conventions (Zhuang et al., ACM MM 2020):

* a federated model: for each dataset, the mean of the three evaluations with
  the best mean Rank-1 over the four big datasets (MSMT17, DukeMTMC-reID,
  Market-1501, CUHK03-NP) (Sec. 4.2, "we average the performance of three
  best-federated models"; Tables 4-6, 8);
* local training (``fl.mode: local``): each dataset's own best evaluation
  (Sec. 5.2, "the best accuracy of training individual datasets"; Table 7);

:func:`paper_summary` computes either table, :func:`format_paper_summary`
writes it with its caption. FedPav's *local models* (each client's model
before aggregation on its own dataset, best over rounds: Table 3's "CDW Local
Model" column) come from the records' ``local_eval`` (:func:`local_model_summary`).
Tables show the official Rank-1 and AP (``rank1_official``, ``mAP_official``:
averaged over all queries, a query without a true match scoring 0, and the
Market-1501 trapezoid AP, as the reference's ``evaluate.py`` (its loop over ``evaluate``/``compute_mAP``))
next to the standard ones (queries without a match left out) when the run
recorded them (``eval.extra_ap``).

When ``tools/eval_reid.py evaluate`` has written ``<run>/eval/results.json``
of the run's final model, the report also shows its table, CMC plot and
ranked-list pictures (linked relative to the run folder, so they work from
anywhere and after the folder moves); a ``results.json`` of another model or
round is named as such, its numbers left out (:func:`evaluated_elsewhere`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from fedreid.utils.io import atomic_path, write_text_atomic
from fedreid.utils.plotting import agg_figure

BIG_FOUR: tuple[str, ...] = ("msmt17", "dukemtmc", "market1501", "cuhk03np")
METRICS: tuple[str, ...] = ("rank1", "rank5", "rank10", "mAP", "mINP", "rank1_official", "mAP_official",
                             "mAP_standard")
#: Column titles of :func:`format_table`.
METRIC_LABELS: dict[str, str] = {
    "rank1": "Rank-1", "rank5": "Rank-5", "rank10": "Rank-10", "mAP": "mAP", "mINP": "mINP",
    "rank1_official": "Rank-1 (official)", "mAP_official": "mAP (official)", "mAP_standard": "mAP (standard)",
}
#: Where ``tools/eval_reid.py evaluate`` writes inside a run folder by default.
EVAL_DIR = "eval"
#: The evaluation's numbers in its folder (:func:`fedreid.eval.pipeline.evaluate_and_report`).
RESULTS_FILE = "results.json"


def recorded_path(folder: str | Path, recorded: str) -> Path:
    """The file a path listed in ``folder/results.json`` names.

    ``results.json`` lists its pictures relative to ``folder``; an earlier
    fedreid listed them absolute or relative to the working directory of its
    evaluation, which is tried when the path inside ``folder`` does not exist.
    """
    path = Path(recorded)
    inside = Path(folder) / path
    if path.is_absolute() or inside.exists() or not path.exists():
        return inside  # an absolute path stays itself
    return path


def eval_rounds(history: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The round records that carry a global-model evaluation."""
    return [r for r in history if r.get("eval")]


def _mean_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The mean of each metric of :data:`METRICS` that every row has."""
    return {m: sum(row[m] for row in rows) / len(rows) for m in METRICS if all(m in row for row in rows)}


def _best(records: Sequence[Mapping[str, Any]], score, top: int) -> list[Mapping[str, Any]]:
    """The ``top`` records by descending ``score``, in round order; on ties the earlier round wins."""
    best = sorted(records, key=lambda r: -score(r))[:top]  # stable: reproducible choice
    return sorted(best, key=lambda r: r["round"])


def paper_summary(
    history: Sequence[Mapping[str, Any]],
    *,
    top: int = 3,
    big: Sequence[str] = BIG_FOUR,
    local_top: int = 1,
    mode: str | None = None,
    selection: str = "joint",
) -> dict[str, Any]:
    """The paper's summary table of a run (module docstring), by the run's ``mode``.

    ``mode`` (default: the last record's ``mode``):

    * ``federated``: mean metrics over the ``top`` evaluations with the best
      mean Rank-1 over the big datasets, the same rounds for every dataset.
      When none of the big datasets is evaluated (a small-dataset run), the
      mean Rank-1 over every evaluated dataset selects the rounds instead;
    * ``local``: each evaluated dataset (each client's own model on its own
      data) on its own: the mean over its ``local_top`` evaluations with its
      best Rank-1 (``local_top=1``: its best, as the paper's local training).

    ``selection`` (federated runs): ``joint`` (the headline) takes the same
    ``top`` rounds for every dataset, as above; ``per_dataset`` takes each
    dataset's own ``top`` evaluations by its own Rank-1. Sec. 4.2's "we
    average the performance of three best-federated models" reads either
    way; reports show both, labelled, the joint one first.

    Returns ``convention`` (``big_datasets`` or ``per_dataset``), ``rounds``
    (every round used, sorted), ``rounds_by_dataset`` ``{name: [rounds]}``,
    ``selected_by`` (the datasets whose Rank-1 chose the rounds) and
    ``datasets`` ``{name: {metric: mean}}``.
    """
    rounds = eval_rounds(history)
    if mode is None:
        mode = rounds[-1].get("mode", "federated") if rounds else "federated"
    if mode not in ("federated", "local"):
        raise ValueError(f"paper_summary: mode must be 'federated' or 'local', got {mode!r}")
    if selection not in ("joint", "per_dataset"):
        raise ValueError(f"paper_summary: selection must be 'joint' or 'per_dataset', got {selection!r}")
    per_dataset = mode == "local" or selection == "per_dataset"
    convention = "per_dataset" if per_dataset else "big_datasets"
    if not rounds:
        return {"convention": convention, "mode": mode, "rounds": [], "rounds_by_dataset": {}, "selected_by": [],
                "datasets": {}}
    names = list(dict.fromkeys(n for r in rounds for n in r["eval"]))
    table: dict[str, dict[str, float]] = {}
    chosen: dict[str, list[int]] = {}
    if per_dataset:
        selectors = names
        for name in names:
            best = _best([r for r in rounds if name in r["eval"]], lambda r: r["eval"][name]["rank1"],
                         local_top if mode == "local" else top)
            chosen[name] = [r["round"] for r in best]
            table[name] = _mean_rows([r["eval"][name] for r in best])
    else:
        selectors = [n for n in big if n in names] or names

        def score(record: Mapping[str, Any]) -> float:
            values = [record["eval"][n]["rank1"] for n in selectors if n in record["eval"]]
            return sum(values) / len(values) if values else float("-inf")

        best = _best(rounds, score, top)
        for name in names:
            rows = [r for r in best if name in r["eval"]]
            if rows:
                chosen[name] = [r["round"] for r in rows]
                table[name] = _mean_rows([r["eval"][name] for r in rows])
    used = sorted({rnd for rs in chosen.values() for rnd in rs})
    return {"convention": convention, "mode": mode, "rounds": used, "rounds_by_dataset": chosen,
            "selected_by": selectors, "datasets": table}


def format_paper_summary(summary: Mapping[str, Any]) -> str:
    """:func:`paper_summary`'s table (markdown, in %) under a one-paragraph caption."""
    if not summary["datasets"]:
        return "(no evaluation yet)\n"
    if summary.get("convention") == "per_dataset":
        tops = {len(rs) for rs in summary["rounds_by_dataset"].values()}
        what = "best evaluation" if tops == {1} else f"mean of the {max(tops)} best evaluations"
        rounds = "; ".join(f"{name} {', '.join(map(str, rs))}" for name, rs in summary["rounds_by_dataset"].items())
        if summary.get("mode", "local") == "local":
            caption = (f"Local training: each dataset's own {what} by its Rank-1 (the paper's \"best accuracy "
                       f"of training individual datasets\"), in %. Rounds: {rounds}.")
        else:
            caption = (f"Per-dataset reading of Sec. 4.2: each dataset's own {what} by its own Rank-1 "
                       f"(not the headline), in %. Rounds: {rounds}.")
    else:
        caption = (f"Mean of the {len(summary['rounds'])} evaluations (rounds "
                   f"{', '.join(map(str, summary['rounds']))}) with the best mean Rank-1 over "
                   f"{', '.join(summary['selected_by'])}, in %.")
    return caption + "\n\n" + format_table(summary["datasets"])


def local_model_summary(history: Sequence[Mapping[str, Any]], *, top: int = 1) -> dict[str, Any]:
    """FedPav's local models: each client's model before aggregation on its own dataset, best over rounds.

    Table 3's "Local Model" column (Sec. 5.2: "the model before aggregation
    that has the best accuracy for local dataset"). Reads the records'
    ``local_eval`` ``{client: {dataset: metrics}}`` (written with
    ``eval.local_models``); per client, the mean over its ``top`` evaluations
    with the best Rank-1 (``top=1``: the best; ties: the earlier round).
    Returns ``rounds_by_client`` ``{client: [rounds]}`` and ``clients``
    ``{client: {metric: mean}}``, both empty when no record has ``local_eval``.
    """
    records = [r for r in history if r.get("local_eval")]
    clients = list(dict.fromkeys(c for r in records for c in r["local_eval"]))
    table: dict[str, dict[str, float]] = {}
    chosen: dict[str, list[int]] = {}

    def own(record: Mapping[str, Any], client: str) -> Mapping[str, Any]:
        return next(iter(record["local_eval"][client].values()))  # its own dataset, the only entry

    for client in clients:
        best = _best([r for r in records if client in r["local_eval"]], lambda r: own(r, client)["rank1"], top)
        chosen[client] = [r["round"] for r in best]
        table[client] = _mean_rows([own(r, client) for r in best])
    return {"rounds_by_client": chosen, "clients": table}


def is_classification(history: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the run's evaluations are classification accuracies (``task: classification``)."""
    rounds = eval_rounds(history)
    return bool(rounds) and "accuracy" in next(iter(rounds[-1]["eval"].values()))


def classification_summary(
    history: Sequence[Mapping[str, Any]], targets: Sequence[float] = (0.5, 0.7, 0.8), split: str = "test"
) -> dict[str, Any]:
    """Best and final test accuracy, and the first round reaching each target (the papers' tables).

    A target never reached maps to ``None``. ``traffic_mib`` is the cumulative
    traffic after the last round.
    """
    rounds = [r for r in eval_rounds(history) if split in r["eval"]]
    if not rounds:
        return {}
    accs = [(r["round"], r["eval"][split]["accuracy"]) for r in rounds]
    best_round, best = max(accs, key=lambda x: (x[1], -x[0]))
    reach = {float(t): next((rnd for rnd, a in accs if a >= t), None) for t in targets}
    comm = history[-1].get("comm", {}) if history else {}
    return {
        "final_accuracy": accs[-1][1], "final_round": accs[-1][0], "best_accuracy": best,
        "best_round": best_round, "rounds_to_target": reach,
        "traffic_mib": comm.get("cumulative_bytes", 0) / 2**20,
    }


def format_classification_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a small markdown table."""
    lines = ["| metric | value |", "|---|---:|",
             f"| final accuracy (round {summary['final_round']}) | {100 * summary['final_accuracy']:.2f}% |",
             f"| best accuracy (round {summary['best_round']}) | {100 * summary['best_accuracy']:.2f}% |"]
    for target, rnd in summary["rounds_to_target"].items():
        lines.append(f"| rounds to {100 * target:.0f}% | {rnd if rnd is not None else 'not reached'} |")
    lines.append(f"| traffic | {summary['traffic_mib']:.1f} MiB |")
    return "\n".join(lines) + "\n"


def plot_curves(history: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Rank-1 and mAP per dataset vs round, loss and traffic; returns the PNG paths."""
    out_dir = Path(out_dir)
    written = []
    rounds = eval_rounds(history)
    for metric, label in (("rank1", "Rank-1"), ("mAP", "mAP"), ("accuracy", "Accuracy")):
        if not rounds or metric not in next(iter(rounds[-1]["eval"].values())):
            continue
        fig, ax = agg_figure(figsize=(6.4, 4.0))
        for name in rounds[-1]["eval"]:
            xs = [r["round"] for r in rounds if name in r["eval"]]
            ys = [100 * r["eval"][name][metric] for r in rounds if name in r["eval"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_xlabel("round")
        ax.set_ylabel(f"{label} (%)")
        ax.set_title(f"{label} of the global model")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out_dir / f"curve_{metric}.png"))
    if history:
        fig, (loss_ax, comm_ax) = agg_figure(1, 2, figsize=(9.6, 3.6))
        xs = [r["round"] for r in history]
        loss_ax.plot(xs, [r.get("train_loss", float("nan")) for r in history])
        loss_ax.set_xlabel("round")
        loss_ax.set_ylabel("mean local training loss")
        loss_ax.grid(alpha=0.3)
        comm = [r.get("comm", {}).get("cumulative_bytes", 0) / 2**20 for r in history]
        comm_ax.plot(xs, comm)
        comm_ax.set_xlabel("round")
        comm_ax.set_ylabel("cumulative traffic (MiB)")
        comm_ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "curve_training.png"))
        written.append(_plot_run_panels(history, out_dir / "curve_run.png"))
    return written


def _plot_run_panels(history: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Four panels from the round records: each client's training loss (and the server's KD loss),
    the aggregation weights (CDW's, with fl.cdw), accuracy against cumulative traffic, round time by phase."""
    xs = [r["round"] for r in history]
    clients = list(dict.fromkeys(c for r in history for c in r.get("client_metrics", {})))
    fig, axes = agg_figure(2, 2, figsize=(11.0, 7.2))
    loss_ax, weight_ax, traffic_ax, time_ax = axes.ravel()
    for c in clients:
        pts = [(r["round"], r["client_metrics"][c]["train_loss"]) for r in history
               if "train_loss" in r.get("client_metrics", {}).get(c, {})]
        if pts:
            loss_ax.plot(*zip(*pts), linewidth=1, label=c)
    kd = [(r["round"], r["kd"]["kd_loss"]) for r in history if "kd_loss" in (r.get("kd") or {})]
    if kd:
        loss_ax.plot(*zip(*kd), "k--", marker="o", markersize=3, label="server KD")
    loss_ax.set(xlabel="round", ylabel="training loss", title="local training loss per client")
    for c in clients:
        pts = [(r["round"], r["weights"][c]) for r in history if c in (r.get("weights") or {})]
        if pts:
            weight_ax.plot(*zip(*pts), linewidth=1, label=c)
    weighting = next((r.get("weighting") for r in reversed(history) if r.get("weighting")), "size")
    weight_ax.set(xlabel="round", ylabel="weight", title=f"aggregation weights ({weighting})")
    evaluated = [r for r in history if r.get("eval")]
    if evaluated:
        first = next(iter(evaluated[-1]["eval"].values()))
        metric, label = ("accuracy", "test accuracy") if "accuracy" in first else ("rank1", "mean Rank-1")
        mib = [r.get("comm", {}).get("cumulative_bytes", 0) / 2**20 for r in evaluated]
        acc = [100 * sum(v[metric] for v in r["eval"].values()) / len(r["eval"]) for r in evaluated]
        traffic_ax.plot(mib, acc, marker="o", markersize=3)
        traffic_ax.set(xlabel="cumulative traffic (MiB)", ylabel=f"{label} (%)", title=f"{label} against traffic")
    phases = ("clients", "aggregate", "kd", "eval")
    bottom = [0.0] * len(history)
    for phase in phases:
        values = []
        for r in history:
            t = r.get("time", {})
            if phase == "clients":  # the round's wall time outside the server's phases
                values.append(max(0.0, t.get("round", 0.0) - sum(t.get(p, 0.0) for p in phases[1:])))
            else:
                values.append(float(t.get(phase, 0.0)))
        if any(values):
            time_ax.bar(xs, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    time_ax.set(xlabel="round", ylabel="seconds", title="round time by phase")
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def format_table(table: Mapping[str, Mapping[str, float]], title_column: str = "dataset") -> str:
    """A markdown table of percentages with a mean row."""
    if not table:
        return "(no evaluation yet)\n"
    metrics = [m for m in METRICS if all(m in row for row in table.values())]
    head = f"| {title_column} | " + " | ".join(METRIC_LABELS[m] for m in metrics) + " |"
    lines = [head, "|---|" + "---:|" * len(metrics)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * row[m]:.1f}" for m in metrics) + " |")
    mean = {m: sum(row[m] for row in table.values()) / len(table) for m in metrics}
    lines.append("| **mean** | " + " | ".join(f"{100 * mean[m]:.1f}" for m in metrics) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    run_dir: str | Path,
    history: Sequence[Mapping[str, Any]],
    *,
    title: str = "",
    targets: Sequence[float] = (0.5, 0.7, 0.8),
) -> Path:
    """Write ``run_dir/report.md`` and its curves; returns the report's path.

    ``targets``: accuracies whose first round a classification run reports.
    """
    run_dir = Path(run_dir)
    pictures = plot_curves(history, run_dir)
    rounds = eval_rounds(history)
    before = [r for r in rounds if r.get("eval_before_hooks")]
    lines = [f"# {title or run_dir.name}", ""]
    if history:
        last = history[-1]
        comm = last.get("comm", {})
        lines += [
            f"{len(history)} rounds, mode `{last.get('mode', 'federated')}`, "
            f"{len(last.get('clients', []))} clients in the last round; "
            f"traffic {comm.get('cumulative_bytes', 0) / 2**20:.1f} MiB in all "
            f"({comm.get('cumulative_bytes', 0) / 2**20 / len(history):.2f} MiB per round on average, "
            f"{comm.get('total_bytes', 0) / 2**20:.2f} MiB in the last).",
            "",
        ]
    if rounds and is_classification(history):
        summary = classification_summary(history, targets)
        lines += ["## Test accuracy", "", format_classification_summary(summary)]
        if before:
            rows = before[-1]["eval_before_hooks"].items()
            accuracy = "; ".join(f"{name} {100 * row['accuracy']:.2f}%" for name, row in rows
                                 if isinstance(row, Mapping) and "accuracy" in row)
            lines += [f"Before the server hooks trained the aggregate (round {before[-1]['round']}, "
                      f"`eval.before_hooks`): {accuracy}.", ""]
        if (run_dir / "partition.png").is_file():
            lines += ["![partition: samples per client and class](partition.png)", ""]
    elif rounds:
        lines += [
            "## Paper convention",
            "",
            format_paper_summary(paper_summary(history)),
        ]
        if rounds[-1].get("mode", "federated") == "federated":
            lines += ["The same, each dataset's best 3 chosen on its own:", "",
                      format_paper_summary(paper_summary(history, selection="per_dataset"))]
        lines += [
            f"## Last evaluation (round {rounds[-1]['round']})",
            "",
            format_table(rounds[-1]["eval"]),
        ]
        if before:
            lines += [
                f"## Before the server hooks (round {before[-1]['round']})",
                "",
                "The aggregated model before the round's server hooks trained it (KD; `eval.before_hooks`), "
                "as the official FedReID code also tests it before distilling.",
                "",
                format_table(before[-1]["eval_before_hooks"]),
            ]
        local = local_model_summary(history)
        if local["clients"]:
            rows = {f"{client} (round {', '.join(map(str, local['rounds_by_client'][client]))})": row
                    for client, row in local["clients"].items()}
            lines += [
                "## Local models before aggregation (Table 3's local model)",
                "",
                "Each client's model right after its local training, on its own dataset, "
                "at its best round by Rank-1, in %.",
                "",
                format_table(rows, "client"),
            ]
    if pictures:
        lines += ["## Curves", ""] + [f"![{p.stem}]({p.name})" for p in pictures] + [""]
    lines += _retrieval_section(run_dir)
    path = run_dir / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path


def _recorded_round(path: Path) -> Optional[int]:
    """The ``round`` a model file or checkpoint records; None when it cannot be read or says none."""
    try:
        import torch

        # mmap: the round without reading the weights; weights_only: nothing but tensors and plain values.
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - a file that cannot be read identifies no model, so nothing matches it
        return None
    rnd = data.get("round") if isinstance(data, dict) else None
    return rnd if isinstance(rnd, int) else None


def evaluated_elsewhere(results: Mapping[str, Any], run_dir: str | Path) -> Optional[str]:
    """Why ``run_dir/eval``'s ``results`` are not the run's final model's numbers; None when they are.

    The run's final model is what ``evaluate --model <run>`` takes
    (:func:`~fedreid.inference.model_io.find_model_file`: ``model_final.pt``,
    else ``checkpoint.pt``). ``results["model"]`` (written by
    :func:`~fedreid.eval.pipeline.evaluate_and_report`) must name that same
    file, relative to the eval folder, and the round that file records. The
    model files record no fingerprint (computing one means building the
    model), so file and round decide: a resumed run's later round and
    another run's features differ there; a model trained again from scratch
    into the same folder up to the same round would not. A ``results.json``
    that records no model (an earlier fedreid's, or of features whose meta
    names none) is never taken for the final model's.
    """
    from fedreid.inference.model_io import find_model_file

    run_dir = Path(run_dir)
    model = results.get("model")
    if not isinstance(model, Mapping) or not isinstance(model.get("file"), str):
        return "it records no model file and round (written by an earlier fedreid, or from features that name none)"
    evaluated = run_dir / EVAL_DIR / model["file"]
    shown = f"{os.path.normpath(os.path.abspath(evaluated))}, round {model.get('round')}"
    try:
        final = find_model_file(run_dir)
    except FileNotFoundError:
        return f"it belongs to {shown}, and this run folder has no final model to compare it with"
    rnd = _recorded_round(final)
    if evaluated.is_file() and os.path.samefile(evaluated, final) and rnd is not None and model.get("round") == rnd:
        return None
    return f"it belongs to another model or round ({shown}), not to this run's final model ({final.name}, round {rnd})"


def _retrieval_section(run_dir: Path) -> list[str]:
    """The eval_reid results of ``run_dir/eval`` as markdown lines (none if it has not run).

    Only the final model's results are shown (:func:`evaluated_elsewhere`);
    others get a line saying whose they are. Picture links are relative to
    ``run_dir``.
    """
    eval_dir = run_dir / EVAL_DIR
    results_path = eval_dir / RESULTS_FILE
    if not results_path.is_file():
        return []
    results = json.loads(results_path.read_text())
    heading = ["## Retrieval evaluation (tools/eval_reid.py)", ""]
    elsewhere = evaluated_elsewhere(results, run_dir)
    if elsewhere is not None:
        return heading + [
            f"`{EVAL_DIR}/{RESULTS_FILE}` is not shown: {elsewhere}. Evaluate the final model with "
            f"`python tools/eval_reid.py evaluate --model {run_dir}`.",
            "",
        ]

    def link(path: str) -> str:
        found = recorded_path(eval_dir, path)
        return Path(os.path.relpath(os.path.abspath(found), os.path.abspath(run_dir))).as_posix()

    reranked = ", k-reciprocal re-ranking" if results.get("rerank") else ""
    if results.get("protocol"):
        from fedreid.eval.protocols import report_note

        reranked += report_note(results)
    model = results["model"]
    client = model.get("client")
    whose = (f"Client `{client}`'s own model of this local-training baseline (each client has one)" if client
             else "The final model's own numbers (the last evaluation above, when the last round was evaluated and "
             "the options match)")
    lines = heading + [
        f"Model `{Path(model['file']).name}`{f', client `{client}`' if client else ''} (round {model.get('round')}), "
        f"{results.get('ap', 'standard')} AP{reranked}, whole filtered gallery, in %. {whose}; compare with the "
        "paper through the paper-convention table.",
        "",
        format_table(results["datasets"]),
        f"![CMC]({link(results['cmc_plot'])})",
        "",
    ]
    if results.get("pictures"):
        lines += [
            "Ranked lists (query in grey, then the top 10: green = true match, red = wrong), "
            "best and worst queries by AP"
            + (", then the chosen queries:" if any("_query_q" in Path(p).name for p in results["pictures"]) else ":"),
            "",
        ]
        lines += [f"![{Path(p).stem}]({link(p)})" for p in results["pictures"]] + [""]
    return lines


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight")
    return path
