// The step's verdict: whether the update runs and with which unscale/clip
// factor, decided where the gradients are (Backend::step_verdict) from the
// reduced loss slot and the gradients' sum of squares. No host round trip sits
// between backward and the update, so the health check, unscale, clip and the
// update can be captured with the rest of a step; the host reads the verdict
// back once, at the step's end. decide_step is the one definition every
// backend and kernel uses.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace mgpu {

struct StepVerdict {
  double sum_squares = 0.0;  // of the reduced, loss-scaled gradients: NaN/Inf when any is
  double grad_norm = 0.0;    // L2 norm of the mean, unscaled gradient before clipping
  float loss = 0.0f;         // the global mean loss (unscaled)
  float stop = 0.0f;         // how many ranks asked to stop
  float factor = 1.0f;       // unscale and clip, applied by the update as it reads each gradient
  int32_t apply = 0;         // 1: loss and norm finite (and the inputs valid): the update ran
};

// slots: the loss slot and the stop slot after the gradients (MLP::loss_slot()),
// as the allreduce left them. usable: false when the step's gradients cannot
// be trusted whatever their values (the backend found cross-entropy labels out
// of range; the allreduce failed and was aborted): no update then.
// max_norm 0: no clipping. Doubles where the host computed doubles before the
// decision moved to the device, so every backend decides bit for bit alike.
MGPU_HD void decide_step(StepVerdict& v, const float* slots, float loss_scale, float max_norm, bool usable) {
  v.loss = slots[0] / loss_scale;
  v.stop = slots[1];
  v.grad_norm = std::sqrt(v.sum_squares) / loss_scale;
  const bool finite = std::isfinite(v.loss) && std::isfinite(v.grad_norm);
  v.apply = finite && usable ? 1 : 0;
  double factor = 1.0 / loss_scale;
  if (max_norm > 0.0f && v.grad_norm > max_norm) factor *= max_norm / (v.grad_norm + 1e-6);
  v.factor = v.apply ? static_cast<float>(factor) : 0.0f;
}

// A sharded step's health check: each rank's share is kShardSums floats, its
// loss and stop slots and the sum of squares of its shard of the reduced
// gradients as a double's bytes (an all-gather copies them, never adds: the
// double arrives exact); the verdict sums the shares in rank order, in double,
// so every rank decides alike and as the unsharded step does within rounding.
constexpr int kShardSums = 4;
MGPU_HD void write_shard_sums(float* sums, const float* slots, double sum_squares) {
  sums[0] = slots[0];
  sums[1] = slots[1];
  memcpy(sums + 2, &sum_squares, sizeof(double));
}
MGPU_HD void decide_sharded_step(StepVerdict& v, const float* all_sums, int ranks, float loss_scale, float max_norm,
                                 bool usable) {
  double loss = 0.0, stop = 0.0, sum_squares = 0.0;
  for (int r = 0; r < ranks; ++r) {
    const float* s = all_sums + r * kShardSums;
    double shard = 0.0;
    memcpy(&shard, s + 2, sizeof(double));
    loss += s[0];
    stop += s[1];
    sum_squares += shard;
  }
  const float slots[2] = {static_cast<float>(loss), static_cast<float>(stop)};
  v.sum_squares = sum_squares;
  decide_step(v, slots, loss_scale, max_norm, usable);
}

// What an update does with a verdict (nullable: none, the update runs with
// grad_scale): false when the verdict refuses it; otherwise `factor` is the one
// it applies to each gradient. Every backend's update and kernel asks this.
MGPU_HD bool update_runs(const StepVerdict* v, float grad_scale, float& factor) {
  if (v && !v->apply) return false;
  factor = v ? v->factor : grad_scale;
  return true;
}

}  // namespace mgpu
