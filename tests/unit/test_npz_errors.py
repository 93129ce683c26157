"""Every .npz mgpu reads (datasets, checkpoints, saved parameters) refuses a malformed file
with one line in mgpu's words, naming the file, never numpy's or pickle's advice to load
it unsafely."""

import numpy as np
import pytest

import mgpu
from mgpu.errors import DataError
from mgpu.train.checkpoint import CheckpointError, load_checkpoint


def _good(path):
    np.savez(path, x=np.zeros((4, 3), np.float32), y=np.zeros((4, 2), np.float32))
    return path


def _object_array(path):
    np.savez(path, x=np.array([{"a": 1}, None], dtype=object), y=np.zeros(2, np.float32))
    return path


def _truncated(path):
    raw = _good(path).read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


def _text(path):
    path.write_text("x,y\n1,2\n")
    return path


def _empty(path):
    path.write_bytes(b"")
    return path


def _npy(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3))
    return path


FILES = [
    (_text, "not a NumPy .npz archive"),
    (_truncated, "corrupt or truncated"),
    (_object_array, "'x' holds Python objects; mgpu reads numeric arrays only"),
    (_empty, "the file is empty"),
    (_npy, "a single .npy array, not an .npz archive"),
]
READERS = [
    ("dataset", lambda p: mgpu.load_dataset(str(p)), DataError, "cannot read dataset"),
    ("checkpoint", lambda p: load_checkpoint(str(p)), CheckpointError, "cannot read checkpoint"),
    ("parameters", lambda p: mgpu.MLP([3, 2]).load(str(p)), DataError, "cannot read parameters from"),
]


@pytest.mark.parametrize("make, reason", FILES, ids=[m.__name__[1:] for m, _ in FILES])
@pytest.mark.parametrize("what, read, error, prefix", READERS, ids=[r[0] for r in READERS])
def test_a_malformed_npz_is_refused_in_mgpus_words(tmp_path, make, reason, what, read, error, prefix):
    path = make(tmp_path / "data.npz")
    with pytest.raises(error) as info:
        read(path)
    message = str(info.value)
    assert message.startswith(f"{prefix} '{path}'") and reason in message, message
    assert "\n" not in message
    for advice in ("allow_pickle", "pickle.load", "unsafely", "trust"):
        assert advice not in message, message


def test_a_well_formed_archive_still_reads(tmp_path):
    data = mgpu.load_dataset(str(_good(tmp_path / "good.npz")))
    assert data.x_train.shape[1] == 3
