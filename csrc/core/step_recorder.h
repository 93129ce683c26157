// StepRecorder: where one training step's time goes, fed by DataParallelStep::step
// at named points (StepEvent), as PyTorch DDP's reducer feeds its Timer. Every
// step reads the host clock at its phase boundaries (StepTimings); a timed step
// on a device backend also synchronises there, so the phases separate; a traced
// step also ends a span at each point (StepTrace); a timed or traced step also
// stamps each gradient bucket's allreduce. An untimed, untraced step pays a clock
// read at each phase boundary and nothing else.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend.h"
#include "communicator.h"
#include "errors.h"
#include "step_trace.h"
#include "train_step.h"

namespace mgpu {

// The named points of a step, in the order they happen (spans a traced step ends there in quotes).
enum class StepEvent {
  kBegin,               // the step starts: its clock, its trace, the collective stamps
  kStaged,              // a micro-batch's shard is on the backend ("stage")
  kForwardBegin,        // its forward starts (where the enclosing "forward" span opens)
  kForwardLayer,        // forward wrote layer `layer`'s output ("forward layer l")
  kForwardEnd,          // forward done ("forward", around its layers)
  kLoss,                // loss and its gradient done; the forward phase ends ("loss")
  kBackwardBegin,       // backward starts (where "backward" opens)
  kBackwardLayer,       // backward wrote layer `layer`'s gradients ("backward layer l")
  kBackwardEnd,         // backward done; the backward phase ends ("backward")
  kReplayBegin,         // a captured micro-batch: staged, the forward phase ends
  kReplayEnd,           // its forward, loss and backward queued; the backward phase ends ("... (how)")
  kReplayWithTailEnd,   // the same with the step's tail in the graph too
  kAllreduceDone,       // wait_all returned: when the unstamped queued buckets completed
  kGradientsReduced,    // every rank holds the summed gradients ("allreduce wait"; sharded: "reduce-scatter wait")
  kTailBegin,           // a captured tail starts: the wait ends
  kTailReplayEnd,       // the captured health check and update queued ("health check + optimizer (how)")
  kHealthChecked,       // the verdict queued; the wait ends ("health check")
  kUpdated,             // the update queued ("optimizer")
  kParametersGathered,  // a sharded step's updated shards gathered on every rank ("all-gather"), waiting included
  kTailQueued,          // a host backend ran the tail, a device one queued it
  kVerdictRead,         // the verdict is on the host: the transport's stamps are final
  kUpdateSkipped,       // the verdict refused the update (the last span says so)
  kEnd,                 // the step returns: timings computed, finished spans handed over
};

class StepRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  // timed: synchronise a device backend at the phase boundaries and stamp buckets;
  // traced: record spans (trace) and stamp buckets. result receives the timings,
  // bucket stamps and spans.
  // sharded: the step reduce-scatters its buckets and all-gathers the parameters (the spans' names).
  StepRecorder(Backend& backend, Communicator& comm, StepTrace& trace, StepResult& result, uint64_t step, bool timed,
               bool traced, size_t buckets, bool sharded = false)
      : be_(backend),
        comm_(comm),
        trace_(trace),
        result_(result),
        step_(step),
        sync_phases_(timed && !backend.host_accessible()),
        traced_(traced),
        stamps_buckets_(timed || traced),
        buckets_(buckets),
        sharded_(sharded) {}

  bool traced() const { return traced_; }
  bool stamps_buckets() const { return stamps_buckets_; }

  // micro: the micro-batch the span belongs to (-1: the step as a whole, or its only one);
  // layer: kForwardLayer and kBackwardLayer's layer.
  void record(StepEvent event, int micro = -1, int layer = -1) { handle(event, micro, layer, ""); }
  // A captured run's end (kReplayEnd, kReplayWithTailEnd, kTailReplayEnd); how: run_captured's answer.
  void record(StepEvent event, int micro, const char* how) { handle(event, micro, -1, how); }

  // One bucket's allreduce (when stamps_buckets()): launching() before the launch,
  // launched() after it; queued: the collectives it left in flight (0: it completed).
  void launching() { launch_ = since_start(); }
  void launched(int index, size_t offset, size_t count, size_t bytes, int queued) {
    // A blocking allreduce completed when it returned; queued ones are stamped once the verdict is read.
    const double done = queued ? -1.0 : since_start();
    result_.buckets.push_back({index, offset, count, bytes, launch_, done});
    queued_.push_back(queued);
  }
  // A queued collective of the step's tail (a sharded step's health-check and
  // parameter all-gathers): the transport stamps it after the buckets' ones.
  void queued_after_buckets() { ++queued_after_buckets_; }

 private:
  void handle(StepEvent event, int micro, int layer, const char* how) {
    switch (event) {
      case StepEvent::kBegin:
        start_ = now();
        result_.started = std::chrono::duration<double>(start_.time_since_epoch()).count();
        phase_ = start_;
        if (traced_) trace_.begin_step(step_);
        if (stamps_buckets_) {
          comm_.start_collective_timing();
          result_.buckets.reserve(buckets_);
          queued_.reserve(buckets_);
        }
        break;
      case StepEvent::kStaged:
        if (traced_) trace_.end("stage", "phase", micro);
        break;
      case StepEvent::kForwardBegin:
      case StepEvent::kBackwardBegin:
        if (traced_) opened_ = trace_.here();
        break;
      case StepEvent::kForwardLayer:
        if (traced_) trace_.end(detail::concat("forward layer ", layer), "layer", micro);
        break;
      case StepEvent::kForwardEnd:
        if (traced_) trace_.close("forward", "phase", micro, opened_);
        break;
      case StepEvent::kLoss:
        if (traced_) trace_.end("loss", "phase", micro);
        result_.timings.forward += phase_ends();
        break;
      case StepEvent::kBackwardLayer:
        if (traced_) trace_.end(detail::concat("backward layer ", layer), "layer", micro);
        break;
      case StepEvent::kBackwardEnd:
        if (traced_) trace_.close("backward", "phase", micro, opened_);
        result_.timings.backward += phase_ends();
        break;
      case StepEvent::kReplayBegin: result_.timings.forward += phase_ends(); break;
      case StepEvent::kAllreduceDone:
        if (stamps_buckets_) waited_ = Clock::now();
        break;
      case StepEvent::kGradientsReduced:
        if (traced_) trace_.end(sharded_ ? "reduce-scatter wait" : "allreduce wait", "phase", -1);
        break;
      case StepEvent::kTailBegin:
        tail_ = now();
        tail_started_ = true;
        break;
      case StepEvent::kHealthChecked:
        if (traced_) trace_.end("health check", "phase", -1);
        tail_ = now();
        tail_started_ = true;
        break;
      case StepEvent::kUpdated:
        if (traced_) trace_.end("optimizer", "phase", -1);
        if (sharded_) updated_ = now();
        break;
      case StepEvent::kParametersGathered:
        if (traced_) trace_.end("all-gather", "phase", -1);
        gathering_ += seconds(updated_, now());
        break;
      case StepEvent::kTailQueued: queued_at_ = now(); break;
      case StepEvent::kVerdictRead:
        if (stamps_buckets_) stamp_queued_buckets();
        break;
      case StepEvent::kUpdateSkipped:
        if (traced_) trace_.annotate_last(" [update skipped]");
        break;
      case StepEvent::kEnd: {
        const Clock::time_point end = now();
        const Clock::time_point tail = tail_started_ ? tail_ : phase_;
        // The read-back waits for whatever the device still runs, the peers' allreduce
        // included: waiting, as the straggler check reads it, not this rank's update.
        // A sharded step's all-gather is communication, though it follows the update.
        result_.timings.comm_wait = seconds(phase_, tail) + seconds(queued_at_, end) + gathering_;
        result_.timings.optimizer = seconds(tail, queued_at_) - gathering_;
        result_.timings.total = seconds(start_, end);
        // This step's spans whose marks have happened, and those an earlier traced step left.
        if (trace_.pending()) result_.spans = trace_.take_ready();
        break;
      }
      case StepEvent::kReplayEnd:
      case StepEvent::kReplayWithTailEnd:
        if (traced_)
          trace_.end(detail::concat("forward + loss + backward",
                                    event == StepEvent::kReplayWithTailEnd ? " + health check + optimizer" : "", " (",
                                    how, ")"),
                     "phase", micro);
        result_.timings.backward += phase_ends();
        break;
      case StepEvent::kTailReplayEnd:
        if (traced_) trace_.end(detail::concat("health check + optimizer (", how, ")"), "phase", -1);
        break;
    }
  }
  Clock::time_point now() {
    if (sync_phases_) be_.synchronize();
    return Clock::now();
  }
  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  double since_start() const { return seconds(start_, Clock::now()); }
  // Seconds since the last phase boundary, which is now.
  double phase_ends() {
    const Clock::time_point t = now();
    const double s = seconds(phase_, t);
    phase_ = t;
    return s;
  }
  // Fills in the completion of the queued buckets (done < 0) from the transport's
  // stamps, or when wait_all returned where it has none.
  void stamp_queued_buckets() {
    std::vector<BucketTiming>& spans = result_.buckets;
    const double waited = seconds(start_, waited_);
    const auto times = comm_.collective_times();  // always called: it also ends the stamping
    size_t expected = queued_after_buckets_;
    for (int q : queued_) expected += static_cast<size_t>(q);
    const bool stamped = times.size() == expected;
    size_t next = 0;
    for (size_t i = 0; i < spans.size(); ++i) {
      if (!queued_[i]) continue;
      // A compressed bucket is two collectives (half gradients, fp32 slots): done when both are.
      double done = -1.0;
      for (int k = 0; k < queued_[i]; ++k, ++next)
        if (stamped) done = std::max(done, times[next].second);
      // Unstamped (the transport cannot tell): completion was observed when wait_all returned.
      if (!stamped) done = waited;
      // A device clock (CUDA events) may read slightly before the host's launch stamp.
      spans[i].done = std::max(done, spans[i].launch);
    }
  }

  Backend& be_;
  Communicator& comm_;
  StepTrace& trace_;
  StepResult& result_;
  const uint64_t step_;
  const bool sync_phases_, traced_, stamps_buckets_;
  const size_t buckets_;
  const bool sharded_;
  Clock::time_point start_, phase_, tail_, queued_at_, updated_, waited_{};
  double gathering_ = 0.0;           // seconds of a sharded step's parameter all-gather
  size_t queued_after_buckets_ = 0;  // queued collectives of the tail, stamped after the buckets'
  bool tail_started_ = false;
  uint64_t opened_ = 0;      // the mark the enclosing span (forward, backward) opened at
  double launch_ = 0.0;      // the bucket being launched: its launch stamp
  std::vector<int> queued_;  // queued collectives of each launched bucket
};

}  // namespace mgpu
