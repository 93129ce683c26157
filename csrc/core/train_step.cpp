// The data-parallel training step (see train_step.h).
#include "train_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "async_signals.h"
#include "errors.h"
#include "staged_communicator.h"

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
                                   std::shared_ptr<Communicator> comm, LossKind loss,
                                   StepOptions options)
    : model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      comm_(std::move(comm)),
      loss_(loss),
      options_(options) {
  MGPU_CHECK(model_ && optimizer_ && comm_, ConfigError, "step needs a model, optimizer and communicator");
  MGPU_CHECK(options_.max_grad_norm >= 0.0f && std::isfinite(options_.max_grad_norm), ConfigError,
             "max_grad_norm must be a finite number >= 0 (0 disables clipping), got ",
             options_.max_grad_norm);
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
  overlap_ = options_.overlap &&
             (comm_->progresses_independently() || !model_->backend().host_accessible());
  if (options_.grad_dtype != Precision::kFP32) {
    MGPU_CHECK(options_.grad_dtype == Precision::kBF16 || options_.grad_dtype == Precision::kFP16, ConfigError,
               "gradients are reduced in fp32, bf16 or fp16, not ", precision_name(options_.grad_dtype));
    MGPU_CHECK(comm_->reduces_half_types(), ConfigError, "gradient compression (",
               precision_name(options_.grad_dtype), " allreduce) needs NCCL between GPUs; the ", comm_->name(),
               " communicator reduces fp32 gradients (use grad dtype fp32)");
    half_grads_ = BackendArray<uint16_t>(&model_->backend(), model_->num_params());
  }
  verdict_ = BackendArray<StepVerdict>(&model_->backend(), 1);
  trace_ = std::make_unique<StepTrace>(model_->backend());
  const Backend& be = model_->backend();
  MGPU_CHECK(options_.graph != StepOptions::Graph::kOn || be.supports_capture(), ConfigError,
             "captured steps (CUDA graphs) need a backend that captures; the ", be.name(), " backend does not");
  // Capture pays where launches cost: device backends (the CPU's recorded
  // calls exist to test this logic and run only when asked for).
  graphs_enabled_ = be.supports_capture() &&
                    (options_.graph == StepOptions::Graph::kOn ||
                     (options_.graph == StepOptions::Graph::kAuto && !be.host_accessible() &&
                      model_->num_params() <= StepOptions::kGraphAutoMaxParams));
}

void DataParallelStep::forward_backward(int rows, const DropoutKey& key, float grad_scale, bool accumulate,
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
  MGPU_CHECK(scale > 0.0f && std::isfinite(scale), ConfigError,
             "loss scale must be a finite number > 0, got ", scale);
  loss_scale_ = scale;
}

StepResult DataParallelStep::step(const std::vector<MicroShard>& shards, int64_t global_batch,
                                  uint64_t step_index, float lr, bool request_stop, bool trace) {
  const AsynchronousSignalsHeld signals_after_the_step;  // one mask change for all its GEMMs
  MLP& m = *model_;
  Backend& be = m.backend();
  MGPU_CHECK(!shards.empty(), ConfigError, "a step needs at least one micro-batch");
  MGPU_CHECK(global_batch >= 1, ConfigError, "global batch must be >= 1");
  int64_t local_rows = 0;
  for (const MicroShard& s : shards) {
    MGPU_CHECK(s.batch.rows >= 0 && s.first_sample >= 0 &&
                   s.first_sample + s.batch.rows <= global_batch,
               ConfigError, "shard of ", s.batch.rows, " rows at sample ", s.first_sample,
               " does not fit a global batch of ", global_batch);
    local_rows += s.batch.rows;
  }
  MGPU_CHECK(local_rows <= global_batch, ConfigError, "this rank's ", local_rows,
             " rows exceed the global batch of ", global_batch);

  using Clock = std::chrono::steady_clock;
  const bool sync_phases = options_.timed && !be.host_accessible();
  auto now = [&] {
    if (sync_phases) be.synchronize();
    return Clock::now();
  };
  auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  StepResult result;
  const auto t_start = now();
  result.started = std::chrono::duration<double>(t_start.time_since_epoch()).count();
  auto t_phase = t_start;
  // Traced: spans between trace marks, which the backend takes in order with its work.
  StepTrace& tr = *trace_;
  if (trace) tr.begin_step(step_index);
  // Spans of this step whose marks have happened, and those an earlier traced step left.
  auto hand_over_spans = [&] {
    if (tr.pending()) result.spans = tr.take_ready();
  };
  // Per-bucket spans (timed and traced steps): host clock reads around each
  // launch, and the transport stamps what completes in the background.
  const bool time_buckets = options_.timed || trace;
  std::vector<int> bucket_queued;  // queued collectives of each launched bucket
  if (time_buckets) {
    comm_->start_collective_timing();
    result.buckets.reserve(buckets_.size());
    bucket_queued.reserve(buckets_.size());
  }

  size_t next_bucket = 0;
  // Launches the buckets whose layer's gradients are complete. The launches are
  // grouped by ready layer whatever the path (per-layer callbacks, one call
  // after a replayed graph, a rank without rows): NCCL schedules a group as a
  // whole, so every rank must group the same collectives the same way.
  auto launch_ready = [&](int layer) {
    if (next_bucket == 0) comm_->begin_step(step_index);  // heartbeat, just before the first collective
    while (next_bucket < buckets_.size() && buckets_[next_bucket].ready_layer >= layer) {
      const Bucket& b = buckets_[next_bucket++];
      const double launched = time_buckets ? seconds(t_start, Clock::now()) : 0.0;
      const int queued = launch_bucket(b);
      if (time_buckets) {
        // A blocking allreduce completed when it returned; queued ones are stamped after the wait.
        const double done = queued ? -1.0 : seconds(t_start, Clock::now());
        result.buckets.push_back({static_cast<int>(next_bucket - 1), b.offset, b.count, bucket_bytes(b),
                                  launched, done});
        bucket_queued.push_back(queued);
      }
      const bool layer_ends = next_bucket == buckets_.size() || buckets_[next_bucket].ready_layer != b.ready_layer;
      if (overlap_ && layer_ends) comm_->progress();
    }
    // Nothing is queued here any more (the loop ends at a layer's end), so this
    // only lets a host-driven transport (MPI) advance what is in flight.
    if (overlap_) comm_->progress();
  };

  // 1-4. Per micro-batch: stage the shard, forward (dropout keyed by seed, step,
  // layer and global sample index), loss and its gradient pre-scaled by
  // loss_scale / global normaliser, backward into the gradient buffer (added
  // after the first). Only the last micro-batch's backward starts the allreduce.
  const double normaliser = loss_ == LossKind::kMSE
                                ? static_cast<double>(global_batch) * m.out_features()
                                : static_cast<double>(global_batch);
  const float grad_scale = static_cast<float>(loss_scale_ / normaliser);
  const UpdateScalars update_args = optimizer_->next_scalars(lr);  // checks lr before anything is queued
  auto replay_args = [&](const DropoutKey& key) {
    return ReplayArgs{key.step, key.first_sample, grad_scale, loss_scale_, update_args};
  };
  // 6-8, the step's tail, on the backend with no host wait (see Backend::step_verdict):
  // the health check's one reduction gives the gradient norm (non-finite when any
  // gradient is) and, with the loss, the verdict: whether the update runs, and
  // its unscale and clip factor g *= (1/scale) * min(1, max_norm / (norm + 1e-6)),
  // which the identical update on every rank applies as it reads each gradient
  // (no pass of its own; the gradient buffer keeps the reduced, still
  // loss-scaled and unclipped values).
  auto verdict = [&] {
    be.step_verdict(verdict_.data(), m.grads(), m.num_params(), m.loss_slot(), loss_scale_, options_.max_grad_norm,
                    comm_->failure_flag());
  };
  auto update = [&] { optimizer_->step(m.params(), m.grads(), lr, verdict_.data()); };
  // One device with nothing to reduce: the last micro-batch's graph holds the
  // tail too, and the whole step is one replay (with accumulation, K replays).
  const bool whole_step_graph = graphs_enabled_ && comm_->size() == 1 && !half_grads_.size();
  int last_with_rows = -1;
  for (size_t k = 0; k < shards.size(); ++k)
    if (shards[k].batch.rows > 0) last_with_rows = static_cast<int>(k);
  bool tail_queued = false;
  // The stop slot travels in the first bucket, which overlap launches during
  // the last backward: write it before any backward runs.
  const float stop_flag = request_stop ? 1.0f : 0.0f;
  be.stage_to_backend(m.stop_slot(), &stop_flag, sizeof(float));
  Clock::time_point t_waited{};
  // An error once buckets are in flight (a failed allocation or launch in
  // backward) aborts them: they use the gradient buffer, which may be freed
  // next, and the peers wait for the buckets this rank will never launch.
  try {
    bool written = false;  // has any micro-batch written the gradient buffer yet?
    for (size_t k = 0; k < shards.size(); ++k) {
      const MicroShard& s = shards[k];
      const bool last = k + 1 == shards.size();
      if (s.batch.rows == 0) continue;
      const int micro = shards.size() > 1 ? static_cast<int>(k) : -1;  // spans name micro-batches when several
      m.stage(s.batch, loss_, /*own_copy=*/graphs_enabled_);
      if (trace) tr.end("stage", "phase", micro);
      const DropoutKey key{m.seed(), step_index, 0, s.first_sample};
      if (graphs_enabled_) {
        // One replay runs forward, loss and backward (and on one device, with
        // the last micro-batch, the tail); the buckets go after it.
        const auto t_staged = now();
        result.timings.forward += seconds(t_phase, t_staged);
        const int rows = s.batch.rows;
        const bool accumulate = written;
        const bool with_tail = whole_step_graph && static_cast<int>(k) == last_with_rows;
        const char* how = run_captured({rows, accumulate, with_tail}, replay_args(key), [&] {
          forward_backward(rows, key, grad_scale, accumulate, nullptr);
          if (with_tail) {
            verdict();
            update();
          }
        });
        if (trace)
          tr.end(detail::concat("forward + loss + backward", with_tail ? " + health check + optimizer" : "", " (",
                                how, ")"),
                 "phase", micro);
        t_phase = now();
        result.timings.backward += seconds(t_staged, t_phase);
        written = true;
        tail_queued = with_tail;
        continue;
      }
      const uint64_t forward_from = tr.here();
      m.forward(s.batch.rows, &key,
                trace ? std::function<void(int)>([&](int l) {
                  tr.end(detail::concat("forward layer ", l), "layer", micro);
                })
                      : nullptr);
      if (trace) tr.close("forward", "phase", micro, forward_from);
      m.loss_forward_backward(loss_, s.batch.rows, grad_scale, nullptr, written);
      if (trace) tr.end("loss", "phase", micro);
      const auto t_forward = now();
      result.timings.forward += seconds(t_phase, t_forward);
      const bool launches = last && overlap_;
      std::function<void(int)> layer_done;
      if (trace)
        layer_done = [&](int l) {
          tr.end(detail::concat("backward layer ", l), "layer", micro);  // before its buckets launch
          if (launches) launch_ready(l);
        };
      else if (launches)
        layer_done = launch_ready;
      const uint64_t backward_from = tr.here();
      m.backward(s.batch.rows, layer_done, written);
      if (trace) tr.close("backward", "phase", micro, backward_from);
      t_phase = now();
      result.timings.backward += seconds(t_forward, t_phase);
      written = true;
    }
    // An empty share contributes zero gradient and zero loss.
    if (!written) be.zero(m.grads(), m.num_params() + 1);
    // (Not whole_step_graph: a capture that failed under kAuto may have turned the graphs off.)
    if (!tail_queued) {
      launch_ready(-1);  // every bucket not yet launched
      // 5. All gradients summed on every rank; from here on every rank computes
      // the same values and takes the same decisions.
      comm_->wait_all();
      if (time_buckets) t_waited = Clock::now();
      if (half_grads_.size()) be.widen(m.grads(), half_grads_.data(), m.num_params(), options_.grad_dtype);
      if (trace) tr.end("allreduce wait", "phase", -1);
    }
  } catch (const std::exception& e) {
    if (next_bucket > 0) comm_->abort(detail::concat("step ", step_index, " failed on this rank: ", e.what()));
    throw;
  }

  result.loss_scale = loss_scale_;
  auto t_comm = t_phase;
  if (!tail_queued && graphs_enabled_) {
    t_comm = now();
    const DropoutKey none{m.seed(), step_index, 0, 0};
    const char* how = run_captured({-1, false, true}, replay_args(none), [&] {
      verdict();
      update();
    });
    if (trace) tr.end(detail::concat("health check + optimizer (", how, ")"), "phase", -1);
  } else if (!tail_queued) {
    verdict();
    if (trace) tr.end("health check", "phase", -1);
    t_comm = now();
    update();
    if (trace) tr.end("optimizer", "phase", -1);
  }
  const auto t_queued = now();  // a host backend has run the tail; a device one has queued it
  StepVerdict v;
  be.copy_to_host(&v, verdict_.data(), sizeof(v));  // the step's one synchronisation
  comm_->raise_if_failed();
  // After the read-back: a device transport's completion events have all fired.
  if (time_buckets) stamp_queued_buckets(result.buckets, bucket_queued, seconds(t_start, t_waited));
  result.loss = v.loss;
  result.stop_requested = v.stop > 0.0f;
  result.grad_norm = v.grad_norm;
  result.applied = v.apply != 0;
  optimizer_->count_step(result.applied);
  if (trace && !result.applied) tr.annotate_last(" [update skipped]");
  if (!result.applied) {
    // Skipped: parameters and optimizer state stay as they were.
    if (options_.dynamic_loss_scale) loss_scale_ = std::max(loss_scale_ * 0.5f, 1e-30f);
    good_steps_ = 0;
  } else if (options_.dynamic_loss_scale && ++good_steps_ >= options_.loss_scale_window) {
    loss_scale_ = std::min(loss_scale_ * 2.0f, 3.0e38f);
    good_steps_ = 0;
  }
  const auto t_end = now();
  // The read-back waits for whatever the device still runs, the peers' allreduce
  // included: waiting, as the straggler check reads it, not this rank's update.
  result.timings.comm_wait = seconds(t_phase, t_comm) + seconds(t_queued, t_end);
  result.timings.optimizer = seconds(t_comm, t_queued);
  result.timings.total = seconds(t_start, t_end);
  hand_over_spans();
  return result;
}

size_t DataParallelStep::bucket_bytes(const Bucket& b) const {
  if (!half_grads_.size()) return b.count * sizeof(float);
  const size_t params = model_->num_params(), end = b.offset + b.count;
  const size_t half = b.offset < params ? std::min(end, params) - b.offset : 0;
  return half * sizeof(uint16_t) + (b.count - half) * sizeof(float);
}

void DataParallelStep::stamp_queued_buckets(std::vector<BucketTiming>& spans, const std::vector<int>& queued,
                                            double waited) {
  const auto times = comm_->collective_times();  // always called: it also ends the stamping
  size_t expected = 0;
  for (int q : queued) expected += static_cast<size_t>(q);
  const bool stamped = times.size() == expected;
  size_t next = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (!queued[i]) continue;
    // A compressed bucket is two collectives (half gradients, fp32 slots): done when both are.
    double done = -1.0;
    for (int k = 0; k < queued[i]; ++k, ++next)
      if (stamped) done = std::max(done, times[next].second);
    // Unstamped (the transport cannot tell): completion was observed when wait_all returned.
    if (!stamped) done = waited;
    // A device clock (CUDA events) may read slightly before the host's launch stamp.
    spans[i].done = std::max(done, spans[i].launch);
  }
}

int DataParallelStep::launch_bucket(const Bucket& b) {
  MLP& m = *model_;
  float* grads = m.grads();
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

void DataParallelStep::broadcast_parameters(int root) {
  comm_->broadcast(model_->params(), model_->num_params(), root);
  model_->backend().parameters_changed();  // written by the communicator, not the backend
}

}  // namespace mgpu
