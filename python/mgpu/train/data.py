"""Datasets and sharding.

Datasets: the seeds' synthetic regression set, scikit-learn's digits, and
user data from .npz (arrays ``x`` and ``y``, optional ``x_val``/``y_val``).

Sharding: the samples of global step t depend only on (seed, epoch, t), never
on the number of ranks; each rank takes a contiguous share of that global
batch. Together with exact gradient averaging this makes N ranks train the
same model as one.

Placement: where a step's rows come from. Resident, the training set is copied
to the device once and each epoch's order once, and a step gathers its rows
there; otherwise each step copies its rows from the host.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..npzfile import NpzError, read_npz

MAX_CLASSES = 2**31 - 1  # class labels: the output layer's width is an int32 in the core


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # (n, in) float32
    y_train: np.ndarray  # (n, out) float32 (regression) or (n,) int64 (classification)
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: Optional[int] = None  # set for classification

    @property
    def task(self) -> str:
        return "classification" if self.num_classes is not None else "regression"

    @property
    def in_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def out_features(self) -> int:
        return self.num_classes if self.num_classes is not None else self.y_train.shape[1]

    @property
    def default_loss(self) -> str:
        return "cross_entropy" if self.num_classes is not None else "mse"

    def fingerprint(self) -> str:
        """A SHA-256 of the samples, their shapes and types (what a resumed run must
        train on again, whatever path names the file)."""
        h = hashlib.sha256()
        for a in (self.x_train, self.y_train, self.x_val, self.y_val):
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape};".encode())
            h.update(a)  # its bytes, uncopied (an empty array too)
        return h.hexdigest()


def synthetic_regression(n: int = 10000, in_features: int = 50, out_features: int = 3, seed: int = 42) -> tuple:
    """Seed 001's benchmark set (n x 50 standard-normal features, 3 targets, seed 42).

    The seed draws targets as pure noise, which no model can learn; here they
    come from a fixed random teacher network plus noise, so loss curves mean
    something while the shapes and the cost per sample stay the seed's.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, in_features), dtype=np.float32)
    hidden = 32
    w1 = rng.standard_normal((in_features, hidden), dtype=np.float32) / np.sqrt(in_features)
    w2 = rng.standard_normal((hidden, out_features), dtype=np.float32) / np.sqrt(hidden)
    y = np.tanh(x @ w1) @ w2 + 0.1 * rng.standard_normal((n, out_features), dtype=np.float32)
    return x, y.astype(np.float32)


def _digits() -> tuple:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError("the digits dataset needs scikit-learn (pip install scikit-learn)") from e
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def _read_npz(path: str) -> dict:
    if not os.path.exists(path):
        raise DataError(f"dataset file '{path}' does not exist")
    if not os.path.isfile(path):  # a directory, or a FIFO that would block the read
        raise DataError(f"dataset '{path}' is not a regular file")
    try:
        return read_npz(path)
    except NpzError as e:
        raise DataError(f"cannot read dataset '{path}': {e}") from None
    except OSError as e:
        raise DataError(f"cannot read dataset '{path}': {e.strerror}") from None


def _check_arrays(name: str, x, y) -> tuple:
    """Validated (x float32 (n, in), y float32 (n, out) or int64 (n,), num_classes)."""
    x = np.asarray(x)
    y = np.asarray(y)
    if x.dtype.kind not in "fiu" or x.ndim != 2:
        raise DataError(f"{name}: x must be a 2-D numeric array (samples, features), got {x.ndim}-D {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"{name}: dataset is empty (x has shape {x.shape})")
    if y.shape[:1] != x.shape[:1]:
        raise DataError(f"{name}: x has {x.shape[0]} samples but y has {y.shape[0] if y.ndim else 0}")
    x = _as_float32(name, "x", x)
    if y.dtype.kind in "iu" and y.ndim == 1:
        if y.min() < 0:
            raise DataError(f"{name}: class labels must be >= 0, found {int(y.min())}")
        if int(y.max()) >= MAX_CLASSES:  # the output layer has a unit per class (and uint64 2**63 would wrap)
            raise DataError(
                f"{name}: class labels must be < {MAX_CLASSES:,} (one output unit each), found {int(y.max())}"
            )
        return x, y.astype(np.int64), int(y.max()) + 1
    if y.dtype.kind == "b" or y.dtype.kind not in "fiu":
        raise DataError(f"{name}: y must be integer class labels (1-D) or float targets, got {y.dtype}")
    y = _as_float32(name, "y", y).reshape(len(y), -1)
    if y.shape[1] == 0:
        raise DataError(f"{name}: y has no target columns")
    return x, y, None


def _as_float32(name: str, what: str, a: np.ndarray) -> np.ndarray:
    """`a` as float32, refused where a value is NaN or Inf or a finite one would become Inf."""
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise DataError(f"{name}: {what} contains NaN or Inf")
    with np.errstate(over="ignore"):  # said in the error below, not as a RuntimeWarning beside it
        cast = a.astype(np.float32, copy=False)
    if not np.isfinite(cast).all():
        big = float(np.max(np.abs(a[~np.isfinite(cast)])))
        raise DataError(
            f"{name}: {what} has values beyond float32's range (|{what}| up to {big:.3g}; "
            f"at most {float(np.finfo(np.float32).max):.3g}): scale them"
        )
    return cast


def _split(x, y, val_fraction: float, seed: int) -> tuple:
    n = len(x)
    if n < 2:
        raise DataError(f"dataset has {n} sample(s); need at least 2 for a train/validation split")
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(n - 1, max(1, int(round(n * val_fraction))))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def load_dataset(
    spec: str,
    *,
    in_features: Optional[int] = None,
    out_features: Optional[int] = None,
    val_fraction: float = 0.2,
    seed: int = 42,
    samples: Optional[int] = None,
) -> Dataset:
    """'synthetic' (sized to in/out_features when given), 'digits', or a .npz path."""
    if spec == "synthetic":
        x, y = synthetic_regression(samples or 10000, in_features or 50, out_features or 3)
        x, y, classes = _check_arrays(spec, x, y)
        return Dataset(spec, *_split(x, y, val_fraction, seed), num_classes=classes)
    if spec == "digits":
        x, y = _digits()
        x, y, classes = _check_arrays(spec, x, y)
        return Dataset(spec, *_split(x, y, val_fraction, seed), num_classes=classes)
    if not spec.endswith(".npz"):
        raise DataError(f"unknown dataset '{spec}' (expected synthetic, digits or a .npz path)")
    arrays = _read_npz(spec)
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{spec}: missing array '{key}' (found: {', '.join(sorted(arrays)) or 'none'})")
    x, y, classes = _check_arrays(spec, arrays["x"], arrays["y"])
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise DataError(f"{spec}: give both x_val and y_val, or neither")
    if "x_val" in arrays:
        xv, yv, classes_v = _check_arrays(f"{spec} (validation)", arrays["x_val"], arrays["y_val"])
        if xv.shape[1] != x.shape[1]:
            raise DataError(f"{spec}: x_val has {xv.shape[1]} features but x has {x.shape[1]}")
        if (classes is None) != (classes_v is None) or (classes is None and yv.shape[1] != y.shape[1]):
            raise DataError(f"{spec}: y_val does not match y's kind or shape")
        if classes is not None:
            classes = max(classes, classes_v)
        return Dataset(spec, x, y, xv, yv, num_classes=classes)
    return Dataset(spec, *_split(x, y, val_fraction, seed), num_classes=classes)


def check_dataset_fits(ds: Dataset, sizes: Sequence[int]) -> None:
    if ds.in_features != sizes[0]:
        raise DataError(f"dataset '{ds.name}' has {ds.in_features} features but the model expects {sizes[0]}")
    if ds.num_classes is not None and ds.num_classes > sizes[-1]:
        raise DataError(
            f"dataset '{ds.name}' has labels up to {ds.num_classes - 1} but the model has {sizes[-1]} outputs"
        )
    if ds.num_classes is None and ds.y_train.shape[1] != sizes[-1]:
        raise DataError(f"dataset '{ds.name}' has {ds.y_train.shape[1]} targets but the model has {sizes[-1]} outputs")


def split_counts(total: int, world: int, shares: Optional[Sequence[float]] = None) -> list:
    """Rows per rank for a global batch of `total`: equal (the first total % world
    ranks get one more), or proportional to `shares` (largest remainder)."""
    if world < 1:
        raise ConfigError("world size must be >= 1")
    if shares is None:
        base, extra = divmod(total, world)
        return [base + (r < extra) for r in range(world)]
    s = np.asarray(shares, dtype=np.float64)
    if len(s) != world or not np.isfinite(s).all() or (s < 0).any() or s.max(initial=0.0) <= 0:
        raise ConfigError(f"need {world} non-negative batch shares (finite, with a positive sum), got {list(shares)}")
    w = s / s.max()  # first to <= 1: a sum of shares near the float limit would overflow to inf
    w /= w.sum()
    exact = w * total
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts.tolist()


class GlobalBatches:
    """The global batches of each epoch: a seeded permutation cut into batches
    of batch_size (the last one may be smaller)."""

    def __init__(self, n_samples: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n_samples, batch_size, seed

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of the samples (int64)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def starts(self) -> range:
        """Where each global batch starts in the epoch's order."""
        return range(0, self.n, self.batch_size)

    def epoch(self, epoch: int) -> Iterator[np.ndarray]:
        order = self.order(epoch)
        for start in self.starts():
            yield order[start : start + self.batch_size]


# A Trainer's auto places a training set on a GPU when it takes at most this share of the free
# memory left once the model is built: the rest is for what the first steps allocate
# (activations, optimizer state, communication buffers). `train` decides with its memory
# model instead, and `bench` counts its batches in its memory check.
RESIDENT_SHARE = 0.5


def resident_bytes(rows: int, in_features: int, out_features: int, classification: bool) -> int:
    """Device memory a resident training set takes: x, targets (float32) or labels (int32),
    and the epoch's order (int64)."""
    return rows * (4 * in_features + (4 if classification else 4 * out_features) + 8)


def place_training_set(mode: str, *, device: str, data_bytes: float, free_bytes: float) -> tuple:
    """(resident, why) for a training set of data_bytes under --data-on-device `mode`:
    'off' never; 'on' always (ConfigError where a GPU's free memory cannot hold it); 'auto'
    on a GPU where it takes at most RESIDENT_SHARE of free_bytes, never on CPUs (their
    backend reads the host's memory already: the gather is what NumPy's indexing does)."""
    size = f"{data_bytes / 1e6:.3g} MB"
    if mode == "off":
        return False, "--data-on-device off"
    if device != "cuda":
        if mode == "on":
            return True, f"--data-on-device on: {size} in the CPU backend's memory"
        return False, "a CPU backend reads the host's memory: each step's rows are indexed there"
    if mode == "on":
        if data_bytes > free_bytes:
            raise ConfigError(
                f"--data-on-device on: the training set ({size}) does not fit the GPU's "
                f"{free_bytes / 1e6:.3g} MB of free memory; use --data-on-device auto or off"
            )
        return True, f"--data-on-device on: {size}"
    if data_bytes <= RESIDENT_SHARE * free_bytes:
        return True, f"auto: {size}, at most {RESIDENT_SHARE:.0%} of the GPU's {free_bytes / 1e6:.3g} MB free"
    return False, f"auto: {size} would take more than {RESIDENT_SHARE:.0%} of the GPU's {free_bytes / 1e6:.3g} MB free"


def local_slice(global_rows: int, rank: int, world: int, shares=None) -> slice:
    """This rank's contiguous share of a global batch of global_rows."""
    counts = split_counts(global_rows, world, shares)
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])
