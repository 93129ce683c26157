// StepTrace: where a traced training step's time went, span by span (train
// --trace), on the backend's own clock: consecutive trace marks (Backend::
// trace_mark) bound each span, so nothing is synchronised to time it. On a
// device the spans end after the step returns (the optimizer runs on), and are
// handed over once their marks have happened: in a later step's result, or by
// drain after a synchronisation.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backend.h"

namespace mgpu {

// One span of a traced step, in seconds on the host's steady clock (the one
// mgpu._core.steady_seconds() reads); a GPU's events are placed there by the
// host clock read as each mark was asked for (see StepTrace::place).
struct TraceSpan {
  std::string name;      // "forward", "forward layer 2", "allreduce wait", ...
  std::string category;  // "phase", or "layer" for the layers inside forward and backward
  uint64_t step = 0;
  int micro = -1;  // micro-batch (gradient accumulation); -1: the step as a whole, or its only one
  double begin = 0.0, end = 0.0;
};

class StepTrace {
 public:
  explicit StepTrace(Backend& backend) : be_(backend) {}

  // Opens a step's timeline: a clock mark, then the mark the first span starts from.
  void begin_step(uint64_t step) {
    steps_.push_back({step, 0, {}, false, 0.0});
    steps_.back().anchor = take_mark(/*clock=*/true);
    last_ = take_mark(false);
  }
  // The mark the next span will start from (for a parent span: see close).
  uint64_t here() const { return last_; }
  // Ends the span that started at the previous mark.
  void end(std::string name, const char* category, int micro) {
    const uint64_t to = take_mark(false);
    pending_.push_back({std::move(name), category, steps_.back().step, micro, last_, to});
    last_ = to;
  }
  // A span enclosing the ones ended since `from` (forward around its layers).
  void close(std::string name, const char* category, int micro, uint64_t from) {
    pending_.push_back({std::move(name), category, steps_.back().step, micro, from, last_});
  }
  // Adds to the name of the span ended last, once the host learned more about
  // it (a step's update that its verdict skipped).
  void annotate_last(const std::string& suffix) {
    if (!pending_.empty() && !steps_.empty() && pending_.back().step == steps_.back().step)
      pending_.back().name += suffix;
  }
  bool pending() const { return !pending_.empty(); }

  // The spans whose marks have happened, in the order they were opened; the
  // rest stay for a later call (all_or_drop: none stay; a span whose marks
  // read NaN is dropped and the later ones are still handed over).
  std::vector<TraceSpan> take_ready(bool all_or_drop = false) {
    std::vector<TraceSpan> out;
    if (pending_.size() > kMaxPending)  // marks that never happen: keep the newest only
      pending_.erase(pending_.begin(), pending_.end() - static_cast<std::ptrdiff_t>(kMaxPending));
    size_t done = 0;
    for (; done < pending_.size(); ++done) {
      const Span& p = pending_[done];
      StepMarks* sm = marks_of(p.from);
      if (!sm) continue;  // its step's marks are gone (dropped above): the span is lost
      const double b = be_.trace_elapsed(sm->anchor, p.from), e = be_.trace_elapsed(sm->anchor, p.to);
      if (std::isnan(b) || std::isnan(e)) {
        if (all_or_drop) continue;
        break;  // marks happen in order: so have none after it
      }
      if (!sm->placed) place(*sm);
      out.push_back({p.name, p.category, p.step, p.micro, sm->offset + b, sm->offset + e});
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
    // Steps with no pending span left, and their marks, are of no more use.
    steps_.erase(std::remove_if(steps_.begin(), steps_.end(),
                                [&](const StepMarks& sm) {
                                  return std::none_of(pending_.begin(), pending_.end(),
                                                      [&](const Span& p) { return holds(sm, p.from); });
                                }),
                 steps_.end());
    be_.trace_forget(steps_.empty() ? last_ + 1 : steps_.front().anchor);
    return out;
  }
  // Every span, after waiting for the backend's queued work. A span whose
  // marks still read NaN then never will (another trace on the same backend
  // let them go: one backend serves one trace): it is dropped, so nothing piles up.
  std::vector<TraceSpan> drain() {
    if (pending_.empty()) return {};
    be_.synchronize();
    std::vector<TraceSpan> out = take_ready(/*all_or_drop=*/true);
    pending_.clear();
    steps_.clear();
    be_.trace_forget(last_ + 1);
    return out;
  }

 private:
  static constexpr size_t kMaxPending = 1 << 16;
  struct Span {
    std::string name;
    const char* category;
    uint64_t step;
    int micro;
    uint64_t from, to;
  };
  // A step's marks: their numbers and the host clock read just before each was
  // taken, which it cannot have happened before; and once placed, the offset
  // from the backend's clock (seconds since the anchor) to the host's.
  struct StepMarks {
    uint64_t step;
    uint64_t anchor;
    std::vector<std::pair<uint64_t, double>> taken;
    bool placed;
    double offset;
  };

  uint64_t take_mark(bool clock) {
    const double host = now();
    const uint64_t id = clock ? be_.trace_clock_mark() : be_.trace_mark();
    steps_.back().taken.emplace_back(id, host);
    return id;
  }
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static bool holds(const StepMarks& sm, uint64_t mark) {
    return !sm.taken.empty() && sm.taken.front().first <= mark && mark <= sm.taken.back().first;
  }
  StepMarks* marks_of(uint64_t mark) {
    for (StepMarks& sm : steps_)
      if (holds(sm, mark)) return &sm;
    return nullptr;
  }
  // The host time of the anchor: no mark happened before the host asked for it,
  // so the offset is at least (asked - elapsed) for each mark that has happened;
  // the largest such bound is taken (the mark that waited least, exact when one
  // ran at once: the clock mark on its idle stream, a mark on an idle queue).
  void place(StepMarks& sm) {
    double offset = -std::numeric_limits<double>::infinity();
    for (const auto& [id, asked] : sm.taken) {
      const double since_anchor = be_.trace_elapsed(sm.anchor, id);
      if (!std::isnan(since_anchor)) offset = std::max(offset, asked - since_anchor);
    }
    sm.offset = offset;
    sm.placed = true;
  }

  Backend& be_;
  std::vector<Span> pending_;
  std::vector<StepMarks> steps_;  // the traced steps whose spans are not all handed over, oldest first
  uint64_t last_ = 0;
};

}  // namespace mgpu
