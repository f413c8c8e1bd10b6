"""Federated splits of a labelled classification dataset: which client holds which samples.

Every partitioner takes the dataset's ``labels`` (a 1-D integer array), the
number of clients and a ``numpy.random.Generator`` (passed in, never global
state: the same labels, options and generator state give the same split), and
returns one **sorted** ``int64`` array of sample indices per client. Each
sample goes to exactly one client; the parts are disjoint and cover
``range(len(labels))``.

Kinds (:func:`partition` dispatches on these names):

* ``iid`` -- :func:`iid`: a shuffled split into near-equal parts.
* ``dirichlet`` -- :func:`dirichlet_label`: per class, proportions over
  clients from ``Dir(alpha)`` (the "LDA" split of NIID-Bench and FedLMD).
* ``dirichlet_prior`` -- :func:`dirichlet_prior`: fixed client sizes, a
  ``Dir(beta)`` class prior per client (FedDyn's and FedFTG's split, the
  formulation of Hsu et al. 2019).
* ``shards`` -- :func:`shards`: label-sorted shards (FedAvg's pathological
  non-IID split, the "Sharding (McMahan et al., 2017)" of FedLMD Sec. 5.1).
* ``shards_per_class`` -- :func:`shards_per_class`: one-class shards, the
  sharding of FedNTD's and FedLMD's official code.

:func:`class_counts` turns a split into its clients x classes table (what a
FedFTG / FedLMD client reports), :func:`noisy_counts` perturbs such a table
and :func:`save_partition_heatmap` draws it.
"""

from __future__ import annotations

import bisect
import inspect
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from fedreid.errors import FedReIDError
from fedreid.utils.io import atomic_path
from fedreid.utils.plotting import agg_figure

__all__ = [
    "PARTITION_KINDS",
    "PartitionError",
    "class_counts",
    "dirichlet_label",
    "dirichlet_prior",
    "iid",
    "noisy_counts",
    "partition",
    "save_partition_heatmap",
    "shards",
    "shards_per_class",
]


class PartitionError(FedReIDError, ValueError):
    """A split cannot be made with the options given; the message says why and what to change.

    ``reason`` is the message without the advice; ``remedies`` lists the
    partitioner arguments whose change can make the split succeed, as
    ``(argument, phrase)`` pairs where ``phrase.format(name)`` reads as advice
    ("a larger {}", "a smaller {} (<= 3)"). ``str(error)`` is ``reason`` plus
    "; use " and the phrases filled with the argument names. A caller that
    sets the arguments from its own settings re-words the advice with its own
    names through :meth:`advice` (the classification track names its config
    keys, :func:`fedreid.fl.classification.partition_clients`).
    """

    def __init__(self, reason: str, *, remedies: Sequence[tuple[str, str]] = ()) -> None:
        self.reason = reason
        self.remedies = tuple((str(arg), str(phrase)) for arg, phrase in remedies)
        super().__init__(reason + (f"; use {self.advice()}" if self.remedies else ""))

    def advice(self, names: Optional[dict[str, str]] = None) -> str:
        """The remedies as one phrase, each argument named by ``names.get(argument, argument)``."""
        names = names or {}
        parts = [phrase.format(names.get(arg, arg)) for arg, phrase in self.remedies]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


# --------------------------------------------------------------------------- helpers


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        # Float labels that are whole numbers (e.g. read from a CSV) are accepted.
        if (not np.issubdtype(labels.dtype, np.floating) or not np.all(np.isfinite(labels))
                or not np.all(labels == np.round(labels))):
            raise PartitionError(f"labels must be integers or whole finite numbers, got dtype {labels.dtype}")
        labels = labels.astype(np.int64)
    return labels


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_clients(num_clients: int, n_samples: int) -> int:
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
        raise PartitionError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > n_samples:
        raise PartitionError(
            f"cannot split {n_samples} samples into {num_clients} non-empty clients",
            remedies=[("num_clients", "a smaller {} (at most " + str(n_samples) + ")")],
        )
    return int(num_clients)


def _check_rng(rng: Any) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise PartitionError(
            f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), got {type(rng).__name__}"
        )
    return rng


def _finish(parts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (Hamilton's method).

    Each gets the floor of its exact share; the leftover units go to the
    largest fractional parts, ties to the lower index. So every size is within
    1 of its exact share, and equal weights give sizes differing by at most 1
    (the first ``total % n`` get one more, as with ``np.array_split``).
    """
    exact = weights / weights.sum() * total
    sizes = np.floor(exact).astype(np.int64)
    leftover = int(total - sizes.sum())
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[:leftover]] += 1
    return sizes


# --------------------------------------------------------------------------- partitioners


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A uniformly shuffled split into ``num_clients`` near-equal parts.

    One permutation of all indices is drawn from ``rng`` and cut with
    ``np.array_split``: the first ``N % num_clients`` clients get
    ``N // num_clients + 1`` samples, the others ``N // num_clients``.
    ``labels`` only gives ``N`` (the split ignores them).
    """
    labels = _check_labels(labels)
    num_clients = _check_clients(num_clients, labels.size)
    rng = _check_rng(rng)
    return _finish(np.array_split(rng.permutation(labels.size), num_clients))


def _dirichlet_label_draw(
    class_indices: Sequence[np.ndarray], n: int, num_clients: int, alpha: float, rng: np.random.Generator,
    balance: bool,
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """One draw of :func:`dirichlet_label`: the client sizes and, per class, its shuffled indices and cut points.

    Only the sizes are needed to accept or reject a draw; the parts are
    assembled (:func:`_dirichlet_label_parts`) for the accepted one only.
    """
    sizes = np.zeros(num_clients, dtype=np.int64)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for members in class_indices:
        idx_k = members.copy()
        rng.shuffle(idx_k)
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        if balance:
            # NIID-Bench: a client that already holds its fair share N/num_clients
            # gets nothing of the remaining classes.
            masked = proportions * (sizes < n / num_clients)
            # At tiny alpha the open clients' mass can underflow to 0 (NIID-Bench
            # would divide by zero and produce NaN); the class then keeps its
            # unmasked proportions.
            if masked.sum() > 0:
                proportions = masked
        proportions = proportions / proportions.sum()
        cuts = (np.cumsum(proportions) * idx_k.size).astype(int)[:-1]
        # np.split's pieces: idx_k[bounds[j]:bounds[j + 1]] (the cuts are non-decreasing).
        bounds = np.clip(np.concatenate(([0], cuts, [idx_k.size])), 0, idx_k.size)
        sizes += np.diff(bounds)
        pieces.append((idx_k, cuts))
    return sizes, pieces


def _dirichlet_label_parts(pieces: list[tuple[np.ndarray, np.ndarray]], num_clients: int) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for idx_k, cuts in pieces:
        for part, chunk in zip(parts, np.split(idx_k, cuts)):
            part.append(chunk)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def dirichlet_label(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 10,
    max_retries: int = 100,
    balance: bool = True,
) -> list[np.ndarray]:
    """Label-Dirichlet ("LDA") split: each class spread over the clients by ``Dir(alpha)``.

    This is the split of NIID-Bench (Li et al., "Federated Learning on Non-IID
    Data Silos: An Experimental Study", ICDE 2022, ``partition_data``,
    ``noniid-labeldir``), used by FedLMD (Lu et al., ACM MM 2023) and many
    others, and usually credited to Hsu et al. 2019 ("Measuring the Effects
    of Non-Identical Data Distribution for Federated Visual Classification";
    their own formulation draws a class prior per client, which is
    :func:`dirichlet_prior`). One *draw* is:

    for each class ``k`` present in ``labels`` (ascending):

    1. shuffle the indices of class ``k`` with ``rng``;
    2. draw ``p ~ Dir(alpha * 1_num_clients)`` with ``rng``;
    3. if ``balance``: set ``p_j = 0`` for every client ``j`` that already
       holds ``>= N / num_clients`` samples (from earlier classes), then
       renormalise (if that leaves no mass, e.g. underflow at tiny ``alpha``,
       the unmasked ``p`` is kept);
    4. cut the shuffled indices at ``floor(cumsum(p)[:-1] * n_k)``; client
       ``j`` gets the ``j``-th piece.

    The whole draw is repeated until every client holds ``>= min_size``
    samples: at most ``1 + max_retries`` draws, after which
    :class:`PartitionError` is raised naming the smallest client of the last
    draw and the largest smallest-client size ``b`` over all draws (the draws
    do not depend on ``min_size``, so ``min_size <= b`` succeeds from the same
    generator state). If ``num_clients * min_size > N`` no draw can succeed
    and the error is raised at once.

    ``min_size`` is NIID-Bench's ``min_require_size`` (10 in NIID-Bench and in
    FedNTD's ``lda_partition``, which FedLMD runs; both redraw without a
    bound). How often a draw meets it falls steeply with ``alpha`` and the
    number of clients: on CIFAR-10's labels (10 x 5000) with 100 clients and
    ``alpha=0.05`` (FedLMD's default setting, Sec. 5.1) about one draw in tens
    of thousands gives every client 10 samples, about 11% give every client
    at least 1.

    ``balance=True`` is the default because it is what the commonly used
    NIID-Bench code does (and so what results reported with "Dir(alpha)"
    splits were obtained with). It caps how far a client can grow beyond
    ``N / num_clients`` (a client can still overshoot with the class that
    crosses the threshold), which keeps client sizes comparable and makes
    the ``min_size`` condition pass in far fewer draws at small ``alpha``.
    ``balance=False`` is the plain per-class Dirichlet split, whose client
    sizes vary much more.

    ``alpha -> inf`` approaches an IID split; ``alpha -> 0`` gives each class
    to (nearly) one client. Every sample is assigned exactly once.
    """
    labels = _check_labels(labels)
    num_clients = _check_clients(num_clients, labels.size)
    rng = _check_rng(rng)
    if not _is_real(alpha) or not alpha > 0 or not np.isfinite(alpha):
        raise PartitionError(f"alpha must be a positive finite number, got {alpha!r}")
    if not all(_is_int(v) and v >= 0 for v in (min_size, max_retries)):
        raise PartitionError(f"min_size and max_retries must be integers >= 0, got {min_size!r} and {max_retries!r}")
    n = labels.size
    if num_clients * min_size > n:
        raise PartitionError(
            f"dirichlet split: {num_clients} clients with at least min_size={min_size} samples each need "
            f"{num_clients * min_size} samples, the dataset has {n}",
            remedies=[("min_size", "a smaller {}"), ("num_clients", "a smaller {}")],
        )
    class_indices = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    best = -1
    for _ in range(1 + max_retries):
        sizes, pieces = _dirichlet_label_draw(class_indices, n, num_clients, float(alpha), rng, balance)
        if sizes.min() >= min_size:
            return _finish(_dirichlet_label_parts(pieces, num_clients))
        best = max(best, int(sizes.min()))
    smallest = int(np.argmin(sizes))
    # The draws do not depend on min_size, so min_size=best accepts the best draw
    # (or an earlier one) from the same generator state.
    accept = f" (<= {best} succeeds with this rng state)" if best >= 1 else ""
    raise PartitionError(
        f"dirichlet split (alpha={alpha}, {num_clients} clients, {n} samples, balance={balance}): after "
        f"{1 + max_retries} draws some client still had fewer than min_size={min_size} samples; in the last "
        f"draw client {smallest} had {int(sizes[smallest])} (the best draw's smallest client had {best})",
        remedies=[
            ("alpha", "a larger {}"),
            ("min_size", "a smaller {}" + accept),
            ("num_clients", "a smaller {}"),
            ("max_retries", "a larger {}"),
        ],
    )


def _client_sizes(n: int, num_clients: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    if sigma == 0:
        return _largest_remainder(np.ones(num_clients), n)
    # FedDyn (utils_dataset.py): lognormal(mean=log(N/n), sigma) sizes, scaled to sum to N.
    weights = rng.lognormal(mean=np.log(n / num_clients), sigma=sigma, size=num_clients)
    return _largest_remainder(weights, n)


def dirichlet_prior(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    rng: np.random.Generator,
    *,
    unbalanced_sigma: float = 0.0,
) -> list[np.ndarray]:
    """Client-prior Dirichlet split with fixed client sizes (FedDyn, FedFTG).

    The split of FedDyn's official code (Acar et al., ICLR 2021,
    ``utils_dataset.py``, ``rule='Dirichlet'``), reused by FedFTG (Zhang et
    al., CVPR 2022); it is Hsu et al. 2019's formulation (each client draws
    ``q ~ Dir(beta * p)`` with a uniform ``p``). Steps, all draws from ``rng``:

    1. **Client sizes** ``n_1..n_K`` summing to ``N``: equal when
       ``unbalanced_sigma == 0``; otherwise ``w_j ~ LogNormal(log(N/K),
       unbalanced_sigma)`` (FedDyn's ``unbalanced_sgm``), scaled to ``N``.
       Shares are rounded by the largest-remainder method, so each ``n_j`` is
       within 1 of ``N w_j / sum(w)`` and equal sizes differ by at most 1.
       (FedDyn floors and gives the whole remainder to client 0; with ``N``
       divisible by ``K`` and ``sigma = 0`` the two agree.)
    2. **Priors**: ``q_j ~ Dir(beta * 1_C)`` per client, ``C`` = number of
       classes present; the indices of each class are shuffled.
    3. **Filling**, one sample at a time until every client is full: pick a
       client uniformly among those with room left (FedDyn draws among all
       clients and redraws full ones: the same distribution), then a class
       from ``q_j`` renormalised over the classes that still have samples
       (FedDyn redraws empty classes: the same distribution), and give the
       client that class's next unused sample. If ``q_j`` has no mass left
       on the remaining classes (its classes are used up and the rest of
       its prior underflowed to 0 in float64, from about ``beta = 0.05``
       down), the underflowed entries are drawn again from ``rng``, as
       ``Dir(beta)`` over those classes: a Dirichlet vector's entries over
       a subset, renormalised, are again Dirichlet (its neutrality), so the
       client goes on to its next most wanted classes. FedDyn's code loops
       forever there.

    Client ``j`` gets exactly ``n_j`` samples and every sample is assigned
    exactly once. Small ``beta`` concentrates each client on few classes,
    until the classes it wants run out; the smaller ``beta``, the fewer.
    """
    labels = _check_labels(labels)
    num_clients = _check_clients(num_clients, labels.size)
    rng = _check_rng(rng)
    if not _is_real(beta) or not beta > 0 or not np.isfinite(beta):
        raise PartitionError(f"beta must be a positive finite number, got {beta!r}")
    if not unbalanced_sigma >= 0 or not np.isfinite(unbalanced_sigma):
        raise PartitionError(f"unbalanced_sigma must be >= 0, got {unbalanced_sigma!r}")
    n = labels.size
    sizes = _client_sizes(n, num_clients, float(unbalanced_sigma), rng)
    if sizes.min() < 1:
        raise PartitionError(
            f"dirichlet_prior: unbalanced_sigma={unbalanced_sigma} left client {int(np.argmin(sizes))} with "
            f"no samples ({n} samples, {num_clients} clients)",
            remedies=[("unbalanced_sigma", "a smaller {}"), ("num_clients", "a smaller {}")],
        )
    classes = np.unique(labels)
    priors = rng.dirichlet(np.full(classes.size, float(beta)), size=num_clients)
    pools: list[list[int]] = []
    for k in classes:
        idx_k = np.flatnonzero(labels == k)
        rng.shuffle(idx_k)
        pools.append(idx_k.tolist())
    remaining = [len(p) for p in pools]
    room = [int(r) for r in sizes]
    open_clients = list(range(num_clients))  # clients with room left, kept in ascending order
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    # A client's class weights priors[j] * (remaining > 0) change only when a
    # class runs out, so their cumulative sums are cached per client and
    # recomputed after such an event (``emptied`` counts them).
    emptied = 0
    cache: dict[int, tuple[int, list[float], int]] = {}

    def class_weights(client: int) -> tuple[int, list[float], int]:
        """``(emptied, cumulative weights, last class with weight)`` of ``client`` over the remaining classes."""
        available = np.array([r > 0 for r in remaining])
        cumulative = np.cumsum(priors[client] * available)
        while not cumulative[-1] > 0:  # the prior has no mass left on the remaining classes
            underflowed = priors[client] == 0  # includes every remaining class; never empty here
            priors[client, underflowed] = rng.dirichlet(np.full(int(underflowed.sum()), float(beta)))
            cumulative = np.cumsum(priors[client] * available)
        positive = np.flatnonzero(priors[client] * available > 0)
        return emptied, cumulative.tolist(), int(positive[-1])

    for _ in range(n):
        client = open_clients[int(rng.integers(len(open_clients)))]
        cached = cache.get(client)
        if cached is None or cached[0] != emptied:
            cached = cache[client] = class_weights(client)
        _, cumulative, last = cached
        k = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
        # Rounding can put the draw at the very end; take the last class that has samples.
        k = min(k, last)
        remaining[k] -= 1
        parts[client].append(pools[k][remaining[k]])
        if remaining[k] == 0:
            emptied += 1
        room[client] -= 1
        if room[client] == 0:
            open_clients.remove(client)
    return _finish(parts)


def shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Pathological non-IID split by label-sorted shards (FedAvg; FedLMD Sec. 5.1).

    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data" (AISTATS 2017), Sec. 3: sort by label, cut into
    ``num_clients * shards_per_client`` shards, give each client
    ``shards_per_client`` of them at random (MNIST: 200 shards of 300, 2 per
    client). FedLMD (Sec. 5.1) cites this for its "Sharding"; the official
    code of FedNTD and FedLMD cuts every class on its own instead
    (:func:`shards_per_class`).

    Exactly: the indices are sorted by label with a *stable* sort (within a
    class they stay in dataset order), cut with ``np.array_split`` into
    ``S = num_clients * shards_per_client`` contiguous shards (sizes
    ``floor(N/S)`` or ``ceil(N/S)``, so every sample is assigned exactly
    once), a permutation of the shards is drawn from ``rng`` and client ``i``
    gets shards ``perm[i*s:(i+1)*s]``.

    What this guarantees about classes (``s = shards_per_client``): a shard is
    a contiguous run of the sorted labels, so it holds at most 2 classes when
    every class has at least ``ceil(N/S) - 1`` samples, and then a client has
    at most ``2 s`` classes. When every class count is a multiple of the
    shard size (e.g. equal classes with ``S`` a multiple of the number of
    classes), every shard holds exactly one class and a client has at most
    ``s`` classes. Sizes: every client gets ``s`` shards, so client sizes
    differ by at most ``s``.
    """
    labels = _check_labels(labels)
    num_clients = _check_clients(num_clients, labels.size)
    rng = _check_rng(rng)
    if isinstance(shards_per_client, bool) or int(shards_per_client) != shards_per_client or shards_per_client < 1:
        raise PartitionError(f"shards_per_client must be a positive integer, got {shards_per_client!r}")
    num_shards = num_clients * int(shards_per_client)
    if num_shards > labels.size:
        raise PartitionError(
            f"shards: {num_clients} clients x {shards_per_client} shards = {num_shards} shards, "
            f"more than the {labels.size} samples",
            remedies=[("num_clients", "a smaller {}"), ("shards_per_client", "a smaller {}")],
        )
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, num_shards)
    perm = rng.permutation(num_shards)
    s = int(shards_per_client)
    return _finish([np.concatenate([pieces[j] for j in perm[i * s : (i + 1) * s]]) for i in range(num_clients)])


def shards_per_class(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Sharding as FedNTD's and FedLMD's official code does it: every shard holds one class.

    Lee-Gihun/FedNTD ``train_tools/preprocessing/datasetter.py:sharding_partition``
    (byte-identical in wnma3mz/FedLMD), which the FedLMD paper's "Sharding
    (McMahan et al., 2017)" (Sec. 5.1) ran as; :func:`shards` is McMahan's
    sort-and-cut, whose shards can span two classes when a class count is
    not a multiple of the shard size (MNIST).

    Exactly: with ``C`` classes and ``s = shards_per_client``, each class is
    cut into ``P = s * num_clients / C`` shards: its indices in dataset order,
    the first ``len - len % P`` of them in ``P`` equal runs, and the ``len % P``
    left over appended one each to its first shards. The list ``[0..C-1] * P``
    is shuffled (``rng.permutation``) and read ``s`` at a time: client ``i``
    takes, for each label of its ``s``, a shard of that label drawn uniformly
    from those still left (``rng.integers``). So a client has at most ``s``
    classes (fewer when it draws one label twice). ``s * num_clients`` must
    be a multiple of ``C`` (the official code cannot reshape otherwise), and
    every class needs at least ``P`` samples.
    """
    labels = _check_labels(labels)
    num_clients = _check_clients(num_clients, labels.size)
    rng = _check_rng(rng)
    if isinstance(shards_per_client, bool) or int(shards_per_client) != shards_per_client or shards_per_client < 1:
        raise PartitionError(f"shards_per_client must be a positive integer, got {shards_per_client!r}")
    s = int(shards_per_client)
    classes = np.unique(labels)
    if (s * num_clients) % classes.size:
        raise PartitionError(
            f"shards_per_class: {num_clients} clients x {s} shards = {s * num_clients} shards cannot be shared "
            f"equally by the {classes.size} classes",
            remedies=[("num_clients", "a {} making clients x shards a multiple of " + str(classes.size)),
                      ("shards_per_client", "such a {}")],
        )
    per_class = s * num_clients // classes.size
    pool: dict[int, list[np.ndarray]] = {}
    for label in classes:
        members = np.flatnonzero(labels == label)
        if members.size < per_class:
            raise PartitionError(
                f"shards_per_class: class {int(label)} has {members.size} samples, fewer than its "
                f"{per_class} shards",
                remedies=[("num_clients", "a smaller {}"), ("shards_per_client", "a smaller {}")],
            )
        leftover = members.size % per_class
        cut = members[: members.size - leftover].reshape(per_class, -1)
        shards_of_label = [np.asarray(run) for run in cut]
        for i, index in enumerate(members[members.size - leftover :]):
            shards_of_label[i] = np.append(shards_of_label[i], index)
        pool[int(label)] = shards_of_label
    plan = rng.permutation(np.tile(classes, per_class)).reshape(num_clients, s)  # list(range(C)) * P, shuffled
    parts = []
    for client_labels in plan:
        taken = [pool[int(label)].pop(int(rng.integers(len(pool[int(label)])))) for label in client_labels]
        parts.append(np.concatenate(taken))
    return _finish(parts)


PARTITION_KINDS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "dirichlet": dirichlet_label,
    "dirichlet_prior": dirichlet_prior,
    "shards": shards,
    "shards_per_class": shards_per_class,
}


def partition(
    labels: np.ndarray, kind: str, num_clients: int, rng: np.random.Generator, **options: Any
) -> list[np.ndarray]:
    """Split ``labels`` with the partitioner named ``kind`` (see :data:`PARTITION_KINDS`).

    ``options`` are the partitioner's own arguments: ``alpha`` (and
    ``min_size``, ``max_retries``, ``balance``) for ``dirichlet``; ``beta``
    (and ``unbalanced_sigma``) for ``dirichlet_prior``; ``shards_per_client``
    for ``shards`` and ``shards_per_class``; none for ``iid``. An unknown kind or option raises
    :class:`PartitionError` naming the valid ones.
    """
    fn = PARTITION_KINDS.get(kind)
    if fn is None:
        raise PartitionError(f"unknown partition kind {kind!r}; known kinds: {', '.join(PARTITION_KINDS)}")
    params = inspect.signature(fn).parameters
    valid = [p for p in params if p not in ("labels", "num_clients", "rng")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise PartitionError(
            f"partition kind {kind!r} takes no option(s) {', '.join(unknown)}; "
            f"its options: {', '.join(valid) if valid else '(none)'}"
        )
    missing = [p for p in valid if params[p].default is inspect.Parameter.empty and p not in options]
    if missing:
        raise PartitionError(f"partition kind {kind!r} needs option(s) {', '.join(missing)}")
    return fn(labels, num_clients=num_clients, rng=rng, **options)


# --------------------------------------------------------------------------- counts


def class_counts(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """``counts[i, k]``: samples of class ``k`` held by client ``i`` (``int64``, clients x classes).

    ``labels`` must lie in ``0..num_classes-1``.
    """
    labels = _check_labels(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise PartitionError(
            f"labels must lie in 0..{num_classes - 1} for num_classes={num_classes}, "
            f"got values {int(labels.min())}..{int(labels.max())}"
        )
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        counts[i] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return counts


def noisy_counts(counts: np.ndarray, level: float, rng: np.random.Generator) -> np.ndarray:
    """``counts`` with independent multiplicative noise of at most ``level`` (0.1 = +-10%).

    For every entry ``c``: draw ``u ~ Uniform(-level, level)`` from ``rng``
    (one draw per entry, in C order), take ``round(c * (1 + u))`` (nearest
    integer, ties to even) and clip it into the integer interval
    ``[ceil(c (1 - level)), floor(c (1 + level))]``, which always contains
    ``c``. So the result is a non-negative ``int64`` array of the same shape
    with ``|noisy - c| <= level * c``; zeros stay zero. Used to model clients
    that report their label counts (FedFTG's ``n_k^y``, FedLMD's majority
    labels) only approximately. ``level`` must lie in ``[0, 1]``.
    """
    counts = np.asarray(counts)
    if counts.size and (
        not np.issubdtype(counts.dtype, np.number) or np.any(counts < 0) or np.any(counts != np.round(counts))
    ):
        raise PartitionError("counts must be non-negative integers")
    if not 0 <= level <= 1:
        raise PartitionError(f"noise level must lie in [0, 1], got {level!r}")
    rng = _check_rng(rng)
    c = counts.astype(np.float64)
    u = rng.uniform(-level, level, size=c.shape)
    noisy = np.rint(c * (1 + u))
    noisy = np.clip(noisy, np.ceil(c * (1 - level)), np.floor(c * (1 + level)))
    return np.maximum(noisy, 0).astype(np.int64)


# --------------------------------------------------------------------------- picture


def save_partition_heatmap(
    counts: np.ndarray,
    out_path: str | Path,
    *,
    title: str = "samples per client and class",
    class_names: Optional[Sequence[str]] = None,
    annotate: Optional[bool] = None,
    dpi: int = 100,
) -> Path:
    """Save a PNG heat-map of a clients x classes count table; returns ``out_path``.

    Rows are clients, columns classes, with a colour bar. Each cell shows its
    count when ``annotate`` is true; by default (``None``) when the grid is at
    most 20 x 20. ``class_names`` label the columns (defaults: class indices).
    Uses a bare matplotlib ``Figure`` with the Agg canvas (no pyplot state);
    written atomically.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.size == 0:
        raise PartitionError(f"counts must be a non-empty clients x classes table, got shape {counts.shape}")
    n_clients, n_classes = counts.shape
    if class_names is not None and len(class_names) != n_classes:
        raise PartitionError(f"{len(class_names)} class names for {n_classes} classes")
    if annotate is None:
        annotate = n_clients <= 20 and n_classes <= 20
    # Grow with the grid so annotated cells stay legible, within a sane canvas.
    width = min(16.0, max(4.5, 0.5 * n_classes + 2.0))
    height = min(12.0, max(3.5, 0.4 * n_clients + 1.5))
    figure, axes = agg_figure(figsize=(width, height), dpi=dpi)
    image = axes.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    figure.colorbar(image, ax=axes, label="samples")
    axes.set_xlabel("class")
    axes.set_ylabel("client")
    axes.set_title(title)
    if n_classes <= 40:
        axes.set_xticks(np.arange(n_classes))
        axes.set_xticklabels(list(class_names) if class_names is not None else [str(k) for k in range(n_classes)],
                             rotation=90 if class_names is not None else 0, fontsize=8)
    if n_clients <= 40:
        axes.set_yticks(np.arange(n_clients))
        axes.set_yticklabels([str(i) for i in range(n_clients)], fontsize=8)
    if annotate:
        top = counts.max()
        for i in range(n_clients):
            for k in range(n_classes):
                value = counts[i, k]
                # Dark text on the bright end of viridis, light text on the dark end.
                colour = "black" if top > 0 and value > 0.6 * top else "white"
                text = f"{value:g}" if np.issubdtype(counts.dtype, np.floating) else str(int(value))
                axes.text(k, i, text, ha="center", va="center", fontsize=7, color=colour)
    figure.tight_layout()
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        figure.savefig(tmp, format="png", dpi=dpi)
    return out_path
