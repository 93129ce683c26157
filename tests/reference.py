"""Float64 NumPy reference of the MLP, its losses and optimizers (PyTorch
definitions), used to check the core's kernels and step logic."""

import numpy as np


def forward(params, x, masks=None):
    """params: [W0, b0, ...] (nn.Linear layout); masks[l]: keep-mask * 1/(1-p) or None.
    Returns the list of layer outputs (post-activation for hidden layers)."""
    h = np.asarray(x, np.float64)
    outs = []
    n_layers = len(params) // 2
    for l in range(n_layers):
        w, b = np.asarray(params[2 * l], np.float64), np.asarray(params[2 * l + 1], np.float64)
        z = h @ w.T + b
        if l + 1 < n_layers:
            z = np.maximum(z, 0.0)
            if masks is not None and masks[l] is not None:
                z = z * masks[l]
        outs.append(z)
        h = z
    return outs


def mse(pred, y):
    d = pred - y
    return np.mean(d * d), 2.0 * d / d.size


def cross_entropy(logits, labels):
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(labels)
    loss = -logp[np.arange(n), labels].mean()
    g = np.exp(logp)
    g[np.arange(n), labels] -= 1.0
    return loss, g / n


def loss_and_grad(params, x, y, loss, masks=None):
    outs = forward(params, x, masks)
    value, dout = mse(outs[-1], y) if loss == "mse" else cross_entropy(outs[-1], y)
    grads = [None] * len(params)
    n_layers = len(params) // 2
    for l in reversed(range(n_layers)):
        inp = np.asarray(x, np.float64) if l == 0 else outs[l - 1]
        grads[2 * l] = dout.T @ inp
        grads[2 * l + 1] = dout.sum(axis=0)
        if l > 0:
            dinp = dout @ np.asarray(params[2 * l], np.float64)
            # through ReLU (and dropout): the output is positive iff the unit passed
            scale = masks[l - 1] if masks is not None and masks[l - 1] is not None else 1.0
            dout = dinp * (outs[l - 1] > 0) * scale
    return value, grads


class SGD:
    def __init__(self, lr, momentum=0.0, weight_decay=0.0):
        self.lr, self.momentum, self.wd, self.buf = lr, momentum, weight_decay, None

    def step(self, params, grads):
        out = []
        if self.buf is None:
            self.buf = [None] * len(params)
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g + self.wd * p
            if self.momentum > 0:
                self.buf[i] = g if self.buf[i] is None else self.momentum * self.buf[i] + g
                g = self.buf[i]
            out.append(p - self.lr * g)
        return out


class AdamW:
    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.t, self.m, self.v = 0, None, None

    def step(self, params, grads):
        self.t += 1
        if self.m is None:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        out = []
        bc1, bc2 = 1 - self.b1**self.t, 1 - self.b2**self.t
        for i, (p, g) in enumerate(zip(params, grads)):
            p = p * (1 - self.lr * self.wd)
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            denom = np.sqrt(self.v[i]) / np.sqrt(bc2) + self.eps
            out.append(p - (self.lr / bc1) * self.m[i] / denom)
        return out


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compressed_reference(x, dtype):
    """x rounded to bf16 or fp16 (nearest even) and back, in NumPy."""
    if dtype == "fp16":
        with np.errstate(over="ignore"):  # beyond fp16's range: +-Inf, as the kernels give
            return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, rounded)


COMPRESSION_CASES = np.array(
    [
        0.0,
        -0.0,
        1.0,
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        65504.0,
        65520.0,
        -65536.0,
        2.0**-24,
        2.0**-25,
        3e-8,
        3.0e38,
        np.inf,
        -np.inf,
        np.nan,
    ],
    np.float32,
)
