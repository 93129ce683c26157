// The data-parallel training step (see train_step.h).
#include "train_step.h"

#include <algorithm>
#include <cmath>

#include "async_signals.h"
#include "errors.h"
#include "staged_communicator.h"
#include "step_recorder.h"

namespace mgpu {

std::vector<BucketRun> plan_bucket_runs(const std::vector<int>& sizes, size_t extra_slots, size_t bucket_elems) {
  MGPU_CHECK(bucket_elems >= 1, ConfigError, "bucket size must be >= 1 element");
  MGPU_CHECK(sizes.size() >= 2, ConfigError, "a model needs at least an input and an output size");
  const int layers = static_cast<int>(sizes.size()) - 1;
  std::vector<size_t> start(layers + 1, 0);  // start[l]: offset of layer l's weights
  for (int l = 0; l < layers; ++l)
    start[l + 1] = start[l] + static_cast<size_t>(sizes[l]) * sizes[l + 1] + sizes[l + 1];
  std::vector<BucketRun> runs;
  auto append = [&runs](size_t offset, size_t count, int layer, size_t repeat) {
    if (!runs.empty() && runs.back().count == count && runs.back().ready_layer == layer &&
        runs.back().offset - runs.back().repeat * count == offset)  // continues the last run
      runs.back().repeat += repeat;
    else
      runs.push_back({offset, count, layer, repeat});
  };
  // Bucket starts are rounded up to 4 elements (16 bytes) when buckets hold at
  // least that many: collectives read aligned vectors whatever the layer sizes.
  // Rounding up keeps a bucket within its layer; the few elements it leaves go
  // to the next (lower) bucket, which is ready later anyway.
  const size_t align = bucket_elems >= kBucketAlignElems ? kBucketAlignElems : 1;
  auto aligned_up = [align](size_t x) { return (x + align - 1) / align * align; };
  // Walk the buffer from its end (extra slots, last layer) towards layer 0.
  size_t open_end = start[layers] + extra_slots;  // end of the bucket being filled
  for (int l = layers - 1; l >= 0; --l) {
    const size_t begin = start[l];
    // Cut full buckets out of this layer while it overflows the open bucket
    // (open_end - bucket_elems > begin here, so the aligned cut stays < open_end).
    // After the first cut open_end is aligned, so every further cut is the same
    // size: they are counted, not walked.
    if (open_end - begin > bucket_elems) {
      const size_t cut = aligned_up(open_end - bucket_elems);
      append(cut, open_end - cut, l, 1);
      open_end = cut;
      const size_t step = open_end - aligned_up(open_end - bucket_elems);
      if (open_end - begin > bucket_elems) {
        const size_t more = (open_end - begin - bucket_elems + step - 1) / step;
        append(open_end - step, step, l, more);
        open_end -= more * step;
      }
    }
    if (open_end - begin >= bucket_elems / 2 || l == 0) {
      const size_t first = l == 0 ? 0 : aligned_up(begin);
      if (open_end > first) append(first, open_end - first, l, 1);
      open_end = std::min(open_end, first);
    }
  }
  return runs;
}

std::vector<Bucket> plan_buckets(const std::vector<int>& sizes, size_t extra_slots, size_t bucket_elems) {
  std::vector<Bucket> buckets;
  for (const BucketRun& run : plan_bucket_runs(sizes, extra_slots, bucket_elems))
    for (size_t i = 0; i < run.repeat; ++i) buckets.push_back({run.offset - i * run.count, run.count, run.ready_layer});
  return buckets;
}

std::vector<Bucket> plan_buckets(const MLP& model, size_t bucket_elems) {
  return plan_buckets(model.sizes(), MLP::kGradExtraSlots, bucket_elems);
}

DataParallelStep::DataParallelStep(std::shared_ptr<MLP> model, std::shared_ptr<Optimizer> optimizer,
                                   std::shared_ptr<Communicator> comm, LossKind loss, StepOptions options)
    : model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      comm_(std::move(comm)),
      loss_(loss),
      options_(options) {
  MGPU_CHECK(model_ && optimizer_ && comm_, ConfigError, "step needs a model, optimizer and communicator");
  MGPU_CHECK(options_.max_grad_norm >= 0.0f && std::isfinite(options_.max_grad_norm), ConfigError,
             "max_grad_norm must be a finite number >= 0 (0 disables clipping), got ", options_.max_grad_norm);
  MGPU_CHECK(options_.loss_scale_window >= 1, ConfigError, "loss_scale_window must be >= 1");
  set_loss_scale(options_.loss_scale);
  buckets_ = plan_buckets(*model_, options_.bucket_elems);
  // MPI moves host memory only: a device backend's gradients go through host buffers.
  if (!model_->backend().host_accessible() && !comm_->accepts_device_memory())
    comm_ = std::make_shared<StagedCommunicator>(comm_, model_->backend_ptr());
  comm_->attach(model_->backend_ptr());
  // Overlap pays only when something drives the collective while backward runs:
  // the transport itself (NCCL), or a host thread left idle by a device backend.
  // With the CPU backend and MPI the same cores would do both, and blocking
  // per-bucket allreduces after backward are faster (docs/benchmarks.md).
  overlap_ = options_.overlap && (comm_->progresses_independently() || !model_->backend().host_accessible());
  if (options_.grad_dtype != Precision::kFP32) {
    MGPU_CHECK(options_.grad_dtype == Precision::kBF16 || options_.grad_dtype == Precision::kFP16, ConfigError,
               "gradients are reduced in fp32, bf16 or fp16, not ", precision_name(options_.grad_dtype));
    MGPU_CHECK(comm_->reduces_half_types(), ConfigError, "gradient compression (", precision_name(options_.grad_dtype),
               " allreduce) needs NCCL between GPUs; the ", comm_->name(),
               " communicator reduces fp32 gradients (use grad dtype fp32)");
    half_grads_ = BackendArray<uint16_t>(&model_->backend(), model_->num_params());
  }
  verdict_ = BackendArray<StepVerdict>(&model_->backend(), 1);
  if (options_.shard_optimizer && comm_->size() > 1) plan_shards();
  trace_ = std::make_unique<StepTrace>(model_->backend());
  const Backend& be = model_->backend();
  MGPU_CHECK(options_.graph != StepOptions::Graph::kOn || be.supports_capture(), ConfigError,
             "captured steps (CUDA graphs) need a backend that captures; the ", be.name(), " backend does not");
  // Capture pays where launches cost: device backends (the CPU's recorded
  // calls exist to test this logic and run only when asked for).
  graphs_enabled_ = be.supports_capture() && (options_.graph == StepOptions::Graph::kOn ||
                                              (options_.graph == StepOptions::Graph::kAuto && !be.host_accessible() &&
                                               model_->num_params() <= StepOptions::kGraphAutoMaxParams));
  // Decided here, from what every rank shares, never per step: NCCL needs every
  // rank to issue the same groups (a capture that fails later on one rank must not change them).
  gather_by_layer_ = sharded_ && overlap_ && comm_->fences_device_work() && !graphs_enabled_;
}

// Forward, loss and backward of the staged rows, nothing between them (a graph
// captures it): x (rows, IN) -> each layer's output (rows, OUT_l) -> loss and
// its gradient (rows, OUT) -> gradients into grads() (added to with accumulate).
void DataParallelStep::forward_loss_backward(int rows, const DropoutKey& key, float grad_scale, bool accumulate,
                                             const std::function<void(int)>& layer_done) {
  MLP& m = *model_;
  m.forward(rows, &key);
  m.loss_forward_backward(loss_, rows, grad_scale, nullptr, accumulate);
  m.backward(rows, layer_done, accumulate);
}

const char* DataParallelStep::run_captured(const GraphKey& key, const ReplayArgs& args,
                                           const std::function<void()>& work) {
  Backend& be = model_->backend();
  if (be.capture_generation() != graph_generation_) {  // the backend released our graphs
    graphs_.clear();
    seen_shapes_.clear();
    graph_generation_ = be.capture_generation();
  }
  const auto found = graphs_.find(key);
  if (found != graphs_.end()) {
    be.replay(found->second, args);
    ++graph_replays_;
    return "graph replay";
  }
  // Bounded: shapes that keep changing (ragged batches) would otherwise pile up graphs.
  constexpr size_t kMaxGraphs = 16, kMaxSeen = 256;
  if (graphs_.size() >= kMaxGraphs || seen_shapes_.size() >= kMaxSeen) {
    be.release_captures();
    graphs_.clear();
    seen_shapes_.clear();
    graph_generation_ = be.capture_generation();
  }
  if (seen_shapes_.insert(key).second) {  // first appearance: run uncaptured, sizing every buffer
    work();
    return "uncaptured";
  }
  try {
    be.begin_capture();
    work();
    const int graph = be.end_capture();
    graphs_[key] = graph;
    be.replay(graph, args);  // captured work is recorded, not run: run it now
    ++graph_replays_;
    return "graph capture + replay";
  } catch (const Error& e) {
    be.abort_capture();
    if (options_.graph == StepOptions::Graph::kOn) throw;
    graphs_enabled_ = false;  // kAuto: uncaptured from here on
    graph_fallback_ = e.what();
    work();
    return "uncaptured";
  }
}

void DataParallelStep::set_loss_scale(float scale) {
  MGPU_CHECK(scale > 0.0f && std::isfinite(scale), ConfigError, "loss scale must be a finite number > 0, got ", scale);
  loss_scale_ = scale;
}

DataParallelStep::~DataParallelStep() {
  if (!comm_ || !comm_->may_write_after_failure()) return;
  new std::shared_ptr<MLP>(model_);  // NOLINT: deliberately never freed (its gradients and parameters)
  new BackendArray<float>(std::move(shard_sums_));
  new BackendArray<uint16_t>(std::move(half_grads_));
}

// What one call of step() shares between its phases.
struct DataParallelStep::Run {
  const std::vector<MicroShard>& shards;
  uint64_t index;  // the step's number (dropout keys, heartbeats, graph replays)
  float lr;
  float grad_scale;       // loss_scale / the global normaliser: the seed of each micro-batch's backward
  UpdateScalars update;   // the optimizer's scalars at lr, for a replayed update
  bool whole_step_graph;  // one device, nothing to reduce: the last micro-batch's graph holds the tail too
  int last_with_rows;     // the last micro-batch with rows on this rank (-1: none)
  StepRecorder& rec;
  size_t next_bucket = 0;    // buckets launched so far
  bool written = false;      // has a micro-batch written the gradient buffer yet?
  bool tail_queued = false;  // did a micro-batch's graph queue the verdict and update?

  ReplayArgs replay_args(const DropoutKey& key, float loss_scale) const {
    return ReplayArgs{key.step, key.first_sample, grad_scale, loss_scale, update};
  }
};

// One optimizer step: 1-4 forward and backward of each micro-batch (the last
// one's backward launches the gradient allreduce), 5 the reduced gradients,
// 6-7 the health check's verdict and the update, queued on the backend (7b,
// sharded: the updated shards all-gathered, with NCCL layer by layer into the
// next step's forward), 8 the verdict read back once and
// the loss scale adjusted. The recorder takes the
// timings and trace spans at named points in between.
StepResult DataParallelStep::step(const std::vector<MicroShard>& shards, int64_t global_batch, uint64_t step_index,
                                  float lr, bool request_stop, bool trace, const HostBatch* prefetch_next) {
  const AsynchronousSignalsHeld signals_after_the_step;  // one mask change for all its GEMMs
  check_shards(shards, global_batch);
  if (prefetch_next) model_->check_prefetch(*prefetch_next, loss_);  // before anything is queued
  // A timed or traced step stamps its collectives from an idle communication
  // stream: the last step's gathers are done first (the host waits; local).
  if (options_.timed || trace) model_->await_parameters();
  StepResult result;
  StepRecorder rec(model_->backend(), *comm_, *trace_, result, step_index, options_.timed, trace, buckets_.size(),
                   sharded_);
  rec.record(StepEvent::kBegin);
  Run run = plan_run(shards, global_batch, step_index, lr, rec);
  write_stop_flag(request_stop);
  try {
    for (size_t k = 0; k < shards.size(); ++k) run_micro_batch(run, k);  // 1-4
    model_->await_deferred_layers();  // the last step's gathers, where no forward waited for them (no rows)
    model_->discard_prefetch();       // taken, or stale: a prefetch serves the step after it only
    if (!run.written) zero_gradients();
    // tail_queued, not whole_step_graph: a capture that failed under kAuto may have turned the graphs off.
    if (!run.tail_queued) reduce_gradients(run);  // 5
  } catch (const std::exception& e) {
    abort_buckets_in_flight(run, e);
    throw;
  }
  if (!run.tail_queued && graphs_enabled_ && !sharded_) {  // 6-7, one graph
    replay_tail(run);
  } else if (!run.tail_queued) {  // 6-7
    decide(run);
    rec.record(StepEvent::kHealthChecked);
    apply_update(lr);
    rec.record(StepEvent::kUpdated);
    if (sharded_) {
      gather_parameters(run);  // 7b
      rec.record(StepEvent::kParametersGathered);
    }
  }
  rec.record(StepEvent::kTailQueued);
  if (prefetch_next) model_->prefetch(*prefetch_next, loss_);  // crosses while this step computes
  const StepVerdict verdict = read_verdict(rec);               // the step's one synchronisation
  finish(verdict, result, rec);                                // 8
  rec.record(StepEvent::kEnd);
  return result;
}

// Every shard fits the global batch, and together they hold no more than it.
void DataParallelStep::check_shards(const std::vector<MicroShard>& shards, int64_t global_batch) const {
  MGPU_CHECK(!shards.empty(), ConfigError, "a step needs at least one micro-batch");
  MGPU_CHECK(global_batch >= 1, ConfigError, "global batch must be >= 1");
  int64_t local_rows = 0;
  for (const MicroShard& s : shards) {
    MGPU_CHECK(s.batch.rows >= 0 && s.first_sample >= 0 && s.first_sample + s.batch.rows <= global_batch, ConfigError,
               "shard of ", s.batch.rows, " rows at sample ", s.first_sample, " does not fit a global batch of ",
               global_batch);
    if (s.resident) model_->check_rows(*s.resident, s.order_offset, s.batch.rows, loss_);
    MGPU_CHECK(!s.prefetched || s.order_offset + s.batch.rows <= model_->prefetched_rows(), ConfigError,
               "prefetched rows [", s.order_offset, ", ", s.order_offset + s.batch.rows, ") were not prefetched (",
               model_->prefetched_rows(), " rows are; a prefetch serves the next step only)");
    local_rows += s.batch.rows;
  }
  MGPU_CHECK(local_rows <= global_batch, ConfigError, "this rank's ", local_rows, " rows exceed the global batch of ",
             global_batch);
}

// The step's scalars: each micro-batch's loss gradient is pre-scaled by
// loss_scale / the global normaliser, so the allreduced sum is the global mean
// (loss-scaled); the optimizer's scalars at lr (which checks lr before anything
// is queued); and where the tail runs.
DataParallelStep::Run DataParallelStep::plan_run(const std::vector<MicroShard>& shards, int64_t global_batch,
                                                 uint64_t step_index, float lr, StepRecorder& rec) {
  const double normaliser = loss_ == LossKind::kMSE ? static_cast<double>(global_batch) * model_->out_features()
                                                    : static_cast<double>(global_batch);
  const float grad_scale = static_cast<float>(loss_scale_ / normaliser);
  const UpdateScalars update = optimizer_->next_scalars(lr);
  const bool whole_step_graph = graphs_enabled_ && comm_->size() == 1 && !half_grads_.size();
  int last_with_rows = -1;
  for (size_t k = 0; k < shards.size(); ++k)
    if (shards[k].batch.rows > 0) last_with_rows = static_cast<int>(k);
  return Run{shards, step_index, lr, grad_scale, update, whole_step_graph, last_with_rows, rec};
}

// The stop slot travels in the first bucket, which overlap launches during the
// last backward: written before any backward runs.
void DataParallelStep::write_stop_flag(bool request_stop) {
  Backend& be = model_->backend();
  if (!request_stop) {
    be.zero(model_->stop_slot(), 1);  // no host memory read: a steady step with resident data copies nothing in
    return;
  }
  const float stop_flag = 1.0f;
  be.stage_to_backend(model_->stop_slot(), &stop_flag, sizeof(float));
}

// 1-4. Micro-batch k: stage the shard, then forward (dropout keyed by seed,
// step, layer and global sample index), loss and backward into the gradient
// buffer (added to it after the first micro-batch). Only the last micro-batch's
// backward launches buckets.
void DataParallelStep::run_micro_batch(Run& run, size_t k) {
  const MicroShard& s = run.shards[k];
  if (s.batch.rows == 0) return;
  const int micro = run.shards.size() > 1 ? static_cast<int>(k) : -1;  // spans name micro-batches when several
  if (s.resident)
    model_->stage_rows(*s.resident, s.order_offset, s.batch.rows, loss_);
  else if (s.prefetched)
    model_->stage_prefetched(s.order_offset, s.batch.rows, loss_);
  else
    model_->stage(s.batch, loss_, /*own_copy=*/graphs_enabled_);
  run.rec.record(StepEvent::kStaged, micro);
  const DropoutKey key{model_->seed(), run.index, 0, s.first_sample};
  if (graphs_enabled_) {
    model_->await_deferred_layers();  // never in a capture
    const bool with_tail = run.whole_step_graph && static_cast<int>(k) == run.last_with_rows;
    replay_micro_batch(run, s, key, micro, with_tail);
    run.tail_queued = with_tail;
  } else {
    compute_micro_batch(run, s, key, micro, /*launches=*/k + 1 == run.shards.size() && overlap_);
  }
  run.written = true;
}

// Uncaptured: forward, loss and backward call by call, each layer a trace point;
// launches: each bucket's allreduce starts as backward completes its layers.
void DataParallelStep::compute_micro_batch(Run& run, const MicroShard& s, const DropoutKey& key, int micro,
                                           bool launches) {
  MLP& m = *model_;
  StepRecorder& rec = run.rec;
  const int rows = s.batch.rows;
  const bool accumulate = run.written;
  rec.record(StepEvent::kForwardBegin);
  m.forward(
      rows, &key,
      rec.traced() ? std::function<void(int)>([&](int l) { rec.record(StepEvent::kForwardLayer, micro, l); }) : nullptr,
      /*by_layer=*/true);
  rec.record(StepEvent::kForwardEnd, micro);
  m.loss_forward_backward(loss_, rows, run.grad_scale, nullptr, accumulate);
  rec.record(StepEvent::kLoss, micro);
  std::function<void(int)> layer_done;
  if (rec.traced())
    layer_done = [&](int l) {
      rec.record(StepEvent::kBackwardLayer, micro, l);  // before its buckets launch
      if (launches) launch_ready_buckets(run, l);
    };
  else if (launches)
    layer_done = [&](int l) { launch_ready_buckets(run, l); };
  rec.record(StepEvent::kBackwardBegin);
  m.backward(rows, layer_done, accumulate);
  rec.record(StepEvent::kBackwardEnd, micro);
}

// Captured: one replay runs forward, loss and backward (with_tail: the verdict
// and update too, on one device); the buckets launch after it.
void DataParallelStep::replay_micro_batch(Run& run, const MicroShard& s, const DropoutKey& key, int micro,
                                          bool with_tail) {
  run.rec.record(StepEvent::kReplayBegin);
  const int rows = s.batch.rows;
  const bool accumulate = run.written;
  const float grad_scale = run.grad_scale;
  const float lr = run.lr;
  const char* how = run_captured({rows, accumulate, with_tail}, run.replay_args(key, loss_scale_), [&] {
    forward_loss_backward(rows, key, grad_scale, accumulate, nullptr);
    if (with_tail) {
      decide(run);
      apply_update(lr);
    }
  });
  run.rec.record(with_tail ? StepEvent::kReplayWithTailEnd : StepEvent::kReplayEnd, micro, how);
}

// Launches the buckets whose layer's gradients are complete (layer -1: all the
// rest). The launches are grouped by ready layer whatever the path (per-layer
// callbacks, one call after a replayed graph, a rank without rows): NCCL
// schedules a group as a whole, so every rank must group the same collectives
// the same way.
void DataParallelStep::launch_ready_buckets(Run& run, int layer) {
  StepRecorder& rec = run.rec;
  if (run.next_bucket == 0) comm_->begin_step(run.index);  // heartbeat, just before the first collective
  while (run.next_bucket < buckets_.size() && buckets_[run.next_bucket].ready_layer >= layer) {
    const int index = static_cast<int>(run.next_bucket);
    const Bucket& b = buckets_[run.next_bucket++];
    if (rec.stamps_buckets()) rec.launching();
    const int queued = launch_bucket(static_cast<size_t>(index));
    if (rec.stamps_buckets()) rec.launched(index, b.offset, b.count, bucket_bytes(b), queued);
    const bool layer_ends =
        run.next_bucket == buckets_.size() || buckets_[run.next_bucket].ready_layer != b.ready_layer;
    if (overlap_ && layer_ends) comm_->progress();
  }
  // Nothing is queued here any more (the loop ends at a layer's end), so this
  // only lets a host-driven transport (MPI) advance what is in flight.
  if (overlap_) comm_->progress();
}

// An empty share contributes zero gradient and zero loss.
void DataParallelStep::zero_gradients() { model_->backend().zero(model_->grads(), model_->num_params() + 1); }

// 5. Launches every bucket not yet launched and waits: all gradients summed on
// every rank. From here on every rank computes the same values and takes the
// same decisions.
void DataParallelStep::reduce_gradients(Run& run) {
  launch_ready_buckets(run, -1);
  comm_->wait_all();
  run.rec.record(StepEvent::kAllreduceDone);
  if (half_grads_.size())  // sharded: only this rank's shard was reduced
    model_->backend().widen(model_->grads() + shard_offset_, half_grads_.data() + shard_offset_,
                            sharded_ ? shard_size_ : model_->num_params(), options_.grad_dtype);
  run.rec.record(StepEvent::kGradientsReduced);
}

// An error once buckets are in flight (a failed allocation or launch in
// backward) aborts them: they use the gradient buffer, which may be freed
// next, and the peers wait for the buckets this rank will never launch.
void DataParallelStep::abort_buckets_in_flight(const Run& run, const std::exception& e) {
  if (run.next_bucket > 0) comm_->abort(detail::concat("step ", run.index, " failed on this rank: ", e.what()));
}

// 6-7 as one captured graph (no micro-batch in it).
void DataParallelStep::replay_tail(Run& run) {
  run.rec.record(StepEvent::kTailBegin);
  const DropoutKey none{model_->seed(), run.index, 0, 0};
  const float lr = run.lr;
  const char* how = run_captured({-1, false, true}, run.replay_args(none, loss_scale_), [&] {
    decide(run);
    apply_update(lr);
  });
  run.rec.record(StepEvent::kTailReplayEnd, -1, how);
}

// 6. The health check, on the backend with no host wait (see Backend::step_verdict):
// its one reduction gives the gradient norm (non-finite when any gradient is)
// and, with the loss, the verdict: whether the update runs, and its unscale and
// clip factor g *= (1/scale) * min(1, max_norm / (norm + 1e-6)).
// Sharded, each rank holds only its shard's reduced gradients and its own loss
// and stop slots: the shares are all-gathered and summed, in rank order, by every rank alike.
void DataParallelStep::decide(Run& run) {
  MLP& m = *model_;
  Backend& be = m.backend();
  if (!sharded_) {
    be.step_verdict(verdict_.data(), m.grads(), m.num_params(), m.loss_slot(), loss_scale_, options_.max_grad_norm,
                    comm_->failure_flag());
    return;
  }
  const int ranks = comm_->size();
  be.shard_health_sums(shard_sums_.data() + size_t(kShardSums) * comm_->rank(), m.grads() + shard_offset_, shard_size_,
                       m.loss_slot());
  all_gather_in_tail(run, shard_sums_.data(), shard_sums_parts_);
  be.step_verdict_from_shards(verdict_.data(), shard_sums_.data(), ranks, loss_scale_, options_.max_grad_norm,
                              comm_->failure_flag());
}

// 7. The update, identical on every rank, applies the verdict's factor as it
// reads each gradient (no pass of its own: the gradient buffer keeps the
// reduced, still loss-scaled and unclipped values), or nothing if it refused.
void DataParallelStep::apply_update(float lr) {
  optimizer_->step(model_->params(), model_->grads(), lr, verdict_.data());
}

// 7b. Sharded: every rank's updated shard to every rank (unchanged shards when
// the verdict refused the update: every rank issues the same collectives).
// gather_by_layer_: layer by layer in forward order, each fenced and left in
// flight: the next forward waits for each layer just before it, so it starts
// once layer 0 arrived (a timed or traced step waits for them here: a local
// choice, the collectives are the same). Otherwise at once, completed here.
void DataParallelStep::gather_parameters(Run& run) {
  MLP& m = *model_;
  if (!gather_by_layer_) {
    all_gather_in_tail(run, m.params(), shard_sizes_);
    m.backend().parameters_changed();  // written by the communicator, not the backend
    return;
  }
  try {
    for (int l = 0; l < m.num_layers(); ++l) {
      const size_t first = m.weight_offset(l), count = m.layer_end(l) - first;
      comm_->all_gather_async(m.params() + first, layer_parts_[static_cast<size_t>(l)]);
      comm_->fence(static_cast<size_t>(l));
      m.backend().parameters_changed(first, count);
      if (run.rec.stamps_buckets()) run.rec.queued_after_buckets();
    }
  } catch (const std::exception& e) {  // gathers in flight that nothing would wait for: end them
    comm_->abort(detail::concat("step ", run.index, " failed on this rank: ", e.what()));
    throw;
  }
  if (options_.timed || run.rec.traced()) {
    comm_->wait_all();
    return;
  }
  std::shared_ptr<Communicator> comm = comm_;  // not the step: the model may outlive it
  m.defer_parameter_writes([comm](int layer) {
    if (layer < 0)
      comm->complete_all();
    else
      comm->wait_fence(static_cast<size_t>(layer));
  });
}

void DataParallelStep::all_gather_in_tail(Run& run, float* data, const std::vector<size_t>& parts) {
  if (!overlap_) {
    comm_->all_gather(data, parts);
    return;
  }
  comm_->all_gather_async(data, parts);
  if (run.rec.stamps_buckets()) run.rec.queued_after_buckets();
  comm_->wait_all();
}

// The verdict on the host: the step's one synchronisation. After it a device
// transport's completion events have all fired.
StepVerdict DataParallelStep::read_verdict(StepRecorder& rec) {
  StepVerdict v;
  model_->backend().copy_to_host(&v, verdict_.data(), sizeof(v));
  comm_->raise_if_failed();
  rec.record(StepEvent::kVerdictRead);
  return v;
}

// 8. The step's outcome, and the loss scale for the next one: a skipped step
// (parameters and optimizer state as they were) halves a dynamic scale,
// loss_scale_window good steps in a row double it.
void DataParallelStep::finish(const StepVerdict& v, StepResult& result, StepRecorder& rec) {
  result.loss_scale = loss_scale_;
  result.loss = v.loss;
  result.stop_requested = v.stop > 0.0f;
  result.grad_norm = v.grad_norm;
  result.applied = v.apply != 0;
  optimizer_->count_step(result.applied);
  if (!result.applied) {
    rec.record(StepEvent::kUpdateSkipped);
    if (options_.dynamic_loss_scale) loss_scale_ = std::max(loss_scale_ * 0.5f, 1e-30f);
    good_steps_ = 0;
  } else if (options_.dynamic_loss_scale && ++good_steps_ >= options_.loss_scale_window) {
    loss_scale_ = std::min(loss_scale_ * 2.0f, 3.0e38f);
    good_steps_ = 0;
  }
}

size_t DataParallelStep::bucket_bytes(const Bucket& b) const {
  if (!half_grads_.size()) return b.count * sizeof(float);
  const size_t params = model_->num_params(), end = b.offset + b.count;
  const size_t half = b.offset < params ? std::min(end, params) - b.offset : 0;
  return half * sizeof(uint16_t) + (b.count - half) * sizeof(float);
}

int DataParallelStep::launch_bucket(size_t index) {
  const Bucket& b = buckets_[index];
  MLP& m = *model_;
  float* grads = m.grads();
  if (sharded_) {
    const std::vector<size_t>& parts = bucket_parts_[index];
    if (parts.empty()) return 0;  // only the loss and stop slots: they travel in the health check
    if (!half_grads_.size()) {
      if (overlap_) {
        comm_->reduce_scatter_sum_async(grads + b.offset, parts);
        return 1;
      }
      comm_->reduce_scatter_sum(grads + b.offset, parts);
      return 0;
    }
    const size_t n = std::min(b.offset + b.count, m.num_params()) - b.offset;
    uint16_t* half = half_grads_.data() + b.offset;
    m.backend().narrow(half, grads + b.offset, n, options_.grad_dtype);
    if (options_.grad_dtype == Precision::kBF16)
      comm_->reduce_scatter_sum_bf16_async(half, parts);
    else
      comm_->reduce_scatter_sum_fp16_async(half, parts);
    return 1;
  }
  if (!half_grads_.size()) {
    if (overlap_) {
      comm_->allreduce_sum_async(grads + b.offset, b.count);
      return 1;
    }
    comm_->allreduce_sum(grads + b.offset, b.count);
    return 0;
  }
  // Compressed: always queued (completed by wait_all) from the half copy,
  // rounded on the compute stream the collective is ordered after.
  const size_t params = m.num_params(), end = b.offset + b.count;
  int queued = 0;
  if (b.offset < params) {
    const size_t n = std::min(end, params) - b.offset;
    uint16_t* half = half_grads_.data() + b.offset;
    model_->backend().narrow(half, grads + b.offset, n, options_.grad_dtype);
    if (options_.grad_dtype == Precision::kBF16)
      comm_->allreduce_sum_bf16_async(half, n);
    else
      comm_->allreduce_sum_fp16_async(half, n);
    ++queued;
  }
  if (end > params) {  // the loss and stop slots: fp32, exact
    const size_t first = std::max(b.offset, params);
    comm_->allreduce_sum_async(grads + first, end - first);
    ++queued;
  }
  return queued;
}

// Shards balanced by elements, starting at multiples of 16 bytes where every
// rank can have that many; each bucket's parameters cut at the shard bounds.
void DataParallelStep::plan_shards() {
  const size_t ranks = static_cast<size_t>(comm_->size()), params = model_->num_params();
  // Blocking collectives after backward (nothing to overlap): one reduce-scatter of
  // every gradient, which the transport cuts as suits it (MPI: a ring every rank sums
  // in; per bucket, each would have a single owner summing while the others wait).
  if (!overlap_) buckets_ = {Bucket{0, model_->grad_buffer_size(), 0}};
  const size_t align = params >= kBucketAlignElems * ranks ? kBucketAlignElems : 1;
  std::vector<size_t> bound(ranks + 1, params);
  for (size_t r = 0; r < ranks; ++r)  // floor(params * r / ranks), without overflow, then aligned down
    bound[r] = (params / ranks * r + params % ranks * r / ranks) / align * align;
  shard_sizes_.assign(ranks, 0);
  for (size_t r = 0; r < ranks; ++r) shard_sizes_[r] = bound[r + 1] - bound[r];
  shard_offset_ = bound[size_t(comm_->rank())];
  shard_size_ = shard_sizes_[size_t(comm_->rank())];
  for (const Bucket& b : buckets_) {
    const size_t begin = b.offset, end = std::min(b.offset + b.count, params);
    std::vector<size_t> parts;
    if (begin < end) {
      parts.assign(ranks, 0);
      for (size_t r = 0; r < ranks; ++r) {
        const size_t lo = std::max(begin, bound[r]), hi = std::min(end, bound[r + 1]);
        parts[r] = hi > lo ? hi - lo : 0;
      }
    }
    bucket_parts_.push_back(std::move(parts));
  }
  layer_parts_.clear();
  for (int l = 0; l < model_->num_layers(); ++l) {  // each layer's parameters cut by owner
    const size_t begin = model_->weight_offset(l), end = model_->layer_end(l);
    std::vector<size_t> parts(ranks, 0);
    for (size_t r = 0; r < ranks; ++r) {
      const size_t lo = std::max(begin, bound[r]), hi = std::min(end, bound[r + 1]);
      parts[r] = hi > lo ? hi - lo : 0;
    }
    layer_parts_.push_back(std::move(parts));
  }
  optimizer_->restrict_to(shard_offset_, shard_size_);
  shard_sums_ = BackendArray<float>(&model_->backend(), size_t(kShardSums) * ranks);
  shard_sums_parts_.assign(ranks, size_t(kShardSums));
  model_->backend().zero(shard_sums_.data(), size_t(kShardSums) * ranks);
  sharded_ = true;
}

void DataParallelStep::gather_optimizer_state(const std::string& name, float* host_dst) {
  if (!sharded_) {
    optimizer_->get_state(name, host_dst);
    return;
  }
  // Shard by shard through a buffer of the largest shard's size: a checkpoint
  // needs no whole state in backend memory, which sharding exists to avoid.
  Backend& be = model_->backend();
  optimizer_->get_state(name, host_dst + shard_offset_);
  BackendArray<float> piece(&be, *std::max_element(shard_sizes_.begin(), shard_sizes_.end()));
  size_t offset = 0;
  try {
    for (size_t r = 0; r < shard_sizes_.size(); offset += shard_sizes_[r], ++r) {
      const size_t n = shard_sizes_[r];
      if (!n) continue;
      if (r == size_t(comm_->rank())) be.copy_to_backend(piece.data(), host_dst + offset, n * sizeof(float));
      comm_->broadcast(piece.data(), n, static_cast<int>(r));
      be.copy_to_host(host_dst + offset, piece.data(), n * sizeof(float));
    }
  } catch (...) {  // a broadcast that timed out may still write the buffer: never freed then
    if (comm_->may_write_after_failure()) new BackendArray<float>(std::move(piece));
    throw;
  }
}

void DataParallelStep::set_optimizer_state(const std::string& name, const float* host_src) {
  optimizer_->set_state(name, host_src + shard_offset_);
}

void DataParallelStep::broadcast_parameters(int root) {
  model_->await_parameters();
  comm_->broadcast(model_->params(), model_->num_params(), root);
  model_->backend().parameters_changed();  // written by the communicator, not the backend
}

}  // namespace mgpu
