"""Federated classification splits: exact, seeded, documented (fedreid.data.partition)."""

from __future__ import annotations

import re

import cv2
import numpy as np
import pytest

import fedreid.data.partition as part_mod
from fedreid.data.partition import (
    PARTITION_KINDS,
    PartitionError,
    class_counts,
    dirichlet_label,
    dirichlet_prior,
    iid,
    noisy_counts,
    partition,
    save_partition_heatmap,
    shards,
    shards_per_class,
)
from fedreid.errors import FedReIDError

OPTIONS = {
    "iid": {},
    "dirichlet": {"alpha": 0.5},
    "dirichlet_prior": {"beta": 0.5},
    "shards": {"shards_per_client": 2},
    "shards_per_class": {"shards_per_client": 10},  # 5, 8 and 10 clients x 10 shards: a multiple of 10 classes
}


def balanced_labels(num_classes: int = 10, per_class: int = 100, seed: int = 0) -> np.ndarray:
    """``per_class`` samples of each class, in shuffled order."""
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


def uneven_labels(seed: int = 0) -> np.ndarray:
    """10 classes of 60..140 samples each (1,000-ish in all), shuffled."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(60, 141, size=10)
    return rng.permutation(np.repeat(np.arange(10), sizes))


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each part is sorted and has no repeats"
    joined = np.concatenate(parts)
    assert joined.size == n, "every sample assigned exactly once"
    assert np.array_equal(np.sort(joined), np.arange(n))


def proportions(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    counts = class_counts(labels, parts, num_classes).astype(float)
    return counts / counts.sum(axis=1, keepdims=True)


# --------------------------------------------------------------------------- every kind


@pytest.mark.parametrize("kind", list(PARTITION_KINDS))
@pytest.mark.parametrize("labels", [balanced_labels(), uneven_labels()], ids=["balanced", "uneven"])
def test_every_sample_exactly_once(kind, labels):
    parts = partition(labels, kind, 10, np.random.default_rng(1), **OPTIONS[kind])
    assert len(parts) == 10
    assert_exact_cover(parts, labels.size)


@pytest.mark.parametrize("kind", list(PARTITION_KINDS))
def test_seeded_determinism(kind):
    labels = uneven_labels()
    a = partition(labels, kind, 8, np.random.default_rng(7), **OPTIONS[kind])
    b = partition(labels, kind, 8, np.random.default_rng(7), **OPTIONS[kind])
    c = partition(labels, kind, 8, np.random.default_rng(8), **OPTIONS[kind])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("kind", list(PARTITION_KINDS))
def test_global_random_state_untouched(kind):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    partition(balanced_labels(), kind, 5, np.random.default_rng(0), **OPTIONS[kind])
    assert np.array_equal(np.random.get_state()[1], before)


def test_dispatcher_matches_direct_calls():
    labels = uneven_labels()
    direct = dirichlet_label(labels, 6, 0.3, np.random.default_rng(5), min_size=5)
    via = partition(labels, "dirichlet", 6, np.random.default_rng(5), alpha=0.3, min_size=5)
    assert all(np.array_equal(x, y) for x, y in zip(direct, via))


def test_dispatcher_errors_name_the_choices():
    labels = balanced_labels()
    with pytest.raises(PartitionError, match="known kinds: iid, dirichlet, dirichlet_prior, shards"):
        partition(labels, "lda", 5, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="no option.*beta.*its options: alpha, min_size"):
        partition(labels, "dirichlet", 5, np.random.default_rng(0), alpha=1.0, beta=1.0)
    with pytest.raises(PartitionError, match="needs option.*alpha"):
        partition(labels, "dirichlet", 5, np.random.default_rng(0))


def test_bad_inputs():
    labels = balanced_labels()
    with pytest.raises(PartitionError, match="numpy.random.Generator"):
        iid(labels, 5, 0)  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="cannot split 1000 samples into 1001"):
        iid(labels, 1001, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="positive integer"):
        iid(labels, 0, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="1-D"):
        iid(labels.reshape(10, 100), 5, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="alpha must be"):
        dirichlet_label(labels, 5, 0.0, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="beta must be"):
        dirichlet_prior(labels, 5, -1.0, np.random.default_rng(0))
    assert issubclass(PartitionError, FedReIDError) and issubclass(PartitionError, ValueError)


# --------------------------------------------------------------------------- iid


def test_iid_sizes_and_proportions():
    labels = balanced_labels(per_class=101)  # 1,010 samples into 7 clients: 144 or 145
    parts = iid(labels, 7, np.random.default_rng(0))
    sizes = [p.size for p in parts]
    assert sizes == [145, 145, 144, 144, 144, 144, 144]


# --------------------------------------------------------------------------- dirichlet (label)


@pytest.mark.parametrize("balance", [True, False])
def test_dirichlet_huge_alpha_approaches_iid(balance):
    labels = balanced_labels(per_class=200)
    parts = dirichlet_label(labels, 5, 1e6, np.random.default_rng(0), balance=balance)
    props = proportions(labels, parts, 10)
    assert np.abs(props - 0.1).max() < 0.01
    assert max(p.size for p in parts) - min(p.size for p in parts) <= 10  # floor() of the cut points


@pytest.mark.parametrize("balance", [True, False])
def test_dirichlet_tiny_alpha_concentrates_classes(balance):
    labels = balanced_labels(per_class=200)
    top_share, classes_held = [], []
    for seed in range(5):
        # min_size=0: redrawing for a minimum size would favour the less concentrated draws.
        parts = dirichlet_label(labels, 5, 0.01, np.random.default_rng(seed), balance=balance, min_size=0)
        counts = class_counts(labels, parts, 10)
        top_share.append((counts.max(axis=0) / counts.sum(axis=0)).mean())
        classes_held.append(((counts > 2).sum(axis=1)).mean())
    # Each class sits (almost) entirely with one client (Dir(0.01) sometimes splits
    # one between two)...
    assert np.mean(top_share) > 0.93
    # ...so each client holds few of the 10 classes.
    assert max(classes_held) <= 3


def test_dirichlet_balance_caps_sizes():
    # With balance, a client stops receiving once it holds N / num_clients; it can
    # overshoot only with the class that crossed the threshold (<= one class's size).
    labels = balanced_labels(per_class=100)
    for seed in range(5):
        parts = dirichlet_label(labels, 10, 0.1, np.random.default_rng(seed), min_size=0)
        assert max(p.size for p in parts) < 100 + 100


def test_dirichlet_min_size_respected():
    labels = uneven_labels()
    for seed in range(5):
        parts = dirichlet_label(labels, 12, 0.2, np.random.default_rng(seed), min_size=25)
        assert min(p.size for p in parts) >= 25
        assert_exact_cover(parts, labels.size)


def test_dirichlet_impossible_min_size_fails_after_bounded_draws(monkeypatch):
    labels = np.repeat([0, 1], 1000)  # 2 classes, 10 clients: at tiny alpha 8 clients get ~nothing
    calls = []
    real_draw = part_mod._dirichlet_label_draw

    def counting_draw(*args, **kwargs):
        calls.append(1)
        return real_draw(*args, **kwargs)

    monkeypatch.setattr(part_mod, "_dirichlet_label_draw", counting_draw)
    with pytest.raises(PartitionError) as info:
        dirichlet_label(labels, 10, 1e-3, np.random.default_rng(0), min_size=150, max_retries=7)
    assert len(calls) == 8  # the first draw and 7 retries, then it gives up
    message = str(info.value)
    assert "after 8 draws" in message
    assert "min_size=150" in message
    assert "in the last draw client" in message and "had" in message
    assert "larger alpha" in message and "smaller min_size" in message


def test_dirichlet_provably_impossible_min_size_fails_at_once():
    with pytest.raises(PartitionError, match="need 1010 samples, the dataset has 1000"):
        dirichlet_label(balanced_labels(), 10, 1.0, np.random.default_rng(0), min_size=101)


# --------------------------------------------------------------------------- dirichlet prior


def test_dirichlet_prior_equal_sizes_exact():
    labels = uneven_labels()
    n = labels.size
    parts = dirichlet_prior(labels, 7, 0.3, np.random.default_rng(0))
    sizes = np.array([p.size for p in parts])
    expected = np.full(7, n // 7)
    expected[: n % 7] += 1
    assert np.array_equal(sizes, expected)


def test_dirichlet_prior_lognormal_sizes_exact():
    labels = balanced_labels(per_class=100)
    sigma = 0.8
    parts = dirichlet_prior(labels, 10, 0.5, np.random.default_rng(3), unbalanced_sigma=sigma)
    sizes = np.array([p.size for p in parts])
    # The sizes are the generator's first draw (documented), rounded by largest remainder.
    weights = np.random.default_rng(3).lognormal(np.log(100.0), sigma, size=10)
    exact = weights / weights.sum() * labels.size
    assert sizes.sum() == labels.size
    assert np.all(np.abs(sizes - exact) < 1)
    assert sizes.max() > 1.5 * sizes.min()  # really unbalanced at sigma 0.8


def test_dirichlet_prior_small_beta_concentrates_large_beta_spreads():
    labels = balanced_labels(per_class=200)
    skewed = proportions(labels, dirichlet_prior(labels, 10, 0.05, np.random.default_rng(0)), 10)
    spread = proportions(labels, dirichlet_prior(labels, 10, 1e4, np.random.default_rng(0)), 10)
    # Clients' favourite classes collide and run out, so not one class per client,
    # but far from the IID spread.
    assert skewed.max(axis=1).mean() > 0.4
    assert (skewed > 0.01).sum(axis=1).mean() < 6
    assert np.abs(spread - 0.1).max() < 0.08
    assert ((spread > 0.01).sum(axis=1) == 10).all()


def test_dirichlet_prior_uses_up_classes_without_hanging():
    # Tiny beta and a class-poor dataset: clients' preferred classes run out and they
    # draw again over what remains (FedDyn's code would loop forever here).
    labels = np.repeat(np.arange(3), [5, 500, 495])
    parts = dirichlet_prior(labels, 4, 1e-4, np.random.default_rng(0))
    assert_exact_cover(parts, labels.size)
    assert [p.size for p in parts] == [250] * 4


def test_dirichlet_prior_gets_more_heterogeneous_as_beta_falls_through_float64_underflow():
    # From about beta = 0.05 float64 priors underflow to 0; a client whose classes run out
    # redraws its underflowed entries (Dir(beta) over them) instead of spreading by the counts.
    labels = balanced_labels(per_class=100)

    def classes_per_client(beta: float) -> float:
        return float(np.mean([[np.unique(labels[p]).size for p in dirichlet_prior(labels, 10, beta,
                                                                                   np.random.default_rng(s))]
                              for s in range(8)]))

    at = {beta: classes_per_client(beta) for beta in (0.05, 1e-2, 1e-5, 1e-300)}
    assert at[1e-5] <= at[1e-2] <= at[0.05] and at[1e-300] <= at[1e-2], at
    assert at[1e-300] < 4, at  # 6.6 when the remaining class counts placed those samples


# --------------------------------------------------------------------------- shards


def test_shards_one_class_per_shard_when_counts_divide():
    labels = balanced_labels(per_class=100)  # 20 shards of 50: each shard is one class
    parts = shards(labels, 10, 2, np.random.default_rng(0))
    counts = class_counts(labels, parts, 10)
    assert all(p.size == 100 for p in parts)
    assert ((counts > 0).sum(axis=1) <= 2).all()
    assert set(np.unique(counts)) <= {0, 50, 100}


def test_shards_structure_is_exactly_as_documented():
    labels = uneven_labels()  # classes 60..140, shards of ~ N/30 <= 35: each spans <= 2 classes
    s, k = 3, 10
    parts = shards(labels, k, s, np.random.default_rng(4))
    pieces = np.array_split(np.argsort(labels, kind="stable"), k * s)
    owner = {}
    for j, piece in enumerate(pieces):
        owners = {i for i, p in enumerate(parts) if np.isin(piece, p).all()}
        assert len(owners) == 1, "a shard is never split between clients"
        owner[j] = owners.pop()
        assert len(np.unique(labels[piece])) <= 2
    assert sorted(list(owner.values()).count(i) for i in range(k)) == [s] * k
    counts = class_counts(labels, parts, 10)
    assert ((counts > 0).sum(axis=1) <= 2 * s).all()
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= s


MNIST_TRAIN_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)


def mnist_like_labels(seed: int = 0) -> np.ndarray:
    """MNIST's training class counts (60,000 images), shuffled: no count is a multiple of 300."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(10), MNIST_TRAIN_COUNTS))


def expected_class_shards(labels: np.ndarray, per_class: int) -> set[frozenset]:
    """FedNTD's ``sharding_partition`` cut: a class's indices in dataset order, in ``per_class``
    equal runs, the leftover indices appended one each to its first runs."""
    out = set()
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        base = members.size // per_class
        runs = [list(members[i * base:(i + 1) * base]) for i in range(per_class)]
        for i, index in enumerate(members[base * per_class:]):
            runs[i].append(index)
        out.update(frozenset(int(x) for x in run) for run in runs)
    return out


def test_shards_per_class_cuts_each_class_as_the_official_code():
    labels = mnist_like_labels()
    s, k = 2, 100
    parts = shards_per_class(labels, k, s, np.random.default_rng(0))
    assert_exact_cover(parts, labels.size)
    cut = expected_class_shards(labels, s * k // 10)
    used = set()
    for part in parts:
        classes = np.unique(labels[part])
        assert classes.size <= s
        # the client's samples of each class are whole shards of that class (two when it drew it twice)
        pieces = [frozenset(int(x) for x in part[labels[part] == c]) for c in classes]
        for piece in pieces:
            if piece in cut:
                used.add(piece)
            else:
                assert classes.size == 1
                halves = [shard for shard in cut if shard <= piece]
                assert len(halves) == 2 and halves[0] | halves[1] == piece
                used.update(halves)
    assert used == cut
    # McMahan's sort-and-cut on the same counts: some shards span two classes, some clients hold 3.
    sorted_cut = shards(labels, k, s, np.random.default_rng(0))
    assert max(np.unique(labels[p]).size for p in sorted_cut) == 3


def test_shards_per_class_is_seeded_and_checks_its_inputs():
    labels = balanced_labels(per_class=100)
    first = shards_per_class(labels, 10, 2, np.random.default_rng(5))
    again = shards_per_class(labels, 10, 2, np.random.default_rng(5))
    other = shards_per_class(labels, 10, 2, np.random.default_rng(6))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    with pytest.raises(PartitionError, match="7 clients x 2 shards = 14 shards cannot be shared equally by the 10") as info:
        shards_per_class(labels, 7, 2, np.random.default_rng(0))
    assert info.value.advice({"num_clients": "classification.num_clients"}).startswith(
        "a classification.num_clients making clients x shards a multiple of 10")  # the key named, not "a value"
    with pytest.raises(PartitionError, match="class 3 has 4 samples, fewer than its 20 shards"):
        shards_per_class(np.concatenate([labels[labels != 3], [3, 3, 3, 3]]), 50, 4, np.random.default_rng(0))


def test_shards_too_many():
    with pytest.raises(PartitionError, match="more than the 1000 samples"):
        shards(balanced_labels(), 501, 2, np.random.default_rng(0))


# --------------------------------------------------------------------------- counts


def test_class_counts():
    labels = uneven_labels()
    parts = iid(labels, 4, np.random.default_rng(0))
    counts = class_counts(labels, parts, 10)
    assert counts.shape == (4, 10) and counts.dtype == np.int64
    assert np.array_equal(counts.sum(axis=0), np.bincount(labels, minlength=10))
    assert np.array_equal(counts.sum(axis=1), [p.size for p in parts])
    with pytest.raises(PartitionError, match="0..8"):
        class_counts(labels, parts, 9)


def test_noisy_counts_bounds():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 2000, size=(20, 10))
    counts[0, :3] = 0
    noisy = noisy_counts(counts, 0.1, np.random.default_rng(1))
    assert noisy.dtype == np.int64 and noisy.shape == counts.shape
    assert (noisy >= 0).all()
    assert np.all(np.abs(noisy - counts) <= 0.1 * counts + 1e-9)
    assert np.all(noisy[0, :3] == 0)
    assert (noisy != counts).mean() > 0.8  # the noise is real
    spread = np.abs(noisy - counts)[counts > 1000] / counts[counts > 1000]
    assert spread.max() > 0.08  # and uses the whole band
    assert np.array_equal(noisy, noisy_counts(counts, 0.1, np.random.default_rng(1)))
    assert np.array_equal(noisy_counts(counts, 0.0, np.random.default_rng(1)), counts)
    small = np.arange(0, 20)
    assert np.all(np.abs(noisy_counts(small, 0.1, rng) - small) <= 0.1 * small + 1e-9)
    with pytest.raises(PartitionError, match=r"\[0, 1\]"):
        noisy_counts(counts, 1.5, rng)
    with pytest.raises(PartitionError, match="non-negative integers"):
        noisy_counts(np.array([1.5, 2.0]), 0.1, rng)


# --------------------------------------------------------------------------- heat-map


def test_heatmap_small_and_large(tmp_path):
    labels = balanced_labels()
    counts = class_counts(labels, dirichlet_label(labels, 8, 0.5, np.random.default_rng(0)), 10)
    out = save_partition_heatmap(counts, tmp_path / "plots" / "split.png", title="Dir(0.5)")
    assert out == tmp_path / "plots" / "split.png"
    image = cv2.imread(str(out))
    assert image is not None and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] >= 300 and image.shape[1] >= 400
    assert image.std() > 10  # not blank
    big = np.random.default_rng(0).integers(0, 50, size=(100, 100))
    out_big = save_partition_heatmap(big, tmp_path / "big.png", class_names=[f"c{k}" for k in range(100)])
    assert cv2.imread(str(out_big)) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.png", "plots"]  # no temporary files left
    with pytest.raises(PartitionError, match="clients x classes"):
        save_partition_heatmap(np.zeros(5), tmp_path / "bad.png")


@pytest.mark.parametrize("call, words", [
    (lambda y, rng: dirichlet_label(y, 4, "0.5", rng), "alpha must be a positive finite number, got '0.5'"),
    (lambda y, rng: dirichlet_prior(y, 4, None, rng), "beta must be a positive finite number, got None"),
    (lambda y, rng: dirichlet_label(y, 4, 0.5, rng, max_retries=1.5), "must be integers >= 0, got 10 and 1.5"),
    (lambda y, rng: dirichlet_label(y, 4, 0.5, rng, min_size=2.5), "must be integers >= 0, got 2.5 and 100"),
    (lambda y, rng: dirichlet_label(np.where(y == 4, np.inf, y.astype(float)), 4, 0.5, rng),
     "labels must be integers or whole finite numbers, got dtype float64"),
])
def test_a_wrongly_typed_argument_is_a_partition_error(call, words):
    with pytest.raises(PartitionError, match=re.escape(words)):
        call(balanced_labels(per_class=20), np.random.default_rng(0))
