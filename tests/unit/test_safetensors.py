"""Parameters saved as safetensors (`train --save PATH.safetensors`, MLP.save): mgpu loads
them back, and PyTorch's safetensors.torch.load_file puts them straight into the matching
torch.nn layers (run with the PyTorch peer's interpreter, which has torch)."""

import json
import os
import subprocess

import numpy as np
import pytest

import mgpu
from conftest import run_cli
from mgpu.calibrate.bench import torch_python
from mgpu.errors import DataError

safetensors = pytest.importorskip("safetensors", reason="setup.sh installs the safetensors extra")

LAYERS = [5, 16, 8, 3]


def test_safetensors_round_trip_and_layout(tmp_path):
    model = mgpu.MLP(LAYERS, seed=4)
    path = tmp_path / "model.safetensors"
    model.save(str(path))
    tensors = safetensors.numpy.load_file(str(path))
    assert sorted(tensors) == sorted(model.state_dict())
    for name, array in model.state_dict().items():
        assert tensors[name].dtype == np.float32 and np.array_equal(tensors[name], array)
    other = mgpu.MLP(LAYERS, seed=9)
    other.load(str(path))
    x = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    assert np.array_equal(other.forward(x), model.forward(x))


def test_a_bad_safetensors_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not tensors")
    with pytest.raises(DataError, match=r"cannot read parameters from .*bad\.safetensors.*not a readable safetensors"):
        mgpu.MLP(LAYERS).load(str(bad))


TORCH_LOADS = """
import json, sys
import torch
from safetensors.torch import load_file
layers, path, x = json.loads(sys.argv[1]), sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
mods = []
for i in range(len(layers) - 1):
    mods.append(torch.nn.Linear(layers[i], layers[i + 1]))
    if i + 2 < len(layers):
        mods.append(torch.nn.ReLU())
net = torch.nn.Sequential(*mods)
state = {f"{2 * int(k.split('.')[1])}.{k.split('.')[2]}": v for k, v in load_file(path).items()}
net.load_state_dict(state)
print(json.dumps(net(x).tolist()))
"""


def test_train_saves_safetensors_that_torch_loads_into_its_layers(tmp_path):
    py = torch_python()
    if py is None:
        pytest.skip("no Python with torch here (scripts/setup.sh with MGPU_SETUP_TORCH_PEER=1 installs Debian's)")
    path = tmp_path / "trained.safetensors"
    layers = ",".join(map(str, LAYERS))
    r = run_cli(["train", "--layers", layers, "--steps", "3", "--batch-size", "16", "--no-progress", "--save", path])
    assert r.returncode == 0, r.stderr
    model = mgpu.MLP(LAYERS)
    model.load(str(path))
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    # the venv's safetensors package beside the peer's own torch (an abi3 extension: any CPython >= 3.10)
    site = tmp_path / "site"
    site.mkdir()
    os.symlink(os.path.dirname(safetensors.__file__), site / "safetensors")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [py, "-c", TORCH_LOADS, json.dumps(LAYERS), str(path), json.dumps(x.tolist())],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    np.testing.assert_allclose(np.array(json.loads(out.stdout)), model.forward(x), rtol=1e-5, atol=1e-6)
