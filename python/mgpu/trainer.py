"""Trainer: the Python side of data-parallel training.

One call per step into the core (DataParallelStep.step: forward, loss,
backward with bucketed allreduce, update). This file owns the loop around it:
which samples each rank takes, epochs, validation, progress and history.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from . import _core
from .data import Dataset, GlobalBatches, check_dataset_fits, local_slice, split_counts
from .errors import ConfigError
from .model import MLP
from .process_group import ProcessGroup


class Trainer:
    """Data-parallel training of an MLP across the ranks of a ProcessGroup.

    Every rank must construct it (parameters are broadcast from rank 0) and call
    step/fit/evaluate collectively.
    """

    def __init__(self, model: MLP, *, loss: str = "mse", optimizer: str = "sgd", lr: float = 0.01,
                 momentum: float = 0.0, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 process_group: Optional[ProcessGroup] = None, bucket_elems: int = 1 << 20,
                 overlap: bool = True, batch_shares: Optional[Sequence[float]] = None):
        if lr <= 0:
            raise ConfigError(f"learning rate must be > 0, got {lr}")
        self.model = model
        self.loss = loss
        self.lr = float(lr)
        self.pg = process_group or ProcessGroup()
        if batch_shares is not None:
            split_counts(self.pg.size, self.pg.size, batch_shares)  # validates
        self.batch_shares = batch_shares
        self._optimizer = _core.Optimizer(model._core, optimizer, momentum, weight_decay, betas[0], betas[1], eps)
        self._step = _core.DataParallelStep(model._core, self._optimizer, self.pg.communicator(), loss,
                                            bucket_elems, overlap)
        self._step.broadcast_parameters(0)
        self.global_step = 0
        self.history: list = []

    # --- one step ------------------------------------------------------------
    def step(self, x_local: np.ndarray, y_local: np.ndarray, *, global_batch: Optional[int] = None,
             first_sample: Optional[int] = None) -> float:
        """One data-parallel step on this rank's shard; returns the global mean loss.

        global_batch and first_sample (this shard's offset in the global batch)
        are computed with a collective when not given.
        """
        rows = len(x_local)
        if global_batch is None:
            global_batch = self.pg.allreduce(rows)
        if first_sample is None:
            first_sample = self.pg.exscan(rows)
        loss = self._step.step(x_local, y_local, global_batch, first_sample, self.global_step, self.lr)
        self.global_step += 1
        return loss

    # --- evaluation ------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict:
        """Global mean loss (and accuracy for cross-entropy) over a dataset every
        rank holds in full; each rank evaluates a contiguous share."""
        part = local_slice(len(x), self.pg.rank, self.pg.size)
        loss_sum, correct = self.model._core.evaluate(x[part], y[part], self.loss)
        loss_sum, correct = self.pg.allreduce(np.array([loss_sum, float(correct)]))
        denom = len(x) * (self.model.layers[-1] if self.loss == "mse" else 1)
        out = {"loss": float(loss_sum) / max(denom, 1)}
        if self.loss == "cross_entropy":
            out["accuracy"] = float(correct) / max(len(x), 1)
        return out

    # --- the loop --------------------------------------------------------------
    def fit(self, data: Dataset, *, batch_size: int, epochs: Optional[int] = None, steps: Optional[int] = None,
            seed: int = 0, progress: bool = True,
            on_epoch: Optional[Callable[[dict], None]] = None) -> list:
        """Train for `epochs` epochs (or `steps` steps) with global batch `batch_size`.

        Returns the history: one dict per epoch with epoch, train_loss, val_loss
        (and val_accuracy for classification), steps (cumulative), samples,
        seconds (training only, without validation) and samples_per_sec.
        """
        if batch_size < self.pg.size:
            raise ConfigError(f"global batch size {batch_size} is smaller than the number of ranks ({self.pg.size})")
        if (epochs is None) == (steps is None):
            raise ConfigError("give exactly one of epochs or steps")
        check_dataset_fits(data, self.model.layers)
        batches = GlobalBatches(len(data.x_train), batch_size, seed)
        total = steps if steps is not None else epochs * batches.steps_per_epoch
        bar = None
        if progress and self.pg.is_root:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="train")
        done, epoch = 0, 0
        try:
            while done < total:
                loss_sum, samples, t0 = 0.0, 0, time.perf_counter()
                for idx in batches.epoch(epoch):
                    part = local_slice(len(idx), self.pg.rank, self.pg.size, self.batch_shares)
                    mine = idx[part]
                    loss = self.step(data.x_train[mine], data.y_train[mine], global_batch=len(idx),
                                     first_sample=part.start)
                    loss_sum += loss * len(idx)
                    samples += len(idx)
                    done += 1
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", refresh=False)
                    if done >= total:
                        break
                seconds = time.perf_counter() - t0
                entry = {"epoch": epoch + 1, "train_loss": loss_sum / max(samples, 1), "steps": done,
                         "samples": samples, "seconds": seconds,
                         "samples_per_sec": samples / seconds if seconds > 0 else 0.0}
                val = self.evaluate(data.x_val, data.y_val)
                entry["val_loss"] = val["loss"]
                if "accuracy" in val:
                    entry["val_accuracy"] = val["accuracy"]
                self.history.append(entry)
                if on_epoch is not None:
                    on_epoch(entry)
                epoch += 1
        finally:
            if bar is not None:
                bar.close()
        return self.history
