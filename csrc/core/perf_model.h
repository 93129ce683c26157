// PerfModel: predicts the time and memory of one data-parallel training step
// on 1..N devices from a hardware profile, and the strategy selector built on
// it: single device or several, how many, why, and how sure. Pure functions of
// their inputs (no device, no MPI): the profile carries every measured number.
//
// Step time on n devices with local batch b_i:
//   overhead + forward(b) + loss + backward(b) + exposed allreduce + optimizer
// A sharded optimizer (Workload::shard_optimizer, ZeRO stage 1) on n > 1 devices
// reduce-scatters each bucket where the allreduce would run, updates 1/n of the
// parameters, and all-gathers them after the update (exposed): see predict.
// GEMMs: work / rate(work), with rate(w) = peak * w / (w + half_work) (small
// GEMMs reach a fraction of the peak); elementwise kernels: bytes / bandwidth;
// plus a launch overhead per kernel. Allreduce of each gradient bucket (the
// plan of train_step.h): NCCL-shaped (CollectiveModel: the fastest algorithm x
// protocol, hierarchical over nodes) where the profile has it, else ring
// alpha-beta, 2(n-1) alpha + 2(n-1)/n bytes / busbw; overlapped with backward
// where the transport runs beside compute. CPU calibrations measure instead of
// model where microbenchmarks mislead: layer times (LayerTimes), pass bandwidth
// by size, and the update and wait of real steps (StepPhases).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mgpu {
namespace perf {

// Achieved GEMM rate of one device at one precision, by the work of one GEMM.
// Measured points (work, rate), when present, are interpolated in log(work)
// (clamped at the ends); otherwise rate(w) = peak * w / (w + half_work).
struct GemmRate {
  double peak_flops = 0.0;                          // FLOP/s that large GEMMs approach (0: precision unsupported)
  double half_work_flops = 0.0;                     // work (FLOP) at which a GEMM reaches half of the peak
  std::vector<std::pair<double, double>> measured;  // (work FLOP, FLOP/s), ascending work
  double at(double work_flops) const;
};

// Measured seconds of one fp32 Linear layer as training calls it, on a grid of
// rows (the local batch) x in x out features: forward (GEMM and bias), backward
// (input and weight gradients, bias sums) and backward_weights (no input
// gradient: the first layer). A GEMM's time is close to multilinear in its
// three sizes (work r i o, weights i o, activations r i and r o), so a lookup
// interpolates trilinearly inside the grid; beyond the largest size the edge's
// rate holds (time in proportion), below the smallest the edge's time holds.
// Unlike a rate by work, it tells a skinny GEMM from a square one of equal work.
struct LayerTimes {
  std::vector<double> rows, widths;                         // ascending, >= 2 each; in and out share the widths
  std::vector<double> forward, backward, backward_weights;  // [(r * W + i) * W + o] seconds
  // The same grid timed with the last-level cache emptied before each call: a layer as a
  // step meets it whose arrays outgrow that cache (every layer's weights, gradients and
  // optimizer state in turn). Empty: not measured (the warm tables serve).
  std::vector<double> forward_cold, backward_cold, backward_weights_cold;
  bool enabled() const { return !rows.empty(); }
  bool has_cold() const { return !forward_cold.empty(); }
  void check(const std::string& what) const;  // throws ConfigError on a malformed grid
  double at(const std::vector<double>& table, double rows, double in, double out) const;
};

// CPU: what a real training step spends beyond its layers, measured by topo
// training small MLPs of several parameter counts (8 rows per rank, SGD with
// momentum, fp32, 4 MiB buckets): the update, and the wait after backward (the
// gradient allreduce as training meets it, with the ranks' skew, and the
// health check). In a step these run on caches the layers just used and, with
// several ranks, on a shared memory bus, which no isolated pass shows. The
// wait's spread (90th percentile less the median over the steps) widens the
// selector's error band where profiles.py passes it on: a step's jitter where the
// bands are not of timed steps, the whole wait where the cores moved. Looked up as
// seconds per parameter, linear between the measured counts in log(params),
// clamped at the ends.
struct StepPhases {
  static constexpr double kBucketElems = double(1 << 20);       // the bucket size they were measured with
  static constexpr double kUpdateBytesPerParam = 20.0;          // SGD with momentum: read w, g, m; write w, m
  std::vector<double> params, update_s, wait_s, wait_spread_s;  // ascending params
  int ranks = 0;                                                // the world they were measured in (1: alone)
  bool enabled() const { return !params.empty(); }
  void check(const std::string& what) const;  // throws ConfigError on a malformed table
  double update_at(double params) const { return per_param(update_s, params) * params; }
  double wait_at(double params) const { return per_param(wait_s, params) * params; }
  double wait_spread_at(double params) const { return per_param(wait_spread_s, params) * params; }

 private:
  double per_param(const std::vector<double>& seconds, double params) const;
};

struct DeviceProfile {
  std::string name;
  std::string kind = "cuda";  // "cuda" | "cpu"
  GemmRate fp32, tf32, bf16, fp16;
  double memory_bytes = 0.0;              // capacity
  double memory_bandwidth = 0.0;          // bytes/s reached by elementwise kernels
  double host_to_device_bandwidth = 0.0;  // bytes/s for staging batches (0: host memory)
  // A short kernel's cost in a stream of them (topo: one-element kernels back to back);
  // a GPU kernel whose work is longer hides it, a CPU call adds it.
  double launch_overhead_s = 0.0;
  // Per node of a replayed graph (a captured step): what a kernel costs beyond its
  // work when it runs inside a graph. 0: unknown, priced as a launch.
  double graph_node_s = 0.0;
  bool captures = true;        // false: capturing failed on it (topo), so steps run uncaptured
  double context_bytes = 0.0;  // fixed per-process memory (CUDA context, libraries)
  double dropout_s_per_unit =
      0.0;  // what dropout adds per hidden unit and sample: the forward's mask (the backward's ReLU costs the same)
  // fp32 layer times measured by `mgpu topo` on CPU ranks, which share caches and
  // memory: `layers` with every rank of the node computing at once (a rank of a
  // multi-rank step), `layers_alone` with one rank computing (a 1-rank step).
  // When present they replace the GEMM rate for fp32 layers.
  LayerTimes layers, layers_alone;
  // The last-level cache the ranks of a node share (topo: sysfs), bytes; 0: unknown.
  // A step whose ranks' arrays exceed it takes its layers between the warm and the cold
  // tables, by the share of those arrays the cache cannot hold.
  double cache_bytes = 0.0;
  // CPU: bytes/s of elementwise passes (y += a x) by the bytes a pass moves, as
  // topo measured them; caches make small passes faster. With every rank of the
  // node at once / one rank alone, as above; ascending bytes, interpolated in
  // log(bytes), clamped at the ends. Empty: memory_bandwidth for every pass.
  std::vector<std::pair<double, double>> pass_bandwidth, pass_bandwidth_alone;
  double bandwidth_at(double bytes, bool alone) const;
  // In-step update and wait: with every rank of the node training / one rank alone.
  StepPhases step_phases, step_phases_alone;
  const GemmRate& gemm(const std::string& precision) const;  // falls back to fp32
};

// The allreduce as NCCL's tuner sees it (src/graph/tuning.cc): for every
// algorithm (ring, tree, NVLS) and protocol (LL, LL128, Simple) a latency
// plus bytes over a bandwidth, and the fastest pair wins for each size.
//   ring:  lat[p] + 2(n-1) hop[p]         + bytes 2(n-1)/n / (ring_busbw frac[p])
//   tree:  lat[p] + 2 (ceil(log2 n) - 1) hop[p] + bytes min(2(n-1)/n, 1.5) / (tree_busbw frac[p])
//          (lat: a 2-rank tree's, one edge; each doubling of n adds a level; the
//          busiest link's load stops growing at 4 ranks)
//   nvls:  lat[Simple] + 2 hop[Simple]    + bytes 2(n-1)/n / nvls_busbw   (Simple only)
// Bandwidths are nccl-tests' busbw; a zero bandwidth leaves the algorithm out.
// From 3 ranks on, protocol p's bandwidth is scaled by bw_scale_beyond_two[p]:
// the inter-node level sets it where NCCL's tuner caps a protocol lower from 3
// nodes on than at 2 (its "4 nodes" tuning column), 1 everywhere else.
// The parameters are fitted to published nccl-tests tables (mgpu.allreduce_fit).
struct CollectiveModel {
  static constexpr int kLL = 0, kLL128 = 1, kSimple = 2;
  std::array<double, 3> latency_s{{0, 0, 0}};             // per protocol
  std::array<double, 3> hop_s{{0, 0, 0}};                 // per protocol, per step
  std::array<double, 3> bw_fraction{{0, 0, 1}};           // of the algorithm's busbw (0: protocol unused)
  std::array<double, 3> bw_scale_beyond_two{{1, 1, 1}};   // per protocol, on its bandwidth at > 2 ranks
  double ring_busbw = 0, tree_busbw = 0, nvls_busbw = 0;  // bytes/s
  bool enabled() const { return ring_busbw > 0 || tree_busbw > 0 || nvls_busbw > 0; }
  double seconds(int ranks, double bytes) const;
  // "ring/LL128" etc.: the pair NCCL would pick for this size (by the model).
  std::string choice(int ranks, double bytes) const;
};

// The interconnect between the devices, as the allreduce sees it.
struct LinkProfile {
  std::string name;
  double alpha_s = 0.0;          // latency per ring step
  double bus_bandwidth = 0.0;    // bytes/s (nccl-tests' busbw)
  bool overlaps_compute = true;  // allreduce progresses while backward computes (NCCL; not MPI+CPU)
  double buffer_bytes = 0.0;     // communication buffers per device
  double step_sync_s = 0.0;      // per step with several ranks: skew and control messages
  // Measured allreduce times (bytes, seconds) at measured_devices ranks, when
  // present, are interpolated in log-log and scaled to other device counts by
  // the ring's factor; alpha and bus_bandwidth extrapolate beyond them.
  std::vector<std::pair<double, double>> measured;
  int measured_devices = 0;
  // NCCL-shaped model: within a node (intra), and between nodes (inter) for
  // gpus_per_node > 0 and more devices than that: hierarchical, each node
  // reduces inside (the bytes of one intra-node allreduce) and each GPU
  // allreduces its 1/gpus_per_node shard across the nodes over its own NIC:
  // the two latencies add, the two transfers pipeline (the slower one counts).
  // The named multi-node links price the inter level as a tree (NCCL's
  // multi-node latency grows with 2 log2(nodes) network hops, not 2(nodes-1)).
  // When intra is set it replaces alpha/bus_bandwidth.
  CollectiveModel intra, inter;
  int gpus_per_node = 0;  // 0: one node holds every device
  double allreduce_seconds(int devices, double bytes) const;
  std::string allreduce_choice(int devices, double bytes) const;  // "" without the NCCL-shaped model
  // A reduce-scatter of a `bytes` buffer (each device ends with its part of the sum)
  // or an all-gather of one (each device starts with its part): the allreduce's
  // latency and half its bandwidth term, on the pair (or level) the allreduce's
  // machinery finds fastest for that cost (see collective_seconds in perf_model.cpp).
  double reduce_scatter_seconds(int devices, double bytes) const;
  double all_gather_seconds(int devices, double bytes) const { return reduce_scatter_seconds(devices, bytes); }
  std::string reduce_scatter_choice(int devices, double bytes) const;  // "" without the NCCL-shaped model
};

// How far measured times fall from the model's: the 10th and 90th percentiles of
// log(measured / predicted) over validated residuals, so a time T predicted lies in
// [T exp(low), T exp(high)] four times in five. Uncentred bands (a biased model) shift the interval.
struct ErrorBand {
  double low = -0.25, high = 0.25;
  double center() const;      // relative shift of the interval's middle: (exp(low) + exp(high)) / 2 - 1
  double half_width() const;  // relative half width: (exp(high) - exp(low)) / 2
};

// The model's error by what prices a phase: compute (layers, passes, the update, the host's
// overhead) and communication (collectives, the wait after backward). Where one device's
// compute error holds for every device count (the same GEMM rates price them) it cancels in
// a speedup; where the counts' times were measured apart (a CPU rank alone or beside
// others) the two errors are independent and compute_together is a device's among several.
// A calibration that ran held-out steps on one device and on several measured the speedup's
// error itself (speedup_measured): its band replaces the one the phases' bands would give.
// A calibration's bands are of whole steps (step_bands): a step's compute and communication
// errors are one, and its band applies to the step as a whole.
struct ErrorModel {
  ErrorBand compute, compute_together, comm, speedup;
  bool compute_shared = true;
  bool speedup_measured = false;
  bool step_bands = false;
  std::string source = "default";  // where the bands come from, said with every interval
};

struct HardwareProfile {
  std::string name;
  std::string source = "named";        // "calibrated" | "detected" | "named"
  std::vector<DeviceProfile> devices;  // candidates with n devices use the first n
  LinkProfile link;
  double step_overhead_s = 0.0;  // host time per step outside kernels (Python, bookkeeping)
  ErrorModel error;
};

struct Workload {
  std::vector<int> layers;  // [in, hidden..., out]; empty: derived from params
  int64_t params = 0;       // used when layers is empty
  int64_t global_batch = 0;
  std::string precision = "fp32";   // fp32 | tf32 | bf16 | fp16
  std::string optimizer = "adamw";  // sgd (momentum) | adamw
  double dropout = 0.0;             // after every hidden layer
  int64_t bucket_elems = 1 << 20;
  std::string grad_dtype = "fp32";  // fp32 | bf16 | fp16: the type gradients travel in (2 bytes halve the allreduce)
  // auto | on | off: whether training replays its steps as graphs, as `train
  // --cuda-graph` decides it (StepOptions::graph): auto captures on GPUs for models
  // of at most StepOptions::kGraphAutoMaxParams parameters, never on CPUs.
  std::string cuda_graph = "auto";
  // Micro-batches per step (train --accumulate): each runs forward and backward on its
  // share of the rows; only the last one's backward overlaps the allreduce.
  int64_t accumulate = 1;
  // A sharded optimizer (train --shard-optimizer, StepOptions::shard_optimizer): on
  // more than one device each keeps optimizer state for 1/n of the parameters and
  // updates them; buckets are reduce-scattered and the parameters all-gathered after
  // the update. No effect on one device.
  bool shard_optimizer = false;
  // A device's inputs: gathered each step from a training set held in its memory (train
  // --data-on-device, on GPUs by default where it fits), or copied from the host while the
  // step before computes (a copy stream), then within the device.
  bool data_on_device = true;
  // The layers that stand in for a bare parameter count: four square hidden
  // layers holding the same number of parameters.
  std::vector<int> resolved_layers() const;
};

struct Options {
  std::vector<int> candidates;         // device counts; empty: 1..number of devices in the profile
  double memory_margin = 0.8;          // usable fraction of device memory (seed 001's safety margin)
  double price_per_device_hour = 0.0;  // > 0: cost per million samples and an ROI line
  bool equal_shares = false;           // split the batch evenly even over unequal devices (as `bench` does)
  // The batch split in proportion to these, one per device (train --batch-shares); empty:
  // equal_shares, else by each device's speed.
  std::vector<double> share_weights;
  // false: the buckets reduced after backward, not during it (train --no-overlap).
  bool overlap = true;
  // Predict each multi-device candidate at the bucket choose_bucket prefers for it
  // (`--bucket-mb auto`), capped at max_bucket_bytes (0: no cap), instead of Workload's.
  bool choose_buckets = false;
  double max_bucket_bytes = 0.0;
};

struct Prediction {
  int devices = 1;
  std::vector<int64_t> batch_shares;  // samples per device (unequal devices get unequal shares)
  double forward_s = 0, backward_s = 0, optimizer_s = 0, overhead_s = 0;
  int64_t bucket_elems = 0;          // the gradient bucket the prediction assumes
  bool graphs = false;               // steps replay as graphs: kernels at graph-node cost, the allreduce after backward
  bool sharded = false;              // the optimizer is sharded (shard_optimizer on several devices)
  double comm_s = 0;                 // total communication of one step (sharded: reduce-scatters and all-gathers)
  double exposed_comm_s = 0;         // the part not hidden behind backward (or the next forward)
  double gather_s = 0;               // sharded: the all-gathers after backward (health check, parameters)
  double gather_exposed_s = 0;       // the part of gather_s not hidden behind the next forward
  double optimizer_state_bytes = 0;  // optimizer state one device holds (sharded: its shard's)
  double step_s = 0;
  double samples_per_s = 0, speedup = 1, efficiency = 1;
  double timing_spread_s = 0;  // how far a measured step may wander beyond the bands (calibrated CPUs: profiles.py)
  // Central 80 % intervals (the profile's ErrorModel with the timing spread): the step's
  // seconds, and the speedup over one device (1 to 1 on one device).
  double step_low_s = 0, step_high_s = 0, speedup_low = 1, speedup_high = 1;
  double memory_bytes = 0;         // the device closest to its capacity: its need
  double memory_usable_bytes = 0;  // and its capacity x margin (0: unknown)
  bool memory_fits = true;
  double cost_per_million_samples = 0;  // when priced
};

struct Recommendation {
  std::string strategy;  // single_gpu | multi_gpu | benchmark_required | does_not_fit
  int devices = 1;       // the recommended device count
  std::vector<Prediction> candidates;
  int64_t break_even_batch = -1;  // smallest global batch where several devices beat one; -1: none
  std::vector<std::string> reasons;
  double confidence = 0.0;  // 0..1
  std::string roi;          // when priced
  bool fallback = false;    // seed 001's threshold table was used (no profile)
  std::string profile, profile_source;
  double params = 0;
};

// The bucket size that minimises the exposed allreduce of one step on
// `devices` (ties within 1 %: the fewer buckets, which cost fewer launches),
// capped at max_bucket_bytes (0: no cap).
struct BucketChoice {
  int64_t bucket_elems = 0;
  double exposed_comm_s = 0, comm_s = 0, step_s = 0;
  std::vector<std::pair<int64_t, double>> tried;  // (bucket elements, exposed seconds)
  std::string reason;
};
BucketChoice choose_bucket(const Workload& workload, const HardwareProfile& hw, int devices, const Options& options,
                           double max_bucket_bytes = 0.0);

// Bytes one device holds to train the workload on `rows` samples a step: weights,
// gradients, optimizer state and activations, as predict prices them (without a
// device's context or communication buffers), on one of `devices` (the optimizer
// state's shard where the workload shards it). train checks host memory with it.
double training_memory_bytes(const Workload& workload, int64_t rows, int devices = 1);
// Optimizer state one of `devices` holds: SGD's momentum 4 B a parameter, AdamW's two
// moments 8 B; 1/devices of it where the workload shards the optimizer.
double optimizer_state_bytes(const Workload& workload, int devices = 1);
// Step time and memory of one candidate device count.
Prediction predict(const Workload& workload, const HardwareProfile& hw, int devices, const Options& options);
// One reason behind a Decision, as data: what it is about and its numbers
// (word_decision says it in a sentence). Fields a kind does not name stay unset.
struct Reason {
  enum class Kind {
    // Why this strategy.
    kNoCandidateFits,   // candidate: the one needing the least memory; value: the usable fraction of memory
    kOneCannotHold,     // candidate: the one-device candidate; other: the pick
    kNoMultiToCompare,  // flag: some multi-device candidate exists (none fits)
    kOneIsFaster,       // candidate: the fastest multi-device one (its speedup interval lies below 1.0x)
    kGainWithinError,   // candidate: the fastest multi-device one (its speedup interval spans 1.0x)
    // Why, in numbers.
    kOneDeviceStep,       // candidate: the one-device candidate
    kMultiDeviceStep,     // candidate: a multi-device candidate; value: bytes of the gradient allreduce
    kGraphReplay,         // candidate: the one shown; flag: several devices (the allreduce follows backward)
    kUncapturedFaster,    // alternative: the faster uncaptured step; other: the pick (captured)
    kUnequalDevices,      // candidate: a candidate on unequal devices
    kAllreduceAlgorithm,  // candidate: the fastest multi-device one; value: one bucket's bytes; text: the algorithm
    kBreakEven,           // count: the smallest global batch where several devices win; flag: this one is at or above
    kNeverBreaksEven,     // (up to a global batch of 2^24)
    kDevicesLeftOut,      // count: a device count that would leave some device without a sample
    kMemory,              // candidate: the pick (or the first candidate when nothing fits)
    kProfile,             // the profile's name and source
    // Said after why this strategy, where the workload does not shard the optimizer and
    // sharding it would change the answer. candidate: the unsharded candidate of that
    // device count; other: the pick (-1: none fits); alternative: the sharded step;
    // flag: it fits only sharded (else it is faster by more than value2, the relative half
    // width of the pick's interval); value: the optimizer state of one device unsharded.
    kShardingWouldHelp,
  };
  Kind kind = Kind::kProfile;
  int candidate = -1;  // an index into Decision::candidates (-1: none)
  int other = -1;      // a second one
  double value = 0.0;
  double value2 = 0.0;
  int64_t count = 0;
  bool flag = false;
  std::string text;
  std::optional<Prediction> alternative;
};

// The selector's decision over options.candidates before any wording: the
// strategy, the device count, the candidates compared and the reasons in the
// order a Recommendation lists them.
struct Decision {
  enum class Strategy { kSingleGpu, kMultiGpu, kBenchmarkRequired, kDoesNotFit };
  Strategy strategy = Strategy::kSingleGpu;
  int devices = 1;
  std::vector<Prediction> candidates;  // the device counts that give every device a sample, ascending
  int one = -1;                        // the one-device candidate (-1: not among them)
  int pick = -1;                       // the fastest candidate that fits (-1: none fits)
  int64_t break_even_batch = -1;
  double confidence = 0.0;
  double params = 0;
  double price_per_device_hour = 0.0;  // > 0: the ROI is worded
  std::vector<Reason> reasons;
};
Decision decide_strategy(const Workload& workload, const HardwareProfile& hw, const Options& options);
// The decision in words: strategy names, one sentence per reason, the ROI line.
Recommendation word_decision(const Decision& decision, const Workload& workload, const HardwareProfile& hw);
// The decision over options.candidates, with reasons: word_decision(decide_strategy(...)).
Recommendation recommend(const Workload& workload, const HardwareProfile& hw, const Options& options);
// Without any profile: seed 001's parameter-count/batch thresholds, said so.
Recommendation recommend_by_thresholds(const Workload& workload, const Options& options);

}  // namespace perf
}  // namespace mgpu
