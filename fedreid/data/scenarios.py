"""Federated scenarios: which client trains on which images, in which label space.

The FedReID benchmark (Zhuang et al., ACM MM 2020) studies three ways to
federate person re-identification data:

* **by dataset** (the benchmark, Sec. 4.2): one client per dataset, nine clients;
* **by camera** (Sec. 4.1, Table 2): one client per camera of one dataset
  (Market-1501: 6 clients, CUHK03-NP: 2);
* **by identity** (Sec. 4.1, Table 2): one dataset split into as many clients
  as it has cameras, each with the same number of disjoint identities
  (Market-1501: 6 clients of 125 identities).

A fourth comes from the federated domain-generalisation line of work
(FedDG-ReID; e.g. DACS, Yang et al., AAAI 2024, whose official
``fed_dg_cls.py`` removes ``--test-dataset`` from the dataset list and trains
one client per remaining dataset):

* **leave one out**: one client per dataset except the unseen ``target``,
  which no client trains on; the model is evaluated on the target
  (Protocol-1 over CUHK02, CUHK03-NP, Market-1501 and MSMT17).

Every client gets its own contiguous label space ``0..num_classes-1`` (its
identity head is private, so labels never need to agree across clients).
Evaluation always uses each dataset's own query/gallery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from fedreid.data.prepared import PreparedDataset, Record
from fedreid.errors import FedReIDError

if TYPE_CHECKING:
    from fedreid.config import ScenarioConfig


class ScenarioError(FedReIDError, ValueError):
    """A scenario cannot be built from the data given; the message says why."""


@dataclass
class ClientSplit:
    """One client's training data in its private label space."""

    name: str  # e.g. "market1501", "msmt17/cam3", "cuhk03np/part2"
    dataset: str
    records: list[Record]
    #: ``labels[i]`` is the private class of ``records[i]``.
    labels: np.ndarray
    #: ``pids[c]`` is the dataset identity of private class ``c``.
    pids: list[int] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.pids)

    def __len__(self) -> int:
        return len(self.records)


def make_client(name: str, dataset: str, records: Sequence[Record]) -> ClientSplit:
    """Relabel ``records`` into a contiguous label space (sorted by pid)."""
    records = [r for r in records if r.pid != -1]  # junk never trains
    if not records:
        raise ScenarioError(f"client {name!r} has no training images")
    pids = sorted({r.pid for r in records})
    index = {pid: i for i, pid in enumerate(pids)}
    labels = np.array([index[r.pid] for r in records], dtype=np.int64)
    return ClientSplit(name, dataset, list(records), labels, pids)


def by_dataset(
    datasets: Sequence[PreparedDataset], split: str = "train_all"
) -> list[ClientSplit]:
    """One client per dataset (the FedReID benchmark's federation)."""
    return [make_client(ds.name, ds.name, ds.split(split)) for ds in datasets]


def leave_one_out(
    datasets: Sequence[PreparedDataset], target: str, split: str = "train_all"
) -> list[ClientSplit]:
    """One client per dataset except ``target`` (in the given order); the target trains nowhere."""
    names = [ds.name for ds in datasets]
    if target not in names:
        raise ScenarioError(f"scenario.target={target!r} is not among the datasets ({', '.join(names)})")
    sources = [ds for ds in datasets if ds.name != target]
    if not sources:
        raise ScenarioError(f"scenario.target={target!r} leaves no source dataset to train on")
    unseen = next(ds for ds in datasets if ds.name == target)
    if not (unseen.split("query") and unseen.split("gallery")):
        raise ScenarioError(f"scenario.target={target!r} has no query/gallery split to evaluate on "
                            "(CUHK02, for one, is prepared as training images only); choose another target")
    return by_dataset(sources, split)


def by_camera(dataset: PreparedDataset, split: str = "train_all") -> list[ClientSplit]:
    """One client per camera; an identity seen by several cameras is in several clients."""
    records = dataset.split(split)
    cameras = sorted({r.camid for r in records})
    return [
        make_client(f"{dataset.name}/cam{cam}", dataset.name, [r for r in records if r.camid == cam])
        for cam in cameras
    ]


def by_identity(
    dataset: PreparedDataset,
    num_clients: int,
    rng: np.random.Generator,
    split: str = "train_all",
    *,
    equal_groups: bool = True,
) -> list[ClientSplit]:
    """``num_clients`` clients with disjoint identities, drawn with ``rng``.

    Identities (junk pid -1 excluded) are shuffled with ``rng`` and cut in
    order. ``equal_groups=True`` is the paper's split (Sec. 4.1: "each of them
    has the same number of identities"; the reference's ``split_id_data.py``
    does the same): every client gets exactly ``n_ids // num_clients``
    identities and the ``n_ids % num_clients`` left over train nowhere; on
    Market-1501's ``train_all`` (751 identities) 6 clients get 125 each and one
    identity is left out, on CUHK03-NP's (767) 2 clients get 383 and one is
    left out. ``equal_groups=False`` cuts near-equal groups
    (``np.array_split``), so no identity is lost.
    """
    records = dataset.split(split)
    pids = np.array(sorted({r.pid for r in records if r.pid != -1}))
    if num_clients < 1 or num_clients > len(pids):
        raise ScenarioError(
            f"{dataset.name}: cannot split {len(pids)} identities into {num_clients} clients"
        )
    shuffled = pids[rng.permutation(len(pids))]
    if equal_groups:
        size = len(pids) // num_clients
        groups = [shuffled[i * size : (i + 1) * size] for i in range(num_clients)]
    else:
        groups = np.array_split(shuffled, num_clients)
    clients = []
    for i, group in enumerate(groups, start=1):
        members = set(group.tolist())
        clients.append(
            make_client(
                f"{dataset.name}/part{i}", dataset.name, [r for r in records if r.pid in members]
            )
        )
    return clients


def camera_count(dataset: PreparedDataset, split: str = "train_all") -> int:
    """The number of distinct cameras in ``dataset``'s ``split``."""
    return len({r.camid for r in dataset.split(split)})


def build_clients(
    cfg: ScenarioConfig,
    datasets: Mapping[str, PreparedDataset],
    rng: np.random.Generator,
) -> list[ClientSplit]:
    """The clients of the scenario ``cfg`` over the prepared ``datasets``.

    ``by_identity`` with ``cfg.num_clients`` null makes as many clients as the
    dataset has cameras in ``cfg.train_split`` (Sec. 4.1: "the number of clients
    [...] is equal to the number of camera views").
    """
    if cfg.kind == "by_dataset":
        return by_dataset(list(datasets.values()), cfg.train_split)
    if cfg.kind == "leave_one_out":
        return leave_one_out(list(datasets.values()), cfg.target, cfg.train_split)
    if cfg.dataset not in datasets:
        raise ScenarioError(
            f"scenario.dataset={cfg.dataset!r} is not among the prepared datasets "
            f"({', '.join(datasets)})"
        )
    dataset = datasets[cfg.dataset]
    if cfg.kind == "by_camera":
        return by_camera(dataset, cfg.train_split)
    num_clients = cfg.num_clients
    if num_clients is None:
        num_clients = camera_count(dataset, cfg.train_split)
        if num_clients < 2:
            raise ScenarioError(
                f"scenario.num_clients is null (the dataset's camera count) but {dataset.name!r} has "
                f"{num_clients} camera in {cfg.train_split}; set scenario.num_clients"
            )
    return by_identity(dataset, num_clients, rng, cfg.train_split, equal_groups=cfg.equal_groups)
