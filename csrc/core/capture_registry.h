// The bookkeeping every backend that captures steps shares (see Backend's
// step capture): whether a capture is open, the captured graphs by id, and the
// generation that changes each time they are released. Graph is the backend's
// own kind of graph (a cudaGraphExec_t, a list of recorded calls).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "errors.h"

namespace mgpu {

template <typename Graph>
class CaptureRegistry {
 public:
  bool capturing() const { return capturing_; }
  bool empty() const { return graphs_.empty(); }
  uint64_t generation() const { return generation_; }

  void begin() {
    MGPU_CHECK(!capturing_, ConfigError, "a capture is already in progress");
    capturing_ = true;
  }
  // Closes the open capture; the backend then files its graph with store().
  void end() {
    MGPU_CHECK(capturing_, ConfigError, "end_capture() without begin_capture()");
    capturing_ = false;
  }
  void abort() noexcept { capturing_ = false; }
  int store(Graph graph) {
    graphs_.push_back(std::move(graph));
    return static_cast<int>(graphs_.size()) - 1;
  }
  // The graph to replay (not during a capture; ids die with their generation).
  Graph& get(int id) {
    MGPU_CHECK(!capturing_, ConfigError, "replay() during a capture");
    MGPU_CHECK(id >= 0 && id < static_cast<int>(graphs_.size()), ConfigError, "no captured graph ", id,
               " (released after generation ", generation_, ")");
    return graphs_[id];
  }
  // A new generation without graphs to release: what was seen before (uncaptured
  // first appearances of shapes) no longer describes the backend's buffers.
  void invalidate() { ++generation_; }
  // destroy(graph) for each graph, then a new generation.
  template <typename Destroy>
  void release(Destroy destroy) {
    if (graphs_.empty()) return;
    for (Graph& g : graphs_) destroy(g);
    graphs_.clear();
    ++generation_;
  }

 private:
  bool capturing_ = false;
  std::vector<Graph> graphs_;
  uint64_t generation_ = 0;
};

}  // namespace mgpu
