"""mgpu.MLP: the native MLP with a NumPy-facing API in PyTorch nn.Linear layout.

Parameters and gradients are lists [W0 (out, in), b0 (out,), W1, b1, ...]
of float32 arrays (copies of the core's flat buffers).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Sequence

import numpy as np

from .._runtime import _core
from ..atomic import atomic_file
from ..errors import ConfigError, DataError
from ..npzfile import NpzError, read_npz

try:  # optional: `--save PATH.safetensors` and MLP.load of one
    import safetensors.numpy as safetensors_numpy
    from safetensors import SafetensorError
except ImportError:
    safetensors_numpy = None
    SafetensorError = ValueError

SAFETENSORS_SUFFIX = ".safetensors"


class MLP:
    """Linear layers with ReLU (and optional dropout) between them.

    layers: [in, hidden..., out]. Initialisation follows nn.Linear's default
    distribution, drawn from a counter-based RNG keyed by `seed`: identical on
    every rank and every backend.
    """

    def __init__(
        self,
        layers: Sequence[int],
        *,
        seed: int = 0,
        dropout: float = 0.0,
        device: str = "cpu",
        device_index: int = 0,
        threads: Optional[int] = None,
        precision: str = "fp32",
    ):
        layers = list(layers)
        if len(layers) < 2 or not all(isinstance(s, (int, np.integer)) and s >= 1 for s in layers):
            raise ConfigError(f"layers must be >= 2 positive integers [in, hidden..., out], got {layers}")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.device, self.device_index = device, int(device_index)
        self._backend = _core.make_backend(device, device_index, threads or 0)
        self._backend.precision = precision  # ConfigError where the backend cannot (the CPU: fp32 only)
        self._core = _core.MLP(self._backend, [int(s) for s in layers], float(dropout), int(seed))
        self.layers = [int(s) for s in layers]
        self._offsets = self._core.layer_offsets()

    @property
    def num_params(self) -> int:
        return self._core.num_params

    @property
    def seed(self) -> int:
        return int(self._core.seed)

    @property
    def dropout(self) -> float:
        return self._core.dropout

    @property
    def threads(self) -> int:
        return self._backend.threads

    @threads.setter
    def threads(self, n: int) -> None:
        self._backend.threads = n

    def _shapes(self):
        for i in range(len(self.layers) - 1):
            yield (self.layers[i + 1], self.layers[i]), (self.layers[i + 1],)

    def _split(self, flat: np.ndarray) -> list:
        out = []
        for (w_off, b_off), (w_shape, b_shape) in zip(self._offsets, self._shapes()):
            out.append(flat[w_off:b_off].reshape(w_shape))
            out.append(flat[b_off : b_off + b_shape[0]])
        return out

    def get_parameters(self) -> list:
        return self._split(self._core.get_parameters())

    def set_parameters(self, params: Sequence[np.ndarray]) -> None:
        expected = [s for pair in self._shapes() for s in pair]
        params = list(params)
        if len(params) != len(expected):
            raise ConfigError(f"expected {len(expected)} arrays (weight and bias per layer), got {len(params)}")
        for i, (p, shape) in enumerate(zip(params, expected)):
            if np.shape(p) != shape:
                raise ConfigError(f"parameter {i} has shape {np.shape(p)}, expected {shape}")
        self._core.set_parameters(np.concatenate([np.asarray(p, np.float32).ravel() for p in params]))

    def get_gradients(self) -> list:
        """The gradient buffer, per parameter. After loss_and_grad(): that batch's gradient.
        After a Trainer step: the global mean gradient as reduced, before unscaling and
        clipping (both are applied inside the optimizer update), so multiplied by the loss
        scale when one is active; the step's unscaled, unclipped norm is in
        Trainer.last_result.grad_norm."""
        return self._split(self._core.get_gradients())

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Evaluation-mode output (no dropout), shape (rows, out)."""
        return self._core.forward(np.asarray(x))

    __call__ = forward

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray, loss: str = "mse", *, step: int = 0) -> float:
        """Mean loss of the batch; fills the gradients (get_gradients()) without stepping.

        y: float targets (rows, out) for 'mse', integer class indices (rows,) for
        'cross_entropy'. Dropout, when the model has it, is active and keyed by step.
        """
        return self._core.loss_and_grad(np.asarray(x), np.asarray(y), loss, step, 0)

    # --- files ---------------------------------------------------------------
    def state_dict(self) -> dict:
        params = self.get_parameters()
        return {f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}": p for i, p in enumerate(params)}

    def save(self, path: str) -> None:
        """Write the parameters (layers.{i}.weight / layers.{i}.bias, nn.Linear's layout),
        atomically: as .npz, or as safetensors where the path ends in .safetensors (what
        safetensors.torch.load_file reads straight into a torch.nn.Sequential's state)."""
        check_parameter_format(path)
        state = self.state_dict()
        with _parameter_file(path) as f:
            if str(path).endswith(SAFETENSORS_SUFFIX):
                f.write(safetensors_numpy.save(state))
            else:
                np.savez(f, **state)

    def load(self, path: str) -> None:
        """Load parameters saved by save(), .npz or .safetensors (neither unpickles)."""
        try:
            arrays = _read_safetensors(path) if str(path).endswith(SAFETENSORS_SUFFIX) else read_npz(path)
        except NpzError as e:
            raise DataError(f"cannot read parameters from '{path}': {e}") from None
        except OSError as e:
            raise DataError(f"cannot read parameters from '{path}': {e.strerror}") from None
        names = list(self.state_dict())
        missing = [n for n in names if n not in arrays]
        if missing:
            raise DataError(f"'{path}' does not hold this model's parameters (missing {missing[0]})")
        self.set_parameters([arrays[n] for n in names])

    def __repr__(self) -> str:
        return f"MLP(layers={self.layers}, params={self.num_params:,}, dropout={self.dropout}, device={self.device})"


def check_parameter_format(path) -> None:
    """ConfigError when `path` names a format this installation cannot write or read."""
    if str(path).endswith(SAFETENSORS_SUFFIX) and safetensors_numpy is None:
        raise ConfigError(f"'{path}': .safetensors files need the safetensors package (pip install safetensors)")


def _read_safetensors(path) -> dict:
    """The tensors of a .safetensors file as NumPy arrays; NpzError-worded reasons for a bad file."""
    check_parameter_format(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return safetensors_numpy.load(raw)
    except (SafetensorError, ValueError, TypeError) as e:
        raise NpzError(
            f"not a readable safetensors file ({str(e).splitlines()[0] if str(e) else 'malformed'})"
        ) from None


@contextlib.contextmanager
def _parameter_file(path: str):
    """A binary file that replaces `path` whole or not at all (a temporary in the same
    directory, fsynced, then renamed): a crash leaves the old file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"cannot save to '{path}': directory '{directory}' does not exist")
    with atomic_file(path, binary=True) as f:
        yield f
