// One data-parallel training step, top to bottom (train_step.cpp): stage this
// rank's shard, forward, loss, backward with bucketed gradient allreduce, update.
// Exact averaging: every rank scales its per-sample gradient sum by
// 1/global_batch, so the allreduced sum is the mean over the global batch
// however unevenly it is split.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "communicator.h"
#include "model.h"
#include "optimizer.h"

namespace mgpu {

// A contiguous range of the gradient buffer, allreduced as one collective once
// backward has written layer `ready_layer` (the earliest layer it touches).
struct Bucket {
  size_t offset = 0;
  size_t count = 0;
  int ready_layer = 0;
};

// Buckets in backward order: the last layer (and the loss slot) first. A
// bucket closes once it holds >= bucket_elems elements and at a layer
// boundary; a layer larger than bucket_elems is cut into several buckets.
std::vector<Bucket> plan_buckets(const MLP& model, size_t bucket_elems);

struct StepOptions {
  size_t bucket_elems = size_t{1} << 20;  // 4 MiB of float32: well under MPI's large-message cliffs
  // Start each bucket's allreduce during backward where that can pay (see
  // DataParallelStep::overlaps()); false: per-bucket allreduces after backward.
  bool overlap = true;
};

class DataParallelStep {
 public:
  DataParallelStep(std::shared_ptr<MLP> model, std::shared_ptr<Optimizer> optimizer,
                   std::shared_ptr<Communicator> comm, LossKind loss, StepOptions options);

  // One step on this rank's shard (shard.rows may be 0) of a global batch of
  // global_batch rows whose first shard row is global sample first_sample.
  // Returns the global mean loss (the same on every rank).
  float step(const HostBatch& shard, int64_t global_batch, int64_t first_sample, uint64_t step_index,
             float lr);
  // Make every rank's parameters equal to root's.
  void broadcast_parameters(int root);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Whether this step overlaps the allreduce with backward.
  bool overlaps() const { return overlap_; }
  MLP& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  Communicator& communicator() { return *comm_; }
  LossKind loss() const { return loss_; }

 private:
  std::shared_ptr<MLP> model_;
  std::shared_ptr<Optimizer> optimizer_;
  std::shared_ptr<Communicator> comm_;
  LossKind loss_;
  StepOptions options_;
  bool overlap_ = false;
  std::vector<Bucket> buckets_;
};

}  // namespace mgpu
