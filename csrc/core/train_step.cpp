// The data-parallel training step (see train_step.h).
#include "train_step.h"

#include <algorithm>
#include <cmath>

#include "errors.h"

namespace mgpu {

std::vector<Bucket> plan_buckets(const MLP& model, size_t bucket_elems) {
  MGPU_CHECK(bucket_elems >= 1, ConfigError, "bucket size must be >= 1 element");
  std::vector<Bucket> buckets;
  // Walk the buffer from its end (loss slot, last layer) towards layer 0.
  size_t open_end = model.grad_buffer_size();  // end of the bucket being filled
  for (int l = model.num_layers() - 1; l >= 0; --l) {
    const size_t begin = model.weight_offset(l);
    // Cut full buckets out of this layer while it overflows the open bucket.
    while (open_end - begin > bucket_elems) {
      const size_t cut = std::max(begin, open_end - bucket_elems);
      buckets.push_back({cut, open_end - cut, l});
      open_end = cut;
    }
    if (open_end - begin >= bucket_elems / 2 || l == 0) {
      if (open_end > begin) buckets.push_back({begin, open_end - begin, l});
      open_end = begin;
    }
  }
  return buckets;
}

DataParallelStep::DataParallelStep(std::shared_ptr<MLP> model, std::shared_ptr<Optimizer> optimizer,
                                   std::shared_ptr<Communicator> comm, LossKind loss,
                                   StepOptions options)
    : model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      comm_(std::move(comm)),
      loss_(loss),
      options_(options) {
  MGPU_CHECK(model_ && optimizer_ && comm_, ConfigError, "step needs a model, optimizer and communicator");
  buckets_ = plan_buckets(*model_, options_.bucket_elems);
  // Overlap pays only when something drives the collective while backward runs:
  // the transport itself (NCCL), or a host thread left idle by a device backend.
  // With the CPU backend and MPI the same cores would do both, and blocking
  // per-bucket allreduces after backward are faster (docs/benchmarks.md).
  overlap_ = options_.overlap &&
             (comm_->progresses_independently() || !model_->backend().host_accessible());
}

float DataParallelStep::step(const HostBatch& shard, int64_t global_batch, int64_t first_sample,
                             uint64_t step_index, float lr) {
  MLP& m = *model_;
  Backend& be = m.backend();
  MGPU_CHECK(global_batch >= 1, ConfigError, "global batch must be >= 1");
  MGPU_CHECK(shard.rows >= 0 && shard.rows <= global_batch, ConfigError, "shard of ", shard.rows,
             " rows does not fit a global batch of ", global_batch);
  size_t next_bucket = 0;
  auto launch_ready = [&](int layer) {
    while (next_bucket < buckets_.size() && buckets_[next_bucket].ready_layer >= layer) {
      const Bucket& b = buckets_[next_bucket++];
      if (overlap_)
        comm_->allreduce_sum_async(m.grads() + b.offset, b.count);
      else
        comm_->allreduce_sum(m.grads() + b.offset, b.count);
    }
    if (overlap_) comm_->progress();
  };

  if (shard.rows > 0) {
    // 1. This rank's shard into backend memory.
    m.stage(shard, loss_);
    // 2. Forward; dropout masks keyed by (seed, step, layer, global sample index).
    const DropoutKey key{m.seed(), step_index, 0, first_sample};
    m.forward(shard.rows, &key);
    // 3. Loss and its gradient, pre-scaled by 1/global normaliser.
    const double normaliser = loss_ == LossKind::kMSE
                                  ? static_cast<double>(global_batch) * m.out_features()
                                  : static_cast<double>(global_batch);
    m.loss_forward_backward(loss_, shard.rows, static_cast<float>(1.0 / normaliser), nullptr);
    // 4. Backward; each bucket's allreduce starts once its layers are done.
    m.backward(shard.rows, overlap_ ? std::function<void(int)>(launch_ready) : nullptr);
  } else {
    // An empty shard contributes zero gradient and zero loss.
    be.zero(m.grads(), m.grad_buffer_size());
  }
  launch_ready(-1);  // every bucket not yet launched
  // 5. All gradients summed on every rank; the update is then identical everywhere.
  comm_->wait_all();
  float loss = 0.0f;
  be.copy_to_host(&loss, m.loss_slot(), sizeof(float));
  MGPU_CHECK(std::isfinite(loss), NumericsError, "non-finite loss (", loss, ") at step ",
             step_index, "; parameters were not updated");
  optimizer_->step(m.params(), m.grads(), lr);
  return loss;
}

void DataParallelStep::broadcast_parameters(int root) {
  comm_->broadcast(model_->params(), model_->num_params(), root);
}

}  // namespace mgpu
