// One data-parallel training step, top to bottom (train_step.cpp): stage this
// rank's shard, forward, loss, backward with bucketed gradient allreduce (after
// K-1 local micro-batches when accumulating), health check, clip, update; with
// a sharded optimizer, reduce-scatter, the shard's update, then all-gather
// (with NCCL layer by layer, each waited for by the next forward).
// Exact averaging: every rank scales its per-sample gradient sum by
// 1/global_batch, so the allreduced sum is the mean over the global batch
// however unevenly it is split.
#pragma once
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "communicator.h"
#include "model.h"
#include "optimizer.h"
#include "resident_data.h"
#include "step_trace.h"

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
// Buckets of at least this many elements start at a multiple of it (16 bytes).
constexpr size_t kBucketAlignElems = 4;
std::vector<Bucket> plan_buckets(const MLP& model, size_t bucket_elems);
// The same plan for layer sizes [in, hidden..., out] and a gradient buffer
// with extra_slots after the parameters (used by the performance model).
std::vector<Bucket> plan_buckets(const std::vector<int>& sizes, size_t extra_slots, size_t bucket_elems);

// The same plan run-length encoded: `repeat` buckets of `count` elements, all
// ready at `ready_layer`, the first at `offset` and each next one `count` lower.
// A layer cut into many buckets is one run, so a plan costs O(layers) whatever
// the model's size: the performance model prices trillion-parameter models.
struct BucketRun {
  size_t offset = 0;
  size_t count = 0;
  int ready_layer = 0;
  size_t repeat = 1;
};
std::vector<BucketRun> plan_bucket_runs(const std::vector<int>& sizes, size_t extra_slots, size_t bucket_elems);

struct StepOptions {
  size_t bucket_elems = size_t{1} << 20;  // 4 MiB of float32: well under MPI's large-message cliffs
  // Start each bucket's allreduce during backward where that can pay (see
  // DataParallelStep::overlaps()); false: per-bucket allreduces after backward.
  bool overlap = true;
  // Global-norm gradient clipping (PyTorch's clip_grad_norm_); 0 disables.
  float max_grad_norm = 0.0f;
  // Loss scaling (fp16): gradients are computed for loss_scale x the loss and
  // unscaled before the update. Dynamic: a step with non-finite gradients is
  // skipped and halves the scale; loss_scale_window good steps in a row double it.
  float loss_scale = 1.0f;
  bool dynamic_loss_scale = false;
  int loss_scale_window = 2000;
  // Capture each micro-batch's forward, loss and backward in a graph per shard
  // shape (rows, and whether it adds to the gradients) and replay it on later
  // steps and micro-batches, whatever their first sample and loss scale: one
  // launch instead of dozens (CUDA graphs; see Backend and ReplayArgs). A
  // shape is captured the second time it appears, so the first, uncaptured run
  // has sized every buffer. With graphs the allreduce follows backward instead
  // of overlapping it. kAuto: on for device backends that capture and models of
  // at most kGraphAutoMaxParams parameters (there launches dominate), falling back
  // to uncaptured steps if a capture fails (graph_fallback() says why); kOn:
  // always, and a failed capture throws.
  enum class Graph { kOff, kAuto, kOn };
  Graph graph = Graph::kOff;
  static constexpr size_t kGraphAutoMaxParams = size_t{1} << 24;
  // Gradient compression: kBF16 / kFP16 allreduce the parameters' gradients
  // in that type (half the bytes), each rank's fp32 gradients rounded to it and
  // the sum widened back to fp32 (loss-scale aware: an fp16 overflow is a
  // non-finite step the scaler skips). The loss and stop slots stay fp32.
  // Needs a transport that reduces half types (NCCL, or one rank).
  Precision grad_dtype = Precision::kFP32;
  // Synchronize the backend between phases so StepResult::timings separates
  // them on a device backend (benchmarks; costs overlap). Host backends are
  // always timed exactly.
  bool timed = false;
  // A sharded optimizer (ZeRO stage 1) on more than one rank: each rank owns a
  // contiguous shard of the parameters (balanced by elements), keeps optimizer
  // state for it only and updates it; buckets are reduce-scattered instead of
  // allreduced and the updated shards all-gathered at the step's end (with NCCL,
  // layer by layer, each waited for by the next step's forward just before
  // that layer: see MLP::defer_parameter_writes). Equals the unsharded step
  // within float rounding. No effect on one rank.
  bool shard_optimizer = false;
};

// One rank's share of one micro-batch: rows of the step's global batch whose
// first row is global sample first_sample (numbered across all micro-batches).
// Its rows are batch's (host memory); where `resident` is set, rows
// order[order_offset, order_offset + batch.rows) of a dataset in the backend's
// memory; where `prefetched`, rows [order_offset, order_offset + batch.rows) of those
// the step before prefetched (MLP::prefetch). batch holds only the row count then.
struct MicroShard {
  HostBatch batch;
  int64_t first_sample = 0;
  const ResidentData* resident = nullptr;
  bool prefetched = false;
  int64_t order_offset = 0;
};

// Where a step's time went (seconds), from host timers; with a device backend
// the phases are only separated when StepOptions::timed synchronizes them.
// With a captured step, forward holds the staging and backward the replayed
// forward, loss and backward (on one device, the health check and update too).
struct StepTimings {
  double forward = 0;    // staging, forward, loss (every micro-batch)
  double backward = 0;   // backward, including allreduces launched during it
  double comm_wait = 0;  // allreduce time not hidden behind backward, the health check, the read-back's wait
  double optimizer = 0;  // unscale/clip and update (a device backend: queueing them)
  double total = 0;
};

// One gradient bucket's allreduce in a timed or traced step: from the step
// launching it to its completion as observed (MPI: the blocking call's return,
// or the test or wait that saw a queued one finish; NCCL: a CUDA event on the
// communication stream after its group), seconds since the step began.
struct BucketTiming {
  int index = 0;      // in plan order (backward order: the last layer first)
  size_t offset = 0;  // elements into the gradient buffer
  size_t count = 0;   // elements
  size_t bytes = 0;   // on the wire per rank (half types with gradient compression)
  double launch = 0;
  double done = 0;
};

struct StepResult {
  StepTimings timings;
  double started = 0.0;               // when the step began, on the host's steady clock (seconds; as TraceSpan)
  std::vector<BucketTiming> buckets;  // timed and traced steps only; empty otherwise
  // Traced steps' spans whose marks have happened (see StepTrace): this step's
  // (all of them: its read-back follows its update), and any an earlier step
  // left; each names its step.
  std::vector<TraceSpan> spans;
  float loss = 0.0f;            // global mean loss of the step's samples
  double grad_norm = 0.0;       // L2 norm of the averaged, unscaled gradient before clipping
  bool applied = false;         // false: non-finite loss or gradients (the verdict); parameters untouched
  bool stop_requested = false;  // some rank asked to stop; every rank sees the same value
  float loss_scale = 1.0f;      // the scale this step used
};

class StepRecorder;  // step_recorder.h

class DataParallelStep {
 public:
  DataParallelStep(std::shared_ptr<MLP> model, std::shared_ptr<Optimizer> optimizer, std::shared_ptr<Communicator> comm,
                   LossKind loss, StepOptions options);
  // Keeps (leaks) the model and the buffers collectives write where the
  // communicator cannot rule out a write still to come (a timed-out MPI
  // collective a live peer may yet complete): never freed under it.
  ~DataParallelStep();
  DataParallelStep(const DataParallelStep&) = delete;
  DataParallelStep& operator=(const DataParallelStep&) = delete;

  // One optimizer step over K micro-batches (gradient accumulation when K > 1):
  // this rank's shards (any may have 0 rows) of a global batch of global_batch
  // rows in all. Gradients accumulate locally; the allreduce runs once, during
  // the last micro-batch's backward. request_stop: this rank wants the run to
  // end at this step (agreed through the same allreduce). trace: record this
  // step's spans (stage, forward and backward layer by layer, loss, allreduce
  // wait, health check, optimizer) and its buckets' allreduces, on the
  // backend's clock and without synchronising anything.
  // prefetch_next: the next step's rows on this rank, copied in beside this step's
  // compute once its work is queued (its shards then name them `prefetched`).
  StepResult step(const std::vector<MicroShard>& shards, int64_t global_batch, uint64_t step_index, float lr,
                  bool request_stop = false, bool trace = false, const HostBatch* prefetch_next = nullptr);
  // The traced spans not handed over yet, after waiting for the backend: call at the end of a run.
  std::vector<TraceSpan> drain_trace() { return trace_->drain(); }
  // Make every rank's parameters equal to root's.
  void broadcast_parameters(int root);
  // Whether the optimizer is sharded (StepOptions::shard_optimizer on more than
  // one rank), and the shard sizes in parameters, one per rank, in rank order.
  bool shards_optimizer() const { return sharded_; }
  const std::vector<size_t>& shard_sizes() const { return shard_sizes_; }
  size_t shard_offset() const { return shard_offset_; }
  // The whole optimizer state `name` (num_params floats) into host_dst on every
  // rank: collective when sharded (each shard broadcast by its owner), local otherwise.
  void gather_optimizer_state(const std::string& name, float* host_dst);
  // Sets state `name` from the whole state (num_params floats): each rank keeps its shard. Local.
  void set_optimizer_state(const std::string& name, const float* host_src);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Whether this step overlaps the allreduce with backward (never with graphs).
  bool overlaps() const { return overlap_ && !graphs_enabled_; }
  const StepOptions& options() const { return options_; }
  float loss_scale() const { return loss_scale_; }
  void set_loss_scale(float scale);
  int good_steps_in_a_row() const { return good_steps_; }
  void set_good_steps_in_a_row(int steps) { good_steps_ = steps; }
  MLP& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  Communicator& communicator() { return *comm_; }
  LossKind loss() const { return loss_; }
  // Whether steps are captured and replayed (StepOptions::graph), how many
  // micro-batches ran as a replay so far, and why kAuto gave graphs up ("" if not).
  bool uses_graphs() const { return graphs_enabled_; }
  int64_t graph_replays() const { return graph_replays_; }
  const std::string& graph_fallback() const { return graph_fallback_; }

 private:
  struct Run;  // one call of step(): what its phases share (train_step.cpp)
  // The phases of step(), in the order it runs them.
  void check_shards(const std::vector<MicroShard>& shards, int64_t global_batch) const;
  Run plan_run(const std::vector<MicroShard>& shards, int64_t global_batch, uint64_t step_index, float lr,
               StepRecorder& rec);
  void write_stop_flag(bool request_stop);
  void run_micro_batch(Run& run, size_t k);
  void compute_micro_batch(Run& run, const MicroShard& s, const DropoutKey& key, int micro, bool launches);
  void replay_micro_batch(Run& run, const MicroShard& s, const DropoutKey& key, int micro, bool with_tail);
  void launch_ready_buckets(Run& run, int layer);
  void zero_gradients();
  void reduce_gradients(Run& run);
  void abort_buckets_in_flight(const Run& run, const std::exception& e);
  void replay_tail(Run& run);
  void decide(Run& run);
  void apply_update(float lr);
  void gather_parameters(Run& run);
  void plan_shards();  // StepOptions::shard_optimizer on more than one rank: the shards and each bucket's parts
  // A collective of the step's tail over backend memory (all-gather): queued
  // and waited for where buckets are (the device then waits, not the host), else blocking.
  void all_gather_in_tail(Run& run, float* data, const std::vector<size_t>& parts);
  StepVerdict read_verdict(StepRecorder& rec);
  void finish(const StepVerdict& v, StepResult& result, StepRecorder& rec);

  // Forward, loss and backward of the staged micro-batch (layer_done: see MLP::backward).
  void forward_loss_backward(int rows, const DropoutKey& key, float grad_scale, bool accumulate,
                             const std::function<void(int)>& layer_done);
  // What a graph bakes in: rows (-1: no micro-batch), whether it adds to the
  // gradients, and whether it holds the step's tail (verdict and update).
  using GraphKey = std::tuple<int, bool, bool>;
  // Runs `work` through the graph captured for `key` (captured on the key's
  // second appearance, its first having run uncaptured and sized every buffer)
  // with `args`; `work` must read nothing else that changes between steps.
  // Returns how it ran: "graph replay", "graph capture + replay" or "uncaptured".
  const char* run_captured(const GraphKey& key, const ReplayArgs& args, const std::function<void()>& work);
  // Launches bucket b's allreduce (queued or blocking as overlap_ says; compressed with grad_dtype;
  // sharded: its parameters' reduce-scatter, the loss and stop slots travel in the health check).
  // Returns how many queued collectives it issued (0: it completed before returning).
  int launch_bucket(size_t index);
  size_t bucket_bytes(const Bucket& b) const;

  std::shared_ptr<MLP> model_;
  std::shared_ptr<Optimizer> optimizer_;
  std::shared_ptr<Communicator> comm_;
  LossKind loss_;
  StepOptions options_;
  bool overlap_ = false;
  std::vector<Bucket> buckets_;
  bool sharded_ = false;
  std::vector<size_t> shard_sizes_;                // parameters owned by each rank (sharded)
  size_t shard_offset_ = 0, shard_size_ = 0;       // this rank's shard
  std::vector<std::vector<size_t>> bucket_parts_;  // each bucket's parameters cut by owner (sharded)
  std::vector<std::vector<size_t>> layer_parts_;   // each layer's parameters cut by owner (sharded)
  bool gather_by_layer_ = false;                   // 7b fenced layer by layer (see gather_parameters)
  BackendArray<float> shard_sums_;                 // every rank's health-check share (kShardSums each)
  std::vector<size_t> shard_sums_parts_;           // kShardSums a rank: the shares' all-gather
  BackendArray<uint16_t> half_grads_;              // grad_dtype's copy of the parameters' gradients (compression)
  float loss_scale_ = 1.0f;
  int good_steps_ = 0;
  BackendArray<StepVerdict> verdict_;  // the step's verdict, in backend memory (read back once a step)
  bool graphs_enabled_ = false;
  std::map<GraphKey, int> graphs_;  // captured keys -> the backend's graph id
  std::set<GraphKey> seen_shapes_;  // keys run once uncaptured
  uint64_t graph_generation_ = 0;   // backend's capture_generation() the ids belong to
  int64_t graph_replays_ = 0;
  std::string graph_fallback_;
  std::unique_ptr<StepTrace> trace_;
};

}  // namespace mgpu
