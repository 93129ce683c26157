"""Validated configuration, datasets and sharding."""

import warnings

import numpy as np
import pytest

import mgpu
from mgpu.train.data import GlobalBatches, load_dataset, local_slice, split_counts


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch size"),
        (dict(batch_size=-4), "batch size"),
        (dict(batch_size=2.5), "batch size"),
        (dict(layers=[]), "at least an input and an output"),
        (dict(layers=[10]), "at least an input and an output"),
        (dict(layers=[10, 0, 3]), "positive integer"),
        (dict(model="huge"), "unknown model preset 'huge'"),
        (dict(lr=0), "learning rate"),
        (dict(lr=-1e-3), "learning rate"),
        (dict(lr=float("nan")), "learning rate"),
        (dict(optimizer="lbfgs"), "unknown optimizer 'lbfgs'"),
        (dict(loss="hinge"), "unknown loss 'hinge'"),
        (dict(device="tpu"), "unknown device 'tpu'"),
        (dict(dataset="imagenet"), "unknown dataset 'imagenet'"),
        (dict(epochs=0), "epochs"),
        (dict(epochs=None, steps=0), "steps"),
        (dict(momentum=1.0), "momentum"),
        (dict(dropout=1.0), "dropout"),
        (dict(threads=0), "threads"),
        (dict(weight_decay=-1), "weight decay"),
        (dict(bucket_mb=0), "bucket"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_config_is_rejected_at_construction(kwargs, match):
    with pytest.raises(mgpu.ConfigError, match=match):
        mgpu.TrainConfig(**kwargs)


def test_batch_smaller_than_world_is_rejected():
    cfg = mgpu.TrainConfig(batch_size=2)
    cfg.validate(world_size=2)
    with pytest.raises(mgpu.ConfigError, match="smaller than the number of ranks"):
        cfg.validate(world_size=3)


def test_presets_and_layer_sizes():
    assert mgpu.TrainConfig(model="medium").layer_sizes(50, 3) == [50, 256, 128, 64, 3]
    assert mgpu.TrainConfig(model="large").layer_sizes(50, 3) == [50, 1024, 1024, 512, 512, 256, 3]
    xl = mgpu.TrainConfig(model="xl")
    sizes = xl.layer_sizes(4096, 512)
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    assert 110e6 < params < 130e6
    with pytest.raises(mgpu.ConfigError, match="4096 inputs"):
        xl.layer_sizes(64, 512)
    with pytest.raises(mgpu.ConfigError, match="dataset has 64 features"):
        mgpu.TrainConfig(layers=[50, 3]).layer_sizes(64, 3)


@pytest.mark.parametrize("total, world", [(1, 1), (7, 3), (23, 2), (23, 3), (5, 5), (1024, 7)])
def test_split_counts_equal(total, world):
    c = split_counts(total, world)
    assert sum(c) == total and max(c) - min(c) <= 1 and c == sorted(c, reverse=True)


def test_split_counts_shares():
    assert split_counts(10, 2, [0.7, 0.3]) == [7, 3]
    c = split_counts(1001, 3, [5, 3, 2])
    assert sum(c) == 1001 and abs(c[0] - 500.5) <= 1
    with pytest.raises(mgpu.ConfigError, match="2 non-negative batch shares"):
        split_counts(10, 2, [1.0])


def test_global_batches_do_not_depend_on_world_size():
    gb = GlobalBatches(103, 20, seed=4)
    batches = list(gb.epoch(0))
    assert gb.steps_per_epoch == 6 and [len(b) for b in batches] == [20] * 5 + [3]
    assert sorted(np.concatenate(batches)) == list(range(103))
    assert not np.array_equal(np.concatenate(list(gb.epoch(1))), np.concatenate(batches))
    for world in (1, 2, 3):
        pieces = [b[local_slice(len(b), r, world)] for b in batches for r in range(world)]
        assert np.array_equal(np.concatenate(pieces), np.concatenate(batches))


def test_synthetic_and_digits():
    s = load_dataset("synthetic")
    assert s.x_train.shape == (8000, 50) and s.y_train.shape == (8000, 3) and len(s.x_val) == 2000
    assert s.task == "regression" and s.x_train.dtype == np.float32
    assert np.array_equal(s.x_train, load_dataset("synthetic").x_train)
    sized = load_dataset("synthetic", in_features=20, out_features=7, samples=100)
    assert sized.in_features == 20 and sized.out_features == 7
    d = load_dataset("digits")
    assert d.task == "classification" and d.num_classes == 10 and d.in_features == 64
    assert d.x_train.max() <= 1.0


def test_npz_datasets(tmp_path):
    rng = np.random.default_rng(0)
    good = tmp_path / "good.npz"
    np.savez(good, x=rng.standard_normal((30, 4)), y=rng.integers(0, 3, 30))
    ds = load_dataset(str(good))
    assert ds.num_classes == 3 and len(ds.x_train) + len(ds.x_val) == 30
    reg = tmp_path / "reg.npz"
    np.savez(
        reg,
        x=rng.standard_normal((30, 4)),
        y=rng.standard_normal(30),
        x_val=rng.standard_normal((5, 4)),
        y_val=rng.standard_normal(5),
    )
    r = load_dataset(str(reg))
    assert r.y_train.shape == (30, 1) and r.x_val.shape == (5, 4)


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(x=np.zeros((0, 3)), y=np.zeros(0)), "empty"),
        (dict(x=np.array([[np.nan, 1.0]]), y=np.zeros(1)), "NaN or Inf"),
        (dict(x=np.ones((4, 2)), y=np.array([np.inf, 1, 2, 3])), "NaN or Inf"),
        (
            dict(x=np.array([[1e39, 1.0], [0.0, 1.0]]), y=np.zeros(2)),
            r"x has values beyond float32's range \(\|x\| up to 1e\+39",
        ),
        (
            dict(x=np.ones((2, 2)), y=np.array([1.0, -4e38])),
            r"y has values beyond float32's range \(\|y\| up to 4e\+38",
        ),
        (dict(x=np.ones((4, 2)), y=np.array([0, -1, 2, 3])), ">= 0"),
        (dict(x=np.ones((4, 2)), y=np.zeros(3)), "4 samples but y has 3"),
        (dict(x=np.ones(4), y=np.zeros(4)), "2-D"),
        (dict(y=np.zeros(4)), "missing array 'x'"),
        (dict(x=np.ones((4, 2)), y=np.array(["a", "b", "c", "d"])), "float targets"),
        (dict(x=np.ones((1, 2)), y=np.zeros(1)), "at least 2"),
    ],
)
def test_bad_npz_is_a_data_error(tmp_path, arrays, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error is the one line said: no RuntimeWarning beside it
        with pytest.raises(mgpu.DataError, match=match):
            load_dataset(str(path))


def test_unreadable_or_missing_file(tmp_path):
    with pytest.raises(mgpu.DataError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(mgpu.DataError, match="cannot read"):
        load_dataset(str(junk))


# --- a user's .npz: what each check guards (each fails on a mutation of data.py) ----
def _npz(tmp_path, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return str(path)


def test_a_label_at_the_int32_limit_is_refused(tmp_path):
    from mgpu.train.data import MAX_CLASSES

    y = np.zeros(4, np.int64)
    y[0] = MAX_CLASSES
    with pytest.raises(mgpu.DataError, match="class labels must be <"):
        load_dataset(_npz(tmp_path, x=np.ones((4, 2)), y=y))


def test_boolean_targets_are_refused(tmp_path):
    with pytest.raises(mgpu.DataError, match="float targets"):
        load_dataset(_npz(tmp_path, x=np.ones((4, 2)), y=np.array([True, False, True, False])))


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_a_split_keeps_a_sample_on_each_side(tmp_path, fraction):
    rng = np.random.default_rng(0)
    ds = load_dataset(_npz(tmp_path, x=rng.standard_normal((40, 3)), y=rng.standard_normal(40)), val_fraction=fraction)
    assert len(ds.x_train) >= 1 and len(ds.x_val) >= 1 and len(ds.x_train) + len(ds.x_val) == 40


@pytest.mark.parametrize(
    "val, match",
    [
        (dict(x_val=np.ones((2, 2))), "both x_val and y_val"),
        (dict(x_val=np.ones((2, 3)), y_val=np.zeros(2)), "x_val has 3 features"),
    ],
)
def test_validation_arrays_must_come_together_and_fit(tmp_path, val, match):
    with pytest.raises(mgpu.DataError, match=match):
        load_dataset(_npz(tmp_path, x=np.ones((4, 2)), y=np.zeros(4), **val))


@pytest.mark.parametrize(
    "y, y_val",
    [
        (np.array([0, 1, 0, 1]), np.array([0.5, 1.5])),  # labels, then floats
        (np.zeros((4, 3)), np.zeros((2, 2))),
    ],
)  # 3 targets, then 2
def test_validation_targets_must_be_of_the_training_targets_kind(tmp_path, y, y_val):
    with pytest.raises(mgpu.DataError, match="y_val does not match"):
        load_dataset(_npz(tmp_path, x=np.ones((4, 2)), y=y, x_val=np.ones((2, 2)), y_val=y_val))


def test_the_classes_cover_the_validation_labels(tmp_path):
    ds = load_dataset(
        _npz(tmp_path, x=np.ones((4, 2)), y=np.array([0, 1, 2, 0]), x_val=np.ones((2, 2)), y_val=np.array([4, 0]))
    )
    assert ds.num_classes == 5


def test_shares_split_by_largest_remainder_and_refuse_negatives():
    assert split_counts(1001, 3, [5, 3, 2]) == [501, 300, 200]
    assert split_counts(3, 2, [0.9, 0.1]) == [3, 0]
    with pytest.raises(mgpu.ConfigError, match="non-negative"):
        split_counts(10, 2, [2.0, -1.0])
