// The performance model and strategy selector (see perf_model.h).
#include "perf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>

#include "errors.h"
#include "model.h"
#include "train_step.h"

namespace mgpu {
namespace perf {

namespace {

std::string fmt(const char* format, double a) {
  char buf[64];
  const int n = std::snprintf(buf, sizeof(buf), format, a);
  if (n < 0) return std::string();
  if (static_cast<size_t>(n) < sizeof(buf)) return buf;
  std::string out(static_cast<size_t>(n) + 1, '\0');  // a figure of 1e300 with "%.0f": the whole of it
  std::snprintf(out.data(), out.size(), format, a);
  out.resize(static_cast<size_t>(n));
  return out;
}
std::string ms(double seconds) { return fmt(seconds < 0.01 ? "%.3g ms" : "%.1f ms", seconds * 1e3); }
std::string bytes_text(double b) {
  if (b >= 1e9) return fmt("%.2f GB", b / 1e9);
  if (b >= 1e6) return fmt("%.1f MB", b / 1e6);
  return fmt("%.0f kB", b / 1e3);
}
std::string count_text(double n) {
  if (n >= 1e9) return fmt("%.2fB", n / 1e9);
  if (n >= 1e6) return fmt("%.2fM", n / 1e6);
  if (n >= 1e3) return fmt("%.0fK", n / 1e3);
  return fmt("%.0f", n);
}
std::string device_word(const HardwareProfile& hw, int n) {
  const bool cpu = !hw.devices.empty() && hw.devices[0].kind == "cpu";
  return std::to_string(n) + (cpu ? (n == 1 ? " CPU rank" : " CPU ranks") : (n == 1 ? " GPU" : " GPUs"));
}
// Whether the first n devices differ (by name) from the first: mixed GPUs.
bool mixed_devices(const HardwareProfile& hw, int n) {
  for (int i = 1; i < n; ++i)
    if (hw.devices[i].name != hw.devices[0].name) return true;
  return false;
}

// y at x over measured points (ascending x): clamped at the ends, linear in log(x)
// between them, and in log(y) too with log_y.
double lookup_in_log_x(const std::vector<std::pair<double, double>>& points, double x, bool log_y) {
  if (x <= points.front().first) return points.front().second;
  if (x >= points.back().first) return points.back().second;
  const auto hi = std::upper_bound(points.begin(), points.end(), x,
                                   [](double v, const std::pair<double, double>& p) { return v < p.first; });
  const auto& [x0, y0] = *(hi - 1);
  const auto& [x1, y1] = *hi;
  const double t = std::log(x / x0) / std::log(x1 / x0);
  return log_y ? std::exp(std::log(y0) + t * std::log(y1 / y0)) : y0 + t * (y1 - y0);
}

double parameter_count(const std::vector<int>& sizes) {
  double p = 0;
  for (size_t l = 0; l + 1 < sizes.size(); ++l) p += double(sizes[l]) * sizes[l + 1] + sizes[l + 1];
  return p;
}

// Per-device compute of one step at local batch b (seconds), with backward
// broken down per layer for the overlap schedule.
struct DeviceTimes {
  double forward = 0, backward = 0, optimizer = 0, overhead = 0;
  const StepPhases* measured = nullptr;  // in-step phases from topo (then optimizer is the update alone)
  std::vector<double> backward_done;     // [l]: time from backward start until layer l's gradients exist
  std::vector<double> forward_done;      // [l]: time from the first micro-batch's forward start until layer l's output
};

// Whether training replays its steps as graphs: DataParallelStep's rule for
// --cuda-graph (StepOptions::graph).
bool replays_graphs(const Workload& w, const HardwareProfile& hw, int devices, double params) {
  if (w.cuda_graph != "auto") return w.cuda_graph == "on";
  for (int i = 0; i < devices; ++i)  // host backends capture only when asked to; a failed capture runs uncaptured
    if (hw.devices[i].kind == "cpu" || !hw.devices[i].captures) return false;
  return params <= double(StepOptions::kGraphAutoMaxParams);
}

// Launches of a bias gradient's column sums on a GPU (kernels/reduce.cu's
// column_splits): one pass, or partial sums over row splits and then their sum.
int column_sum_launches(double rows, double out) {
  constexpr double kReduceBlocks = 528, kColTile = 32, kRowsPerSplit = 64, kMaxSplits = 64;
  const double splits = std::min({std::ceil(kReduceBlocks / std::ceil(out / kColTile)), std::ceil(rows / kRowsPerSplit),
                                  kMaxSplits, std::floor(2 * kReduceBlocks * kColTile / out)});
  return splits > 1 ? 2 : 1;
}

// Optimizer state one of `devices` holds for P parameters: SGD's momentum, AdamW's two
// moments, fp32; sharded over the devices where the workload says so.
double optimizer_state(double P, const Workload& w, int devices) {
  const double whole = (w.optimizer == "sgd" ? 4.0 : 8.0) * P;
  return w.shard_optimizer && devices > 1 ? whole / devices : whole;
}

double memory_per_device(const std::vector<int>& sizes, int64_t b, const Workload& w, const DeviceProfile& d,
                         const LinkProfile& link, int devices);

// The share of a step's arrays that the last-level cache cannot hold: `sharing` ranks
// each with the arrays of `rows` rows (weights, gradients, optimizer state (its shard
// of `shards`), activations). 0 where the cache is unknown or holds them all.
double cache_miss_share(const std::vector<int>& sizes, int64_t rows, const Workload& w, const DeviceProfile& d,
                        int sharing, int shards) {
  if (!(d.cache_bytes > 0)) return 0.0;
  const double arrays =
      double(std::max(sharing, 1)) *
      memory_per_device(sizes, std::max<int64_t>(rows, 1), w, DeviceProfile{}, LinkProfile{}, std::max(shards, 1));
  return std::clamp(1.0 - d.cache_bytes / arrays, 0.0, 1.0);
}

// shards: the devices the optimizer is sharded over (1: not sharded); this one updates 1/shards of the parameters.
DeviceTimes device_times(const std::vector<int>& sizes, int64_t b, const DeviceProfile& d, const Workload& w,
                         double step_overhead, bool alone, bool use_phases, bool graphs, int sharing, int shards) {
  const GemmRate& rate = d.gemm(w.precision);
  // Measured layer times, where topo took them, at the precision they were taken at.
  const LayerTimes* measured = alone && d.layers_alone.enabled() ? &d.layers_alone : &d.layers;
  if (w.precision != "fp32" || !measured->enabled()) measured = nullptr;
  // With --accumulate K the step runs K micro-batches one after another, the rows
  // split as the trainer splits them (b mod K of them one row larger, the last among
  // them), and only the last one's backward releases buckets: the others' come first.
  const int64_t micro_batches = std::min<int64_t>(w.accumulate, std::max<int64_t>(b, 1));
  // Warm tables time a layer on arrays the caches hold; a step whose arrays outgrow the
  // last-level cache (its largest micro-batch's) meets its layers between them and the cold ones.
  const double miss =
      measured && measured->has_cold()
          ? cache_miss_share(sizes, (b + micro_batches - 1) / micro_batches, w, d, alone ? 1 : sharing, shards)
          : 0.0;
  auto layer = [&](const std::vector<double>& warm, const std::vector<double>& cold, double R, double in, double out) {
    const double t = measured->at(warm, R, in, out);
    return miss > 0 ? t + miss * (measured->at(cold, R, in, out) - t) : t;
  };
  MGPU_CHECK(rate.peak_flops > 0, ConfigError, "device '", d.name, "' has no GEMM rate in its profile");
  MGPU_CHECK(d.memory_bandwidth > 0, ConfigError, "device '", d.name, "' has no memory bandwidth in its profile");
  // A GPU step's kernels as the CUDA backend launches them (costsheet.step_ops lists
  // them; tests/unit/test_perf.py counts them against it); a CPU's calls need no more.
  const bool gpu = d.kind != "cpu";
  // A kernel's cost beyond its work: a launch, or inside a replayed graph its node's
  // time, a short kernel's run included (the graph's own launches are step overhead,
  // below). A GPU kernel launched on its own costs its work or a short kernel's cost in
  // a stream (launch_overhead_s), whichever is longer: the host enqueues the next while
  // the device runs a longer one. A CPU's calls are synchronous: work, then the call.
  const bool nodes = graphs && d.graph_node_s > 0;
  const double L = nodes ? d.graph_node_s : d.launch_overhead_s, B = double(b);
  const bool overlapped_launches = gpu && !nodes;
  auto launched = [&](double work_s) { return overlapped_launches ? std::max(work_s, L) : work_s + L; };
  // A GEMM takes its work at the fitted rate, or its operands' and output's traffic at
  // the memory's bandwidth where that is longer (a few rows against a large weight
  // matrix in half precision reads more than it computes). bytes: as the cost sheet
  // (costsheet.step_ops) counts them.
  auto gemm = [&](double m, double n, double k, double bytes) {
    const double work = 2.0 * m * n * k;
    return work > 0 ? launched(std::max(work / rate.at(work), bytes / d.bandwidth_at(bytes, alone))) : 0.0;
  };
  auto pass = [&](double bytes) { return launched(bytes / d.bandwidth_at(bytes, alone)); };
  const bool half = w.precision == "bf16" || w.precision == "fp16";
  const double eb = half ? 2.0 : 4.0;  // a GEMM operand's bytes (outputs and gradients stay fp32)
  // An activation's ReLU (and dropout) pass: fp32 read and written, + its half copy written
  // for the next GEMM with half-precision operands; backward reads one more array.
  const double act_bytes = half ? 10.0 : 8.0;
  const int layers = static_cast<int>(sizes.size()) - 1;
  DeviceTimes t;
  t.backward_done.assign(layers, 0.0);
  // Forward, loss and backward of one micro-batch of R rows; done[l]: from its
  // backward's start until layer l's gradients exist.
  struct MicroBatch {
    double forward = 0, backward = 0;
    std::vector<double> done, forward_done;
  };
  // accumulating: a later micro-batch, whose weight gradients add onto the step's
  // (their GEMMs read the gradient as well as write it).
  auto micro_batch = [&](double R, bool accumulating) {
    MicroBatch m;
    m.done.assign(layers, 0.0);
    m.forward_done.assign(layers, 0.0);
    for (int l = 0; l < layers; ++l) {
      const double in = sizes[l], out = sizes[l + 1];
      m.forward +=
          (measured ? layer(measured->forward, measured->forward_cold, R, in, out)
                    : gemm(R, out, in, (out * in + R * in) * eb + 8.0 * R * out) + pass(4.0 * R * out) /* bias */) +
          (l + 1 < layers ? pass(act_bytes * R * out) : 0.0) /* relu, dropout */;
      if (gpu && half && l == 0) m.forward += pass(6.0 * R * in);  // the input's half copy
      m.forward_done[l] = m.forward;
    }
    m.forward += pass(12.0 * R * sizes.back());  // loss and its gradient: prediction and target read, gradient written
    if (gpu) m.forward += L;                     // the loss partials' sum
    if (w.dropout > 0) {
      double hidden = 0;
      for (int l = 1; l < layers; ++l) hidden += sizes[l];
      m.forward += R * hidden * d.dropout_s_per_unit;
    }
    for (int l = layers - 1; l >= 0; --l) {
      const double in = sizes[l], out = sizes[l + 1];
      if (measured)
        m.backward += l > 0 ? layer(measured->backward, measured->backward_cold, R, in, out)
                            : layer(measured->backward_weights, measured->backward_weights_cold, R, in, out);
      else
        m.backward += gemm(out, in, R, (R * in + R * out) * eb + (accumulating ? 8.0 : 4.0) * out * in) /* dW */ +
                      pass(4.0 * R * out) /* db */ +
                      (l > 0 ? gemm(R, in, out, (out * in + R * out) * eb + 4.0 * R * in) /* dX */ : 0.0) +
                      (gpu ? (column_sum_launches(R, out) - 1) * L : 0.0);
      if (gpu && half && l == layers - 1) m.backward += pass(6.0 * R * out);  // the loss gradient's half copy
      if (l > 0) m.backward += pass((act_bytes + 4.0) * R * in) /* relu backward */;
      m.done[l] = m.backward;
    }
    return m;
  };
  if (b > 0) {
    const int64_t small = b / micro_batches, larger = b % micro_batches;
    // the first is one of the smaller ones (Trainer.step's bounds), and writes the gradients
    const MicroBatch first = micro_batch(double(small), false);
    const MicroBatch s = micro_batches > 1 ? micro_batch(double(small), true) : first;
    const MicroBatch big = larger > 0 ? micro_batch(double(small + 1), true) : s;
    const MicroBatch& last = larger > 0 ? big : s;
    const double later_small = double(micro_batches - larger - 1);
    t.forward = first.forward + later_small * s.forward + double(larger) * big.forward;
    if (gpu) t.forward += double(micro_batches - 1) * L;  // each later one adds its loss to the step's
    t.backward = first.backward + later_small * s.backward + double(larger) * big.backward;
    for (int l = 0; l < layers; ++l) t.backward_done[l] = t.backward - last.backward + last.done[l];
    t.forward_done = first.forward_done;
  }
  const double P = parameter_count(sizes);
  // Sharded, this device updates and checks its shard only (1/shards of the parameters).
  const bool sharded = shards > 1;
  const double owned = P / std::max(shards, 1);
  const double update_bytes = (w.optimizer == "sgd" ? 20.0 : 28.0) * owned;
  // A kernel launched outside any graph: a sharded step's tail (the health check, the
  // update) runs uncaptured (DataParallelStep::step), as do the gradients' casts.
  auto launched_alone = [&](double bytes) {
    const double work = bytes / d.bandwidth_at(bytes, alone);
    return gpu ? std::max(work, d.launch_overhead_s) : work + d.launch_overhead_s;
  };
  auto tail_pass = [&](double bytes) { return sharded ? launched_alone(bytes) : pass(bytes); };
  const double tail_launch = sharded ? d.launch_overhead_s : L;
  const StepPhases& phases = alone && d.step_phases_alone.enabled() ? d.step_phases_alone : d.step_phases;
  if (use_phases && phases.enabled()) {
    // The update as measured in training, scaled by the bytes this optimizer moves
    // (over the shard where sharded); the health check is part of the measured wait (predict adds it).
    t.measured = &phases;
    t.optimizer = phases.update_at(P) * update_bytes / (StepPhases::kUpdateBytesPerParam * P);
  } else {
    // the health check: the gradients' sum of squares, its partials' sum, the verdict
    // (with half-precision GEMMs the update's kernel also writes the weights' half copy, 2 B each)
    t.optimizer = tail_pass(update_bytes + (half && !sharded ? 2.0 * P : 0.0)) + tail_pass(4.0 * owned) +
                  (gpu ? 2.0 * tail_launch : 0.0);
  }
  // A measured update is fp32's: with half-precision GEMMs its kernel also writes the weights' half copy.
  if (half && t.measured && !sharded) t.optimizer += 2.0 * P / d.bandwidth_at(2.0 * P, alone);
  // Sharded, the update writes its shard only and no half copy: the next forward casts
  // the gathered parameters to half anew (fp32 read, half written: 6 B a parameter).
  if (half && sharded) t.optimizer += launched_alone(6.0 * P);
  // Compressed gradients: narrowed, then the sum widened (sharded: only the shard's),
  // each a kernel launched outside any graph (fp32 read and half written, or the
  // reverse: 6 B a parameter).
  if (w.grad_dtype != "fp32") t.optimizer += launched_alone(6.0 * P) + launched_alone(6.0 * owned);
  t.overhead = step_overhead;
  // Graphs: an argument update and a launch each: the forward/backward graph, and
  // the update's own after the allreduce on several devices or with compressed
  // gradients (on one device with fp32 ones the first graph holds the update too; a
  // sharded step's update is not captured).
  if (graphs)
    t.overhead += (2.0 * double(micro_batches) + ((alone && w.grad_dtype == "fp32") || sharded ? 0.0 : 2.0)) *
                  d.launch_overhead_s;
  if (d.host_to_device_bandwidth > 0) {  // a device's inputs and targets, outside any graph
    const double row_bytes = 4.0 * B * (sizes.front() + sizes.back());
    const double memory = d.memory_bandwidth > 0 ? d.memory_bandwidth : d.host_to_device_bandwidth;
    // resident: two gathers (each row read and written, its 8-byte row number read); else
    // prefetched on a copy stream while the step before computes (what it cannot hide
    // shows), then copied from there into the staged buffers
    const double copied_in =
        std::max(0.0, row_bytes / d.host_to_device_bandwidth - (t.forward + t.backward + t.optimizer));
    t.overhead += (w.data_on_device ? (2.0 * row_bytes + 16.0 * B) / memory : copied_in + 2.0 * row_bytes / memory) +
                  // two a micro-batch, the stop flag, and the prefetch's two copies
                  (2.0 * double(micro_batches) + (w.data_on_device ? 1.0 : 3.0)) * d.launch_overhead_s;
  }
  return t;
}

std::vector<int64_t> shares_by_weight(int64_t total, const std::vector<double>& weights) {
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> counts(weights.size());
  std::vector<std::pair<double, size_t>> remainders;
  int64_t assigned = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double exact = total * weights[i] / sum;
    counts[i] = static_cast<int64_t>(std::floor(exact));
    assigned += counts[i];
    remainders.push_back({-(exact - counts[i]), i});  // largest remainder first, then lowest index
  }
  std::sort(remainders.begin(), remainders.end());
  for (int64_t k = 0; k < total - assigned; ++k) counts[remainders[k % remainders.size()].second] += 1;
  return counts;
}

double memory_per_device(const std::vector<int>& sizes, int64_t b, const Workload& w, const DeviceProfile& d,
                         const LinkProfile& link, int devices) {
  const double P = parameter_count(sizes), B = double(b);
  double mem = 4.0 * P + 4.0 * (P + MLP::kGradExtraSlots) + optimizer_state(P, w, devices);
  double activations = 0, widest = 0;
  for (size_t l = 1; l < sizes.size(); ++l) {
    activations += sizes[l];
    widest = std::max(widest, double(sizes[l]));
  }
  // Half-precision GEMMs: the weights' persistent half copy, and two operand
  // scratch buffers for activations and output gradients.
  if (w.precision == "bf16" || w.precision == "fp16")
    mem += 2.0 * P + 2.0 * 2.0 * B * std::max(widest, double(sizes.front()));
  mem += 4.0 * B * (activations + 2.0 * widest + sizes.front() + sizes.back());
  if (devices > 1) mem += link.buffer_bytes;
  return mem + d.context_bytes;
}

// A band beyond e^3 (20x either way) says nothing a prediction could use.
constexpr double kMaxLogError = 3.0;

void validate(const Workload& w, const HardwareProfile& hw, const Options& o) {
  MGPU_CHECK(w.global_batch >= 1, ConfigError, "global batch must be >= 1, got ", w.global_batch);
  MGPU_CHECK(!hw.devices.empty(), ConfigError, "hardware profile '", hw.name, "' lists no devices");
  MGPU_CHECK(o.memory_margin > 0 && o.memory_margin <= 1, ConfigError, "memory margin must be in (0, 1]");
  MGPU_CHECK(o.price_per_device_hour >= 0 && std::isfinite(o.price_per_device_hour), ConfigError,
             "price must be a finite number >= 0");
  MGPU_CHECK(w.precision == "fp32" || w.precision == "tf32" || w.precision == "bf16" || w.precision == "fp16",
             ConfigError, "unknown precision '", w.precision, "' (expected fp32, tf32, bf16 or fp16)");
  MGPU_CHECK(w.optimizer == "sgd" || w.optimizer == "adamw", ConfigError, "unknown optimizer '", w.optimizer,
             "' (expected sgd or adamw)");
  MGPU_CHECK(w.bucket_elems >= 1, ConfigError, "bucket size must be >= 1 element");
  MGPU_CHECK(w.grad_dtype == "fp32" || w.grad_dtype == "bf16" || w.grad_dtype == "fp16", ConfigError,
             "unknown gradient dtype '", w.grad_dtype, "' (expected fp32, bf16 or fp16)");
  MGPU_CHECK(w.dropout >= 0 && w.dropout < 1, ConfigError, "dropout must be in [0, 1), got ", w.dropout);
  MGPU_CHECK(w.accumulate >= 1, ConfigError, "micro-batches per step (accumulate) must be >= 1, got ", w.accumulate);
  MGPU_CHECK(w.cuda_graph == "auto" || w.cuda_graph == "on" || w.cuda_graph == "off", ConfigError,
             "unknown CUDA graph mode '", w.cuda_graph, "' (expected auto, on or off)");
  // A profile is a file users edit: every number it gives must be one a step can have
  // (a NaN or a negative size would print as a prediction).
  auto finite_at_least_0 = [](double x) { return std::isfinite(x) && x >= 0; };
  MGPU_CHECK(finite_at_least_0(hw.step_overhead_s), ConfigError, "profile '", hw.name,
             "': step overhead must be finite and >= 0, got ", hw.step_overhead_s);
  for (const ErrorBand* b : {&hw.error.compute, &hw.error.compute_together, &hw.error.comm, &hw.error.speedup})
    MGPU_CHECK(std::isfinite(b->low) && std::isfinite(b->high) && b->low <= b->high && b->low >= -kMaxLogError &&
                   b->high <= kMaxLogError,
               ConfigError, "profile '", hw.name,
               "': an error band is a low <= high pair of log(measured / predicted) within +-", kMaxLogError, ", got ",
               b->low, ", ", b->high);
  const LinkProfile& link = hw.link;
  MGPU_CHECK(finite_at_least_0(link.alpha_s) && finite_at_least_0(link.buffer_bytes) &&
                 finite_at_least_0(link.step_sync_s) && link.bus_bandwidth >= 0 /* NaN fails too */,
             ConfigError, "profile '", hw.name,
             "': link latency, bandwidth, buffers and step sync must be finite "
             "(bandwidth may be unbounded) and >= 0");
  for (const CollectiveModel* m : {&link.intra, &link.inter}) {
    bool ok = finite_at_least_0(m->ring_busbw) && finite_at_least_0(m->tree_busbw) && finite_at_least_0(m->nvls_busbw);
    for (int i = 0; i < 3; ++i)
      ok = ok && finite_at_least_0(m->latency_s[i]) && finite_at_least_0(m->hop_s[i]) &&
           finite_at_least_0(m->bw_fraction[i]) && std::isfinite(m->bw_scale_beyond_two[i]) &&
           m->bw_scale_beyond_two[i] > 0;
    MGPU_CHECK(ok, ConfigError, "profile '", hw.name,
               "': the link's collective model needs finite latencies, "
               "bandwidths and fractions >= 0 (scales > 0)");
  }
  for (const DeviceProfile& d : hw.devices) {
    MGPU_CHECK(finite_at_least_0(d.launch_overhead_s) && finite_at_least_0(d.graph_node_s), ConfigError, "device '",
               d.name, "' launch and graph-node times must be finite and >= 0");
    MGPU_CHECK(finite_at_least_0(d.memory_bytes) && finite_at_least_0(d.memory_bandwidth) &&
                   finite_at_least_0(d.host_to_device_bandwidth) && finite_at_least_0(d.context_bytes) &&
                   finite_at_least_0(d.dropout_s_per_unit) && finite_at_least_0(d.cache_bytes),
               ConfigError, "device '", d.name,
               "': memory, bandwidths, context bytes, dropout cost and cache "
               "size must be finite and >= 0");
    for (const GemmRate* r : {&d.fp32, &d.tf32, &d.bf16, &d.fp16})
      MGPU_CHECK(finite_at_least_0(r->peak_flops) && finite_at_least_0(r->half_work_flops), ConfigError, "device '",
                 d.name, "': GEMM rates must be finite and >= 0");
    d.layers.check("device '" + d.name + "' layer times");
    d.layers_alone.check("device '" + d.name + "' layer times (alone)");
    d.step_phases.check("device '" + d.name + "' step phases");
    d.step_phases_alone.check("device '" + d.name + "' step phases (alone)");
    for (const auto* table : {&d.pass_bandwidth, &d.pass_bandwidth_alone})
      for (size_t i = 0; i < table->size(); ++i)
        MGPU_CHECK((*table)[i].first > 0 && (*table)[i].second > 0 && std::isfinite((*table)[i].second) &&
                       (i == 0 || (*table)[i].first > (*table)[i - 1].first),
                   ConfigError, "device '", d.name, "' pass bandwidths must be positive, by ascending bytes");
  }
  for (int n : o.candidates) {
    MGPU_CHECK(n >= 1, ConfigError, "device counts must be >= 1, got ", n);
    MGPU_CHECK(n <= static_cast<int>(hw.devices.size()), ConfigError, "profile '", hw.name, "' has ", hw.devices.size(),
               " device(s); cannot predict ", n);
  }
}

}  // namespace

double training_memory_bytes(const Workload& w, int64_t rows, int devices) {
  MGPU_CHECK(rows >= 1, ConfigError, "rows must be >= 1, got ", rows);
  MGPU_CHECK(devices >= 1, ConfigError, "devices must be >= 1, got ", devices);
  // LinkProfile{}: no communication buffers, whatever the device count
  return memory_per_device(w.resolved_layers(), rows, w, DeviceProfile{}, LinkProfile{}, devices);
}

double optimizer_state_bytes(const Workload& w, int devices) {
  MGPU_CHECK(devices >= 1, ConfigError, "devices must be >= 1, got ", devices);
  return optimizer_state(parameter_count(w.resolved_layers()), w, devices);
}

void LayerTimes::check(const std::string& what) const {
  if (!enabled() && widths.empty() && forward.empty() && backward.empty() && backward_weights.empty()) return;
  auto ascending = [](const std::vector<double>& axis) {
    if (axis.size() < 2 || !(axis[0] > 0)) return false;
    for (size_t i = 1; i < axis.size(); ++i)
      if (!(axis[i] > axis[i - 1])) return false;
    return true;
  };
  MGPU_CHECK(ascending(rows) && ascending(widths), ConfigError, what,
             ": rows and widths must each hold >= 2 positive ascending sizes");
  const size_t cells = rows.size() * widths.size() * widths.size();
  for (const auto* table : {&forward, &backward, &backward_weights}) {
    MGPU_CHECK(table->size() == cells, ConfigError, what, ": a table holds ", table->size(), " times, the grid has ",
               cells, " cells");
    for (double t : *table) MGPU_CHECK(t > 0 && std::isfinite(t), ConfigError, what, ": times must be positive");
  }
  if (forward_cold.empty() && backward_cold.empty() && backward_weights_cold.empty()) return;
  for (const auto* table : {&forward_cold, &backward_cold, &backward_weights_cold}) {
    MGPU_CHECK(table->size() == cells, ConfigError, what, ": a cold table holds ", table->size(),
               " times, the grid has ", cells, " cells");
    for (double t : *table) MGPU_CHECK(t > 0 && std::isfinite(t), ConfigError, what, ": times must be positive");
  }
}

double LayerTimes::at(const std::vector<double>& table, double r, double in, double out) const {
  MGPU_CHECK(rows.size() >= 2 && widths.size() >= 2 && table.size() == rows.size() * widths.size() * widths.size(),
             ConfigError, "layer times: no table for a ", rows.size(), " x ", widths.size(), " x ", widths.size(),
             " grid");
  // Where x falls on an axis: the cell's lower index and fraction, and the
  // factor that carries the edge's rate beyond the largest size.
  struct Place {
    size_t i;
    double f, scale;
  };
  auto place = [](const std::vector<double>& axis, double x) {
    if (x <= axis.front()) return Place{0, 0.0, 1.0};
    if (x >= axis.back()) return Place{axis.size() - 2, 1.0, x / axis.back()};
    const size_t i = static_cast<size_t>(std::upper_bound(axis.begin(), axis.end(), x) - axis.begin()) - 1;
    return Place{i, (x - axis[i]) / (axis[i + 1] - axis[i]), 1.0};
  };
  const Place pr = place(rows, r), pi = place(widths, in), po = place(widths, out);
  const size_t W = widths.size();
  double t = 0;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 2; ++c) {
        const double weight = (a ? pr.f : 1 - pr.f) * (b ? pi.f : 1 - pi.f) * (c ? po.f : 1 - po.f);
        if (weight > 0) t += weight * table[((pr.i + a) * W + pi.i + b) * W + po.i + c];
      }
  return t * pr.scale * pi.scale * po.scale;
}

void StepPhases::check(const std::string& what) const {
  if (params.empty() && update_s.empty() && wait_s.empty() && wait_spread_s.empty()) return;
  MGPU_CHECK(
      update_s.size() == params.size() && wait_s.size() == params.size() && wait_spread_s.size() == params.size(),
      ConfigError, what, ": params, update, wait and wait spread hold ", params.size(), ", ", update_s.size(), ", ",
      wait_s.size(), " and ", wait_spread_s.size(), " values");
  for (size_t i = 0; i < params.size(); ++i) {
    MGPU_CHECK(params[i] > 0 && (i == 0 || params[i] > params[i - 1]), ConfigError, what,
               ": params must be positive and ascending");
    MGPU_CHECK(update_s[i] > 0 && std::isfinite(update_s[i]) && wait_s[i] >= 0 && std::isfinite(wait_s[i]) &&
                   wait_spread_s[i] >= 0 && std::isfinite(wait_spread_s[i]),
               ConfigError, what, ": update times must be positive, waits and their spreads >= 0");
  }
  MGPU_CHECK(ranks >= 1, ConfigError, what, ": ranks must be >= 1");
}

double StepPhases::per_param(const std::vector<double>& seconds, double n) const {
  MGPU_CHECK(!params.empty() && seconds.size() == params.size(), ConfigError, "step phases: ", seconds.size(),
             " times for ", params.size(), " parameter counts");
  std::vector<std::pair<double, double>> points(params.size());
  for (size_t i = 0; i < params.size(); ++i) points[i] = {params[i], seconds[i] / params[i]};
  return lookup_in_log_x(points, n, /*log_y=*/false);
}

double DeviceProfile::bandwidth_at(double bytes, bool alone) const {
  const auto& table = alone && !pass_bandwidth_alone.empty() ? pass_bandwidth_alone : pass_bandwidth;
  return table.empty() ? memory_bandwidth : lookup_in_log_x(table, bytes, /*log_y=*/true);
}

double ErrorBand::center() const { return (std::exp(low) + std::exp(high)) / 2 - 1; }
double ErrorBand::half_width() const { return (std::exp(high) - std::exp(low)) / 2; }

double GemmRate::at(double work_flops) const {
  if (measured.size() >= 2) return lookup_in_log_x(measured, work_flops, /*log_y=*/false);
  return peak_flops * work_flops / (work_flops + std::max(half_work_flops, 0.0));
}

const GemmRate& DeviceProfile::gemm(const std::string& precision) const {
  const GemmRate* r = &fp32;
  if (precision == "tf32") r = &tf32;
  if (precision == "bf16") r = &bf16;
  if (precision == "fp16") r = &fp16;
  return r->peak_flops > 0 ? *r : fp32;
}

namespace {

// Every (algorithm, protocol) pair of the model: fn(name, latency seconds, bandwidth seconds).
template <typename Fn>
void for_each_pair(const CollectiveModel& m, int ranks, double bytes, Fn fn) {
  static const char* kProto[3] = {"LL", "LL128", "Simple"};
  const double n = ranks, factor = 2.0 * (n - 1) / n;
  // A tree's latency_s is that of two ranks (one edge, fitted); every doubling of
  // the ranks adds a level: one hop up and one down. Its busiest link carries no
  // more from 4 ranks on (every rank has at most two children), so its transfer
  // stops growing there, where a ring's 2(n-1)/n goes on towards 2: NCCL's tuner
  // prices every node count above 2 at one bandwidth (tuning.cc).
  const double tree_steps = std::max(0.0, 2.0 * (std::ceil(std::log2(n)) - 1.0));
  const double tree_factor = std::min(factor, 1.5);  // 2(n-1)/n at n = 4
  for (double scale : m.bw_scale_beyond_two)
    MGPU_CHECK(std::isfinite(scale) && scale > 0, ConfigError, "bw_scale_beyond_two must be finite and > 0, got ",
               scale);
  for (int p = 0; p < 3; ++p) {
    if (m.bw_fraction[p] <= 0) continue;
    const double fraction = m.bw_fraction[p] * (ranks > 2 ? m.bw_scale_beyond_two[p] : 1.0);
    if (m.ring_busbw > 0)
      fn(std::string("ring/") + kProto[p], m.latency_s[p] + 2.0 * (n - 1) * m.hop_s[p],
         bytes * factor / (m.ring_busbw * fraction));
    if (m.tree_busbw > 0)  // two ranks too: the inter-node level between two nodes
      fn(std::string("tree/") + kProto[p], m.latency_s[p] + tree_steps * m.hop_s[p],
         bytes * tree_factor / (m.tree_busbw * fraction));
  }
  if (m.nvls_busbw > 0 && ranks > 2)
    fn("nvls/Simple", m.latency_s[CollectiveModel::kSimple] + 2.0 * m.hop_s[CollectiveModel::kSimple],
       bytes * factor / m.nvls_busbw);
}

struct Pick {
  std::string name;
  double latency = 0, transfer = 0;
};

// The fastest pair, as NCCL's tuner picks it, for a collective that moves `share` of
// an allreduce's bytes (1: the allreduce; 1/2: a reduce-scatter or an all-gather).
Pick fastest(const CollectiveModel& m, int ranks, double bytes, double share = 1.0) {
  MGPU_CHECK(m.enabled(), ConfigError, "the collective model has no algorithm with a bandwidth");
  Pick best;
  bool any = false;
  for_each_pair(m, ranks, bytes, [&](const std::string& name, double lat, double transfer) {
    if (!any || lat + share * transfer < best.latency + best.transfer) best = {name, lat, share * transfer};
    any = true;
  });
  MGPU_CHECK(any, ConfigError, "the collective model has no usable protocol (every bw_fraction is 0)");
  return best;
}

}  // namespace

double CollectiveModel::seconds(int ranks, double bytes) const {
  if (ranks <= 1 || bytes <= 0) return 0.0;
  const Pick p = fastest(*this, ranks, bytes);
  return p.latency + p.transfer;
}

std::string CollectiveModel::choice(int ranks, double bytes) const {
  if (ranks <= 1 || bytes <= 0 || !enabled()) return "";
  return fastest(*this, ranks, bytes).name;
}

namespace {

// A ring reduce-scatter is the first half of a ring allreduce and an all-gather the
// second: each device sends (n-1)/n of the buffer instead of 2(n-1)/n, so `share` (1/2)
// scales the bandwidth term. The latency term stays whole although a ring
// reduce-scatter takes n-1 steps, not 2(n-1): the fitted latencies are mostly a
// collective's launch and synchronisation, which every collective pays, and a whole
// one errs on the slow side for collectives no published table measured.
double collective_seconds(const LinkProfile& link, int devices, double bytes, double share) {
  if (devices <= 1 || bytes <= 0) return 0.0;
  if (link.intra.enabled()) {
    const int per_node = link.gpus_per_node > 0 ? link.gpus_per_node : devices;
    if (devices <= per_node) {
      const Pick p = fastest(link.intra, devices, bytes, share);
      return p.latency + p.transfer;
    }
    MGPU_CHECK(link.inter.enabled(), ConfigError, "link '", link.name, "' has no inter-node model; cannot predict ",
               devices, " devices over ", per_node, " per node");
    const int nodes = (devices + per_node - 1) / per_node;
    // Latencies add up along the path; the transfers pipeline (NCCL splits the
    // bytes into chunks that move over NVLink and the network at once), so the
    // slower level's transfer sets the pace.
    const Pick in = fastest(link.intra, per_node, bytes, share),
               out = fastest(link.inter, nodes, bytes / per_node, share);
    return in.latency + out.latency + std::max(in.transfer, out.transfer);
  }
  MGPU_CHECK(link.bus_bandwidth > 0, ConfigError, "link '", link.name, "' has no bandwidth in its profile");
  auto ring = [&](int n, double s) {
    const double steps = 2.0 * (n - 1);
    return steps * link.alpha_s + s * steps / n * bytes / link.bus_bandwidth;
  };
  const double model = ring(devices, share);
  const auto& measured = link.measured;
  if (measured.size() < 2 || link.measured_devices < 2 || bytes < measured.front().first ||
      bytes > measured.back().first)
    return model;
  double at_measured = model;
  for (size_t i = 1; i < measured.size(); ++i) {
    const auto& [b1, t1] = measured[i];
    if (bytes > b1) continue;
    const auto& [b0, t0] = measured[i - 1];
    const double f = std::log(bytes / b0) / std::log(b1 / b0);
    at_measured = std::exp(std::log(t0) + f * (std::log(t1) - std::log(t0)));
    break;
  }
  // The measured allreduce at another device count or another collective: scaled by
  // the ring model's ratio between the two.
  if (devices == link.measured_devices && share == 1.0) return at_measured;
  const double model_at_measured = ring(link.measured_devices, 1.0);
  return model_at_measured > 0 ? at_measured * model / model_at_measured : model;
}

}  // namespace

double LinkProfile::allreduce_seconds(int devices, double bytes) const {
  return collective_seconds(*this, devices, bytes, 1.0);
}

double LinkProfile::reduce_scatter_seconds(int devices, double bytes) const {
  return collective_seconds(*this, devices, bytes, 0.5);
}

std::string LinkProfile::allreduce_choice(int devices, double bytes) const {
  if (!intra.enabled() || devices <= 1) return "";
  const int per_node = gpus_per_node > 0 ? gpus_per_node : devices;
  if (devices <= per_node) return intra.choice(devices, bytes);
  const int nodes = (devices + per_node - 1) / per_node;
  return intra.choice(per_node, bytes) + " in each node + " + inter.choice(nodes, bytes / per_node) + " across " +
         std::to_string(nodes) + " nodes";
}

std::string LinkProfile::reduce_scatter_choice(int devices, double bytes) const {
  if (!intra.enabled() || devices <= 1 || bytes <= 0) return "";
  const int per_node = gpus_per_node > 0 ? gpus_per_node : devices;
  if (devices <= per_node) return fastest(intra, devices, bytes, 0.5).name;
  const int nodes = (devices + per_node - 1) / per_node;
  return fastest(intra, per_node, bytes, 0.5).name + " in each node + " +
         fastest(inter, nodes, bytes / per_node, 0.5).name + " across " + std::to_string(nodes) + " nodes";
}

std::vector<int> Workload::resolved_layers() const {
  // Gradient buffers and bucket offsets count elements in 64 bits: 2^62 keeps their sums exact.
  constexpr double kMaxParams = 4611686018427387904.0;  // 2^62
  if (!layers.empty()) {
    MGPU_CHECK(layers.size() >= 2, ConfigError, "layers need at least an input and an output size");
    for (int s : layers) MGPU_CHECK(s >= 1, ConfigError, "layer sizes must be >= 1");
    MGPU_CHECK(parameter_count(layers) <= kMaxParams, ConfigError, "the layers hold ", parameter_count(layers),
               " parameters; at most 2^62 can be priced");
    return layers;
  }
  MGPU_CHECK(params >= 1 && params <= kMaxParams, ConfigError, "give layer sizes or a parameter count in 1..2^62, got ",
             params);
  // Four square layers of width w hold 4 (w^2 + w) parameters.
  const int width = std::max(1, static_cast<int>(std::lround((-1.0 + std::sqrt(1.0 + params)) / 2.0)));
  return std::vector<int>(5, width);
}

namespace {

double sq(double x) { return x * x; }

const ErrorBand& compute_band(const ErrorModel& e, int devices) {
  return devices > 1 && !e.compute_shared ? e.compute_together : e.compute;
}

// The step's 80 % interval: the compute and communication errors (their centres add,
// their half widths add in quadrature with the timing spread: independent sources). Its
// floor, a tenth of the step, only holds where bands beyond any validated one would cross zero.
void set_step_interval(Prediction& p, const ErrorModel& e) {
  const double comm = e.step_bands ? 0.0 : p.exposed_comm_s, compute = p.step_s - comm;
  const ErrorBand& band = compute_band(e, p.devices);
  const double shift = compute * band.center() + comm * e.comm.center();
  const double half =
      std::sqrt(sq(compute * band.half_width()) + sq(comm * e.comm.half_width()) + sq(p.timing_spread_s));
  p.step_low_s = std::max(0.1 * p.step_s, p.step_s + shift - half);
  p.step_high_s = p.step_s + shift + half;
}

// The speedup's 80 % interval, in log space: log s = log t1 - log tn. A measured speedup
// band gives its centre and half width; otherwise each step's share of compute and
// communication weights its band, and a shared compute error moves both steps alike so
// that only their difference in compute share counts. The timing spreads add in quadrature.
void set_speedup_interval(Prediction& p, const Prediction& one, const ErrorModel& e) {
  const double t1 = one.step_s, tn = p.step_s;
  double shift = 0, variance = sq(one.timing_spread_s / t1) + sq(p.timing_spread_s / tn);
  if (e.speedup_measured) {
    shift = (e.speedup.low + e.speedup.high) / 2;
    variance += sq((e.speedup.high - e.speedup.low) / 2);
  } else {
    const double m1 = one.exposed_comm_s / t1, mn = p.exposed_comm_s / tn, c1 = 1 - m1, cn = 1 - mn;
    const ErrorBand& together = compute_band(e, p.devices);
    shift = c1 * e.compute.center() - cn * together.center() + (m1 - mn) * e.comm.center();
    variance += e.compute_shared ? sq((c1 - cn) * e.compute.half_width())
                                 : sq(c1 * e.compute.half_width()) + sq(cn * together.half_width());
    variance += sq(m1 * e.comm.half_width()) + sq(mn * e.comm.half_width());
  }
  const double half = std::sqrt(variance);
  p.speedup_low = p.speedup * std::exp(shift - half);
  p.speedup_high = p.speedup * std::exp(shift + half);
}

}  // namespace

Prediction predict(const Workload& w, const HardwareProfile& hw, int devices, const Options& o) {
  validate(w, hw, o);
  MGPU_CHECK(devices >= 1 && devices <= static_cast<int>(hw.devices.size()), ConfigError, "profile '", hw.name,
             "' has ", hw.devices.size(), " device(s); cannot predict ", devices);
  const std::vector<int> sizes = w.resolved_layers();
  Prediction p;
  p.devices = devices;
  const int64_t batch = w.global_batch;
  const double params = parameter_count(sizes);
  p.graphs = replays_graphs(w, hw, devices, params);
  // A sharded optimizer on several devices (DataParallelStep: none on one).
  p.sharded = w.shard_optimizer && devices > 1;
  const int shards = p.sharded ? devices : 1;
  p.optimizer_state_bytes = optimizer_state(params, w, devices);
  // Shares: proportional to each device's throughput at an equal split.
  // Measured in-step phases count only where every device has them: a device
  // without would add its modelled health check beside the measured wait.
  bool use_phases = true;
  for (int i = 0; i < devices; ++i)
    use_phases &= hw.devices[i].step_phases.enabled() || (devices == 1 && hw.devices[i].step_phases_alone.enabled());
  // ranks on one node share its last-level cache
  const int sharing = hw.link.gpus_per_node > 0 ? std::min(devices, hw.link.gpus_per_node) : devices;
  std::vector<double> speed(devices);
  for (int i = 0; i < devices; ++i) {
    const int64_t b = std::max<int64_t>(1, batch / devices);
    const DeviceTimes t =
        device_times(sizes, b, hw.devices[i], w, 0.0, devices == 1, use_phases, p.graphs, sharing, shards);
    speed[i] = b / std::max(t.forward + t.backward, 1e-30);
  }
  if (!o.share_weights.empty()) {
    bool valid = static_cast<int>(o.share_weights.size()) == devices;
    for (double s : o.share_weights) valid &= std::isfinite(s) && s >= 0;
    valid = valid && *std::max_element(o.share_weights.begin(), o.share_weights.end()) > 0;
    MGPU_CHECK(valid, ConfigError, "batch shares: need ", devices,
               " finite non-negative weights with a positive sum, got ", o.share_weights.size());
  }
  p.batch_shares = shares_by_weight(batch, !o.share_weights.empty() ? o.share_weights
                                           : o.equal_shares         ? std::vector<double>(devices, 1.0)
                                                                    : speed);

  std::vector<DeviceTimes> times;
  double compute_end = 0, optimizer = 0, overhead = 0;
  // Memory: each device against its own capacity (mixed GPUs hold unequal shares); the
  // prediction reports the device closest to its limit. A capacity of 0: unknown.
  double memory = 0, usable = 0, tightest = -1;
  bool fits = true;
  for (int i = 0; i < devices; ++i) {
    times.push_back(device_times(sizes, p.batch_shares[i], hw.devices[i], w, hw.step_overhead_s, devices == 1,
                                 use_phases, p.graphs, sharing, shards));
    const DeviceTimes& t = times.back();
    compute_end = std::max(compute_end, t.forward + t.backward);
    p.forward_s = std::max(p.forward_s, t.forward);
    p.backward_s = std::max(p.backward_s, t.backward);
    optimizer = std::max(optimizer, t.optimizer);
    overhead = std::max(overhead, t.overhead);
    // activations for the largest micro-batch: they are reused from one to the next
    const int64_t share = p.batch_shares[i], k = std::min<int64_t>(w.accumulate, std::max<int64_t>(share, 1));
    const double need = memory_per_device(sizes, (share + k - 1) / k, w, hw.devices[i], hw.link, devices);
    const double capacity = hw.devices[i].memory_bytes * o.memory_margin;
    fits &= capacity <= 0 || need <= capacity;
    const double load = capacity > 0 ? need / capacity : 0.0;
    if (load > tightest || (load == tightest && need > memory)) {
      tightest = load;
      memory = need;
      usable = std::max(0.0, capacity);
    }
  }
  // The allreduce of each bucket can start once every device has its gradients;
  // replayed steps allreduce after the whole backward (DataParallelStep::overlaps()).
  // Sharded, a reduce-scatter takes each bucket's place on the same schedule.
  // Without overlap the step reduces its buckets after backward, blocking; sharded, as one
  // reduce-scatter of the whole gradient (DataParallelStep::plan_shards).
  const bool overlapped = hw.link.overlaps_compute && !p.graphs && o.overlap;
  const size_t bucket_elems = o.overlap || !p.sharded ? static_cast<size_t>(w.bucket_elems)
                                                      : static_cast<size_t>(params) + MLP::kGradExtraSlots;
  if (devices > 1) {
    double channel_free = 0;
    for (const BucketRun& run : plan_bucket_runs(sizes, MLP::kGradExtraSlots, bucket_elems)) {
      const double bytes = (w.grad_dtype == "fp32" ? 4.0 : 2.0) * run.count;
      const double t =
          p.sharded ? hw.link.reduce_scatter_seconds(devices, bytes) : hw.link.allreduce_seconds(devices, bytes);
      p.comm_s += double(run.repeat) * t;
      double ready = compute_end;
      if (overlapped) {
        ready = 0;
        for (const DeviceTimes& d : times) ready = std::max(ready, d.forward + d.backward_done[run.ready_layer]);
      }
      // the run's buckets are ready together: the first waits for them, the rest queue behind it
      channel_free = std::max(channel_free, ready) + double(run.repeat) * t;
    }
    p.exposed_comm_s = std::max(0.0, channel_free - compute_end);
    if (p.sharded) {
      // After the last bucket, the health check's shares (kShardSums floats a device:
      // latency, in effect), exposed; after the update, the parameters in fp32
      // (compression narrows gradients only).
      const double sums = hw.link.all_gather_seconds(devices, 4.0 * kShardSums * devices);
      double params_gather = hw.link.all_gather_seconds(devices, 4.0 * params), params_exposed = params_gather;
      if (overlapped) {
        // Layer by layer, the next forward waiting for each layer just before it
        // (DataParallelStep::gather_parameters): exposed, the waits of the device that waits longest.
        std::vector<double> arrived;
        params_gather = 0;
        for (size_t l = 0; l + 1 < sizes.size(); ++l) {
          params_gather += hw.link.all_gather_seconds(devices, 4.0 * (double(sizes[l]) * sizes[l + 1] + sizes[l + 1]));
          arrived.push_back(params_gather);
        }
        params_exposed = 0;
        for (const DeviceTimes& d : times) {
          double end = 0, before = 0;  // the forward's clock, from the update's end
          for (size_t l = 0; l < arrived.size() && l < d.forward_done.size(); ++l) {
            end = std::max(end, arrived[l]) + (d.forward_done[l] - before);
            before = d.forward_done[l];
          }
          params_exposed = std::max(params_exposed, end - before);
        }
      }
      p.gather_s = sums + params_gather;
      p.gather_exposed_s = sums + params_exposed;
      p.comm_s += p.gather_s;
      p.exposed_comm_s += p.gather_exposed_s;
    }
  }
  // Measured in-step phases (CPU calibrations): the wait after backward as
  // training met it at the calibration's world and bucket size, moved by what
  // the link model says this world and bucket size change. It holds the health
  // check, and with several ranks their skew and control messages.
  double measured_wait = -1;
  int measured_ranks = 0;
  for (const DeviceTimes& t : times) {
    const double wait = t.measured ? t.measured->wait_at(params) : -1;
    if (wait > measured_wait) {
      measured_wait = wait;
      measured_ranks = t.measured->ranks;
      p.timing_spread_s = t.measured->wait_spread_at(params);
    }
  }
  if (measured_wait >= 0) {
    double reference = 0;  // what the measured wait already holds of the allreduce
    if (measured_ranks > 1)
      for (const BucketRun& run : plan_bucket_runs(sizes, MLP::kGradExtraSlots, size_t(StepPhases::kBucketElems)))
        reference += double(run.repeat) * hw.link.allreduce_seconds(measured_ranks, 4.0 * run.count);
    if (devices == 1)  // the health check and bookkeeping, without any allreduce
      optimizer += std::max(0.0, measured_wait - reference);
    else if (o.overlap)
      p.exposed_comm_s = std::max(0.0, measured_wait + p.exposed_comm_s - reference);
    else  // nothing hidden: the whole allreduce, and what the wait held beyond the calibration's
      p.exposed_comm_s += std::max(0.0, measured_wait - reference);
  }
  p.optimizer_s = optimizer;
  p.overhead_s = overhead;
  // The ranks' skew and control messages: in a wait measured with several ranks already.
  if (devices > 1 && measured_ranks < 2) overhead += hw.link.step_sync_s;
  p.bucket_elems = static_cast<int64_t>(bucket_elems);
  p.step_s = overhead + compute_end + p.exposed_comm_s + optimizer;
  p.samples_per_s = batch / p.step_s;
  p.memory_bytes = memory;
  p.memory_usable_bytes = usable;
  p.memory_fits = fits;
  if (o.price_per_device_hour > 0)
    p.cost_per_million_samples = devices * o.price_per_device_hour / 3600.0 * p.step_s / batch * 1e6;
  set_step_interval(p, hw.error);
  if (devices > 1) {
    Options alone = o;  // one device takes the whole batch, whatever the shares
    alone.share_weights.clear();
    const Prediction one = predict(w, hw, 1, alone);
    p.speedup = one.step_s / p.step_s;
    double ideal = 0;  // what perfect scaling would give on these (possibly unequal) devices
    for (double s : speed) ideal += o.equal_shares ? 1.0 : s / speed[0];
    p.efficiency = p.speedup / ideal;
    set_speedup_interval(p, one, hw.error);
  }
  return p;
}

namespace {

// A candidate as recommend() compares it: at its own best bucket where the options ask.
Prediction predict_candidate(const Workload& w, const HardwareProfile& hw, int devices, const Options& o) {
  if (!o.choose_buckets || devices < 2) return predict(w, hw, devices, o);
  Workload chosen = w;
  chosen.bucket_elems = choose_bucket(w, hw, devices, o, o.max_bucket_bytes).bucket_elems;
  return predict(chosen, hw, devices, o);
}

double best_multi_speedup(const Workload& w, const HardwareProfile& hw, const Options& o,
                          const std::vector<int>& counts) {
  double best = 0;
  for (int n : counts)
    if (n > 1 && w.global_batch >= n) best = std::max(best, predict_candidate(w, hw, n, o).speedup);
  return best;
}

int64_t break_even_batch(Workload w, const HardwareProfile& hw, const Options& o, const std::vector<int>& counts) {
  int largest = 1;
  for (int n : counts) largest = std::max(largest, n);
  if (largest < 2) return -1;
  auto wins = [&](int64_t batch) {
    w.global_batch = batch;
    return best_multi_speedup(w, hw, o, counts) > 1.0;
  };
  int64_t hi = 2;
  constexpr int64_t kLimit = int64_t{1} << 24;
  while (hi <= kLimit && !wins(hi)) hi *= 2;
  if (hi > kLimit) return -1;
  int64_t lo = hi / 2;  // does not win (or is 1)
  if (lo < 2) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (wins(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace

namespace {

// "a global batch of B", or with accumulation "micro-batches of m samples (a global batch of B in K)".
std::string rows_text(const Workload& w) {
  const int64_t micro_rows = w.global_batch / w.accumulate;
  const std::string batch_text = "a global batch of " + std::to_string(w.global_batch);
  return w.accumulate == 1
             ? batch_text
             : "micro-batches of " + std::to_string(micro_rows) + (micro_rows == 1 ? " sample" : " samples") + " (" +
                   batch_text + " in " + std::to_string(w.accumulate) + ")";
}
const char* rows_verb(const Workload& w) { return w.accumulate > 1 ? " give" : " gives"; }

}  // namespace

Decision decide_strategy(const Workload& w, const HardwareProfile& hw, const Options& options) {
  Options o = options;
  if (o.candidates.empty())
    for (int n = 1; n <= static_cast<int>(hw.devices.size()); ++n) o.candidates.push_back(n);
  validate(w, hw, o);
  std::sort(o.candidates.begin(), o.candidates.end());
  o.candidates.erase(std::unique(o.candidates.begin(), o.candidates.end()), o.candidates.end());
  const std::vector<int> sizes = w.resolved_layers();

  Decision d;
  d.params = parameter_count(sizes);
  d.price_per_device_hour = o.price_per_device_hour;
  // Every device needs a sample of every micro-batch (train refuses a step that leaves
  // a rank without one): the smallest micro-batch bounds the devices.
  MGPU_CHECK(w.accumulate <= w.global_batch, ConfigError, "accumulate ", w.accumulate,
             " is larger than the global batch ", w.global_batch, ": a micro-batch needs at least one sample");
  const int64_t micro_rows = w.global_batch / w.accumulate;
  std::vector<int> too_many;  // more devices than samples: some would get none
  for (int n : o.candidates) {
    if (micro_rows >= n)
      d.candidates.push_back(predict_candidate(w, hw, n, o));
    else
      too_many.push_back(n);
  }
  MGPU_CHECK(!d.candidates.empty(), ConfigError, rows_text(w), rows_verb(w),
             " some device of every candidate count no sample");
  const std::vector<Prediction>& c = d.candidates;
  int best_multi = -1;  // the fastest multi-device candidate that fits
  for (int i = 0; i < static_cast<int>(c.size()); ++i) {
    if (c[i].devices == 1) d.one = i;
    if (!c[i].memory_fits) continue;
    if (d.pick < 0 || c[i].step_s < c[d.pick].step_s) d.pick = i;
    if (c[i].devices > 1 && (best_multi < 0 || c[i].step_s < c[best_multi].step_s)) best_multi = i;
  }
  const int one = d.one, best = d.pick;
  // How far apart two predictions must be to differ: the relative half width of the
  // fastest multi-device candidate's speedup interval (its geometric half).
  const double err =
      best_multi >= 0 ? std::max(0.01, std::sqrt(c[best_multi].speedup_high / c[best_multi].speedup_low) - 1) : 0.01;
  using Kind = Reason::Kind;
  auto reason = [&d](Kind kind, int candidate = -1) -> Reason& {
    d.reasons.push_back(Reason{});
    d.reasons.back().kind = kind;
    d.reasons.back().candidate = candidate;
    return d.reasons.back();
  };

  // The decision.
  if (best < 0) {
    d.strategy = Decision::Strategy::kDoesNotFit;
    const int smallest = static_cast<int>(
        std::min_element(c.begin(), c.end(),
                         [](const Prediction& a, const Prediction& b) { return a.memory_bytes < b.memory_bytes; }) -
        c.begin());
    d.devices = c[smallest].devices;
    reason(Kind::kNoCandidateFits, smallest).value = o.memory_margin;
  } else if (one >= 0 && !c[one].memory_fits) {
    d.strategy = Decision::Strategy::kMultiGpu;
    d.devices = c[best].devices;
    reason(Kind::kOneCannotHold, one).other = best;
  } else if (best_multi < 0) {
    d.strategy = Decision::Strategy::kSingleGpu;
    d.devices = 1;
    bool multi = false;
    for (const Prediction& p : c) multi |= p.devices > 1;
    reason(Kind::kNoMultiToCompare).flag = multi;
  } else if (c[best_multi].speedup_low > 1.0) {  // the whole 80 % interval of its speedup above 1.0x
    d.strategy = Decision::Strategy::kMultiGpu;
    d.devices = c[best_multi].devices;
  } else if (c[best_multi].speedup_high < 1.0) {
    d.strategy = Decision::Strategy::kSingleGpu;
    d.devices = 1;
    reason(Kind::kOneIsFaster, best_multi);
  } else {
    d.strategy = Decision::Strategy::kBenchmarkRequired;
    d.devices = c[best].devices;
    reason(Kind::kGainWithinError, best_multi);
  }
  // A sharded optimizer where the workload has none: said where it would change the
  // answer, for the fastest multi-device count it helps: one that fits only sharded
  // (and beats the pick), or a sharded step faster than the pick by more than the error.
  if (!w.shard_optimizer) {
    Workload sharded = w;
    sharded.shard_optimizer = true;
    int at = -1;
    std::optional<Prediction> alternative;
    for (int i = 0; i < static_cast<int>(c.size()); ++i) {
      if (c[i].devices < 2) continue;
      Prediction q = predict_candidate(sharded, hw, c[i].devices, o);
      if (!q.memory_fits || (alternative && q.step_s >= alternative->step_s)) continue;
      const bool helps = c[i].memory_fits ? best >= 0 && q.step_s * (1.0 + err) < c[best].step_s
                                          : best < 0 || q.step_s < c[best].step_s;
      if (!helps) continue;
      at = i;
      alternative = std::move(q);
    }
    if (alternative) {
      Reason& r = reason(Kind::kShardingWouldHelp, at);
      r.other = best;
      r.flag = !c[at].memory_fits;
      r.value = c[at].optimizer_state_bytes;
      r.value2 = err;
      r.alternative = std::move(alternative);
    }
  }

  // Why, in numbers.
  if (one >= 0) reason(Kind::kOneDeviceStep, one);
  for (int i = 0; i < static_cast<int>(c.size()); ++i)
    if (c[i].devices != 1) reason(Kind::kMultiDeviceStep, i).value = 4.0 * (d.params + MLP::kGradExtraSlots);
  const int shown = best_multi >= 0 ? best_multi : one >= 0 ? one : 0;
  if (c[shown].graphs) {
    reason(Kind::kGraphReplay, shown).flag = best_multi >= 0;
    // Overlap can be worth more than the launches graphs save (a slow link, a large
    // allreduce): say so where uncaptured steps beat this answer's pick.
    if (best >= 0 && w.cuda_graph == "auto" && hw.link.overlaps_compute) {
      Workload uncaptured = w;
      uncaptured.cuda_graph = "off";
      std::optional<Prediction> faster;
      for (const Prediction& p : c) {
        Prediction q = predict_candidate(uncaptured, hw, p.devices, o);
        if (q.memory_fits && q.step_s < c[best].step_s * 0.98 && (!faster || q.step_s < faster->step_s))
          faster = std::move(q);
      }
      if (faster) {
        Reason& r = reason(Kind::kUncapturedFaster);
        r.other = best;
        r.alternative = std::move(faster);
      }
    }
  }
  // Unequal devices: what the slower ones add over the first (fastest) alone, and the shares.
  for (int i = 0; i < static_cast<int>(c.size()); ++i)
    if (mixed_devices(hw, c[i].devices) && one >= 0) reason(Kind::kUnequalDevices, i);
  if (best_multi >= 0) {
    const double bucket_bytes = (w.grad_dtype == "fp32" ? 4.0 : 2.0) *  // on the wire
                                std::min<double>(double(c[best_multi].bucket_elems), d.params);
    const std::string how = c[best_multi].sharded ? hw.link.reduce_scatter_choice(c[best_multi].devices, bucket_bytes)
                                                  : hw.link.allreduce_choice(c[best_multi].devices, bucket_bytes);
    if (!how.empty()) {
      Reason& r = reason(Kind::kAllreduceAlgorithm, best_multi);
      r.value = bucket_bytes;
      r.text = how;
    }
  }
  d.break_even_batch = break_even_batch(w, hw, o, o.candidates);
  if (d.break_even_batch > 0) {
    Reason& r = reason(Kind::kBreakEven);
    r.count = d.break_even_batch;
    r.flag = w.global_batch >= d.break_even_batch;
  } else if (o.candidates.back() > 1) {
    reason(Kind::kNeverBreaksEven);
  }
  for (int n : too_many) reason(Kind::kDevicesLeftOut).count = n;
  reason(Kind::kMemory, best >= 0 ? best : 0);
  reason(Kind::kProfile);

  // How sure: the source of the numbers, and how far the decision is from the error band.
  const double base = hw.source == "calibrated" ? 0.9 : hw.source == "detected" ? 0.7 : 0.6;
  // How many half widths of its 80 % interval the speedup's interval centre lies from 1.0x (in log space).
  const double margin =
      best_multi >= 0
          ? std::fabs(std::log(c[best_multi].speedup_low * c[best_multi].speedup_high) / 2) / std::log1p(err)
          : 2.0;
  d.confidence = std::clamp(base * std::min(1.0, 0.5 + 0.25 * margin), 0.05, 0.99);
  return d;
}

namespace {

std::string word_reason(const Reason& r, const Decision& d, const Workload& w, const HardwareProfile& hw) {
  using Kind = Reason::Kind;
  const Prediction* p = r.candidate >= 0 ? &d.candidates[r.candidate] : nullptr;
  const Prediction* other = r.other >= 0 ? &d.candidates[r.other] : nullptr;
  switch (r.kind) {
    case Kind::kNoCandidateFits:
      return "no candidate fits in memory: at best " + bytes_text(p->memory_bytes) + " per device against " +
             bytes_text(p->memory_usable_bytes) + " usable (" + fmt("%.0f%%", r.value * 100) +
             " of the device); lower the batch, use bf16/fp16, or SGD instead of AdamW";
    case Kind::kOneCannotHold:
      return "one device cannot hold it (" + bytes_text(p->memory_bytes) + " > " + bytes_text(p->memory_usable_bytes) +
             " usable); " + device_word(hw, other->devices) + " split the batch so each holds " +
             bytes_text(other->memory_bytes);
    case Kind::kNoMultiToCompare:
      return r.flag ? "no multi-device candidate fits in memory" : "no multi-device candidate to compare with";
    case Kind::kOneIsFaster:
      return fmt("%.2fx", p->speedup) + fmt(" (80%% interval %.2f", p->speedup_low) +
             fmt("-%.2fx): one device is faster", p->speedup_high);
    case Kind::kGainWithinError:
      return fmt(p->speedup >= 1.0 ? "the predicted gain (%.2fx) is within the model's error"
                                   : "the predicted loss (%.2fx) is within the model's error",
                 p->speedup) +
             fmt(" (80%% interval %.2f", p->speedup_low) +
             fmt("-%.2fx spans 1.0x): measure it with `mgpu bench`", p->speedup_high);
    case Kind::kOneDeviceStep:
      return device_word(hw, 1) + ": " + ms(p->step_s) + " a step (forward " + ms(p->forward_s) + ", backward " +
             ms(p->backward_s) + ", optimizer " + ms(p->optimizer_s) + ", overhead " + ms(p->overhead_s) + "), " +
             count_text(p->samples_per_s) + " samples/s";
    case Kind::kMultiDeviceStep: {
      std::string line = device_word(hw, p->devices) + ": " + ms(p->step_s) + " a step, " + fmt("%.2fx", p->speedup) +
                         fmt(" (efficiency %.0f%%)", p->efficiency * 100) + "; the " + bytes_text(r.value);
      // The wait after backward holds the ranks' skew and the health check beside the
      // collective: where it is longer than the collective, it is not "part of it".
      const auto exposed_text = [&](double collective, double wait) {
        return wait <= collective + 1e-12 ? ", " + ms(wait) + " of it not hidden behind backward"
                                          : "; the wait after backward " + ms(wait) +
                                                " (what backward does not hide, the ranks' skew and the health check)";
      };
      if (p->sharded)
        line += " gradient reduce-scatter (optimizer sharded) takes " + ms(p->comm_s - p->gather_s) +
                exposed_text(p->comm_s - p->gather_s, std::max(0.0, p->exposed_comm_s - p->gather_exposed_s)) +
                ", the parameters' all-gather after the update " + ms(p->gather_s) +
                (p->gather_exposed_s < p->gather_s - 1e-9
                     ? " (" + ms(p->gather_exposed_s) + " of it not hidden behind the next forward)"
                     : std::string()) +
                "; optimizer state " + bytes_text(p->optimizer_state_bytes) + " a device";
      else
        line += " gradient allreduce takes " + ms(p->comm_s) + exposed_text(p->comm_s, p->exposed_comm_s);
      if (p->comm_s > 0)
        line += fmt("; communication/computation %.2f", p->comm_s / std::max(p->forward_s + p->backward_s, 1e-30));
      return line;
    }
    case Kind::kGraphReplay: {
      const DeviceProfile& dev = hw.devices[0];
      std::string line =
          std::string("steps replay as CUDA graphs (") +
          (w.cuda_graph == "on" ? std::string("--cuda-graph on")
                                : "--cuda-graph auto: GPUs, models up to " +
                                      count_text(double(StepOptions::kGraphAutoMaxParams)) + " parameters") +
          "): ";
      line += dev.graph_node_s > 0 ? fmt("a kernel costs %.2g us as a graph node", dev.graph_node_s * 1e6) +
                                         fmt(" instead of a %.2g us launch", dev.launch_overhead_s * 1e6)
                                   : std::string("kernels priced as launches (the profile has no graph-node time)");
      if (r.flag) line += "; the allreduce follows backward instead of overlapping it";
      return line;
    }
    case Kind::kUncapturedFaster: {
      const Prediction& faster = *r.alternative;
      return "--cuda-graph off would be faster: " + device_word(hw, faster.devices) + " at " + ms(faster.step_s) +
             " a step against " + ms(other->step_s) + " for " + device_word(hw, other->devices) +
             " with graphs, the allreduce overlapping backward (" + ms(faster.exposed_comm_s) + " exposed)";
    }
    case Kind::kUnequalDevices: {
      std::string names, shares, flag;
      for (int i = 0; i < p->devices; ++i) {
        names += (i ? " + " : "") + hw.devices[i].name;
        shares += (i ? ", " : "") + std::to_string(p->batch_shares[i]);
        flag += (i ? "," : "") + std::to_string(p->batch_shares[i]);
      }
      const double gain = p->speedup - 1.0;
      return "unequal devices (" + names + "): batch shares " + shares + " by device speed; " +
             (gain > 0 ? fmt("adding the slower device helps: %.2fx", p->speedup) +
                             fmt(" (%+.0f%%) over ", gain * 100) + hw.devices[0].name + " alone"
                       : fmt("adding the slower device does not help: %.2fx", p->speedup) +
                             fmt(" (%+.0f%%) of ", gain * 100) + hw.devices[0].name + " alone") +
             "; train with --batch-shares " + flag;
    }
    case Kind::kAllreduceAlgorithm:
      return std::string(p->sharded ? "reduce-scatter" : "allreduce") + " of one " + bytes_text(r.value) +
             " bucket on " + device_word(hw, p->devices) + ": " + r.text +
             " (NCCL-shaped model, fitted to published nccl-tests tables)";
    case Kind::kBreakEven:
      return "several devices beat one from a global batch of " + std::to_string(r.count) +
             (r.flag ? " (this one is above it)" : " (this one is below it)");
    case Kind::kNeverBreaksEven: return "several devices never beat one for this model up to a global batch of 16M";
    case Kind::kDevicesLeftOut:
      return device_word(hw, static_cast<int>(r.count)) + " left out: " + rows_text(w) + rows_verb(w) +
             " some of them no sample";
    case Kind::kMemory:
      // unequal devices: the figures are the one nearest its capacity
      return "memory: " + bytes_text(p->memory_bytes) +
             (mixed_devices(hw, p->devices) ? " on the device nearest its capacity" : " per device") +
             (p->memory_usable_bytes > 0 ? " of " + bytes_text(p->memory_usable_bytes) + " usable" : "");
    case Kind::kProfile:
      return "profile '" + hw.name + "' (" + hw.source + ")" +
             (hw.source == "calibrated" ? "" : ": run `python -m mgpu topo` on the machine to calibrate");
    case Kind::kShardingWouldHelp: {
      const Prediction& q = *r.alternative;
      const std::string state =
          "optimizer state " + bytes_text(r.value) + " -> " + bytes_text(q.optimizer_state_bytes) + " a device";
      if (r.flag)
        return device_word(hw, q.devices) + " fit with --shard-optimizer: " + state + " (" +
               bytes_text(q.memory_bytes) +
               (q.memory_usable_bytes > 0 ? " of " + bytes_text(q.memory_usable_bytes) + " usable" : std::string()) +
               "), " + ms(q.step_s) + " a step" + (d.one >= 0 ? fmt(", %.2fx one device", q.speedup) : std::string());
      return "--shard-optimizer would be faster: " + device_word(hw, q.devices) + " at " + ms(q.step_s) +
             " a step against " + ms(other->step_s) + " for " + device_word(hw, other->devices) +
             fmt(" (beyond the model's +-%.0f%%)", r.value2 * 100) + ": the update on 1/" + std::to_string(q.devices) +
             " of the parameters, " + ms(q.gather_s) + " of all-gathers after it; " + state;
    }
  }
  return "";
}

const char* strategy_name(Decision::Strategy s) {
  switch (s) {
    case Decision::Strategy::kSingleGpu: return "single_gpu";
    case Decision::Strategy::kMultiGpu: return "multi_gpu";
    case Decision::Strategy::kBenchmarkRequired: return "benchmark_required";
    case Decision::Strategy::kDoesNotFit: return "does_not_fit";
  }
  return "";
}

}  // namespace

Recommendation word_decision(const Decision& d, const Workload& w, const HardwareProfile& hw) {
  Recommendation r;
  r.strategy = strategy_name(d.strategy);
  r.devices = d.devices;
  r.candidates = d.candidates;
  r.break_even_batch = d.break_even_batch;
  r.confidence = d.confidence;
  r.profile = hw.name;
  r.profile_source = hw.source;
  r.params = d.params;
  for (const Reason& reason : d.reasons) r.reasons.push_back(word_reason(reason, d, w, hw));
  if (d.price_per_device_hour > 0 && d.one >= 0) {
    const Prediction& one = d.candidates[d.one];
    const Prediction& pick = d.pick >= 0 ? d.candidates[d.pick] : one;
    r.roi = fmt("at %.2f per device-hour: ", d.price_per_device_hour) + device_word(hw, 1) +
            fmt(" costs %.3f per million samples", one.cost_per_million_samples);
    if (pick.devices != 1)
      r.roi += ", " + device_word(hw, pick.devices) + fmt(" %.3f", pick.cost_per_million_samples) +
               fmt(" (%+.0f%% cost", (pick.cost_per_million_samples / one.cost_per_million_samples - 1) * 100) +
               fmt(" for %.2fx the speed)", pick.speedup);
  }
  return r;
}

Recommendation recommend(const Workload& w, const HardwareProfile& hw, const Options& options) {
  return word_decision(decide_strategy(w, hw, options), w, hw);
}

BucketChoice choose_bucket(const Workload& workload, const HardwareProfile& hw, int devices, const Options& o,
                           double max_bucket_bytes) {
  MGPU_CHECK(max_bucket_bytes >= 0, ConfigError, "the bucket cap must be >= 0 bytes");
  Workload w = workload;
  BucketChoice best;
  if (devices <= 1) {
    best.bucket_elems = w.bucket_elems;
    best.reason = "one device: no allreduce, the bucket size does not matter";
    return best;
  }
  // Powers of two from 256 KiB of fp32 up to the first that puts the whole gradient in
  // one bucket. That can take up to twice the gradient: a bucket closes at a layer
  // boundary once half full (plan_buckets), so a size just above the gradient still
  // splits it in two; larger sizes plan the same single bucket. 2^62 elements at
  // most: a workload's parameter count is capped there (validate), and int64 overflows.
  std::vector<int64_t> sizes;
  const std::vector<int> layers = w.resolved_layers();
  for (int64_t e = int64_t{1} << 16;; e *= 2) {
    sizes.push_back(e);
    const std::vector<BucketRun> runs = plan_bucket_runs(layers, MLP::kGradExtraSlots, static_cast<size_t>(e));
    if ((runs.size() == 1 && runs[0].repeat == 1) || e >= int64_t{1} << 62) break;
  }
  bool capped = false;
  for (int64_t e : sizes) {
    if (max_bucket_bytes > 0 && 4.0 * e > max_bucket_bytes && !best.tried.empty()) {
      capped = true;
      break;
    }
    w.bucket_elems = e;
    const Prediction p = predict(w, hw, devices, o);
    best.tried.push_back({e, p.exposed_comm_s});
    // Larger buckets come later: take one only if it exposes clearly less (1 %) or the same at a faster step.
    if (best.bucket_elems == 0 || p.exposed_comm_s < best.exposed_comm_s * 0.99 - 1e-9 ||
        (p.exposed_comm_s <= best.exposed_comm_s * 1.01 + 1e-9 && p.step_s < best.step_s * 0.999)) {
      best.bucket_elems = e;
      best.exposed_comm_s = p.exposed_comm_s;
      best.comm_s = p.comm_s;
      best.step_s = p.step_s;
    }
  }
  // Calibrated CPU steps add the measured wait after backward (the ranks' skew, the
  // health check) to the exposed time, which can then exceed the allreduce itself.
  const bool wait_beyond = best.exposed_comm_s > best.comm_s * 1.001;
  // sharded: the buckets' reduce-scatters, and the all-gathers that follow them
  const std::string what = w.shard_optimizer ? " reduce-scatter and all-gathers" : " allreduce";
  best.reason = "bucket of " + bytes_text(4.0 * best.bucket_elems) + " exposes " + ms(best.exposed_comm_s) +
                (wait_beyond ? " after backward: the " + ms(best.comm_s) + what +
                                   " plus the ranks' skew and "
                                   "the health check;"
                             : " of a " + ms(best.comm_s) + what) +
                " on " + device_word(hw, devices) + " (step " + ms(best.step_s) + "; tried " +
                std::to_string(best.tried.size()) + " sizes from " + bytes_text(4.0 * best.tried.front().first) + ")" +
                (capped ? "; capped at " + bytes_text(max_bucket_bytes) : "");
  return best;
}

Recommendation recommend_by_thresholds(const Workload& w, const Options& o) {
  MGPU_CHECK(w.global_batch >= 1, ConfigError, "global batch must be >= 1, got ", w.global_batch);
  const std::vector<int> sizes = w.resolved_layers();
  Recommendation r;
  r.fallback = true;
  r.profile = "seed 001 thresholds";
  r.profile_source = "fallback";
  r.params = parameter_count(sizes);
  const double P = r.params;
  const int64_t B = w.global_batch;
  int most = 2;
  for (int n : o.candidates) most = std::max(most, n);
  const std::string size = count_text(P) + " parameters";
  if (P < 1e6) {
    r.strategy = "single_gpu";
    r.reasons.push_back(size + " (< 1M): multi-GPU is never beneficial; communication outweighs computation");
  } else if (P < 5e6) {
    r.strategy = B >= 256 ? "benchmark_required" : "single_gpu";
    r.break_even_batch = 256;
    r.reasons.push_back(size +
                        " (1M-5M): single GPU preferred (15-25% loss typical); may break even above a "
                        "batch of 256");
  } else if (P < 10e6) {
    r.strategy = "benchmark_required";
    r.break_even_batch = 128;
    r.reasons.push_back(size + " (5M-10M): evaluate case by case; break-even above a batch of ~128");
  } else if (P < 50e6) {
    r.strategy = B >= 64 ? "multi_gpu" : "single_gpu";
    r.break_even_batch = 64;
    r.reasons.push_back(size + " (10M-50M): consider multi-GPU at a batch of 64 or more");
  } else {
    r.strategy = "multi_gpu";
    r.break_even_batch = 32;
    r.reasons.push_back(size + " (> 50M): multi-GPU gains expected");
  }
  r.devices = r.strategy == "multi_gpu" ? most : 1;
  r.reasons.push_back(
      "no calibration profile and no GPU visible: fell back to seed 001's threshold table "
      "(measured on 2 PCIe GPUs through a host bridge); run `python -m mgpu topo` to calibrate");
  r.confidence = 0.3;
  return r;
}

}  // namespace perf
}  // namespace mgpu
