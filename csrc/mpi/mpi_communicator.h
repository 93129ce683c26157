// MPI communicator over a communicator handed over from mpi4py (duplicated, so
// our collectives never match a user's). Host memory only: the CPU backend's
// buffers, or host-staged GPU gradients.
//
// Fault detection: with a timeout set, every collective is non-blocking and
// waited on against a deadline, so a dead or stopped peer ends the wait with a
// CommError instead of a hang. Heartbeats on a second duplicate tell who is
// missing: at each step every rank sends its step sequence number to the ranks
// it watches (everyone in small worlds; rank 0 and back in large ones), and
// repeats it while it waits in a collective. A peer that has not sent this
// step's number has not reached the step; one that sent it but went silent
// while the others wait is frozen or dead inside the collective.
#pragma once
#include <mpi.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/communicator.h"

namespace mgpu {

class MpiCommunicator final : public Communicator {
 public:
  // handle: MPI_Comm as an integer (mpi4py: MPI._handleof(comm)).
  explicit MpiCommunicator(uintptr_t handle);
  ~MpiCommunicator() override;
  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allreduce_sum(float* data, size_t count) override;
  void broadcast(float* data, size_t count, int root) override;
  void barrier() override;
  void allreduce_sum_async(float* data, size_t count) override;
  void progress() override;
  void wait_all() override;
  void begin_step(uint64_t step) override;
  // Each async allreduce is stamped done when a test or wait here sees its last
  // request complete (MPI progresses only in such calls: that is when it ends).
  void start_collective_timing() override;
  std::vector<std::pair<double, double>> collective_times() override;

  // Ranks whose heartbeats show they have not reached this rank's current
  // step (only ranks this rank watches; see the file comment).
  std::vector<int> missing_peers() override;
  void heartbeat() override;
  bool heartbeat_from_any_thread() const override;  // MPI_THREAD_MULTIPLE
  std::string diagnose_stall(double silence) override;

 private:
  void ensure_usable() const;
  // allreduce_sum under a deadline: the blocking MPI_Allreduce runs on worker_ while
  // this thread waits for it against the deadline, sending heartbeats. OpenMPI's
  // MPI_Iallreduce (libnbc) is several times slower than MPI_Allreduce at gradient
  // sizes, tested in a loop or waited on (docs/journal.md). Needs MPI_THREAD_MULTIPLE;
  // the caller waits, so comm_ never sees two collectives at once.
  void allreduce_on_worker(float* data, size_t count);
  // Completes `requests` (cleared on return) or throws CommError after the timeout.
  void wait(std::vector<MPI_Request>& requests, const char* what);
  // Tests (block: waits for some of) the async allreduces' requests, stamping
  // the collectives whose last request completed; true once all have.
  bool test_stamped(bool block);
  bool stamping() const { return timing_ && owner_.size() == pending_.size(); }
  void clear_pending() {
    pending_.clear();
    owner_.clear();
  }
  [[noreturn]] void fail_timeout(const char* what, double silence);
  void drain_heartbeats();
  void send_heartbeat();
  // Peers that reached this step but have not been heard from for `silence` seconds.
  std::vector<int> silent_peers(double silence);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm heartbeat_comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;  // a wait timed out: requests may still be in flight
  std::vector<MPI_Request> pending_;
  bool thread_multiple_ = false;
  // Collective timing: (launch, done) of each async allreduce since
  // start_collective_timing (seconds since it; done < 0 while open), the
  // requests each has open, and the collective each request of pending_ belongs to.
  bool timing_ = false;
  double timing_start_ = 0.0;
  std::vector<std::pair<double, double>> timed_;
  std::vector<int> open_requests_;
  std::vector<int> owner_;
  std::vector<int> completed_;  // test_stamped's scratch: indices MPI_Testsome reports

  // What the worker shares with this object. Held by both: after a timeout the worker
  // is detached (it may never return from MPI), and must not outlive what it touches.
  struct Worker {
    std::mutex m;
    // One each way, each notified with m released: a thread woken while the
    // notifier still holds m would only block on it again (two context
    // switches a bucket instead of one, on cores the allreduce needs).
    std::condition_variable work_cv, done_cv;
    float* data = nullptr;  // the job (guarded by m)
    size_t count = 0;
    bool pending = false, done = false, stop = false;
    int rc = MPI_SUCCESS;
  };
  std::shared_ptr<Worker> worker_state_ = std::make_shared<Worker>();
  std::thread worker_;  // started on first use

  std::vector<int> watched_;        // peers exchanging heartbeats with this rank
  std::vector<uint64_t> heard_;     // last sequence number heard from watched_[i]
  std::vector<double> heard_at_;    // when (steady clock, seconds) it was last heard
  std::vector<uint64_t> incoming_;  // receive buffers, one per watched peer
  std::vector<MPI_Request> heartbeat_recvs_;
  std::vector<MPI_Request> heartbeat_sends_;
  uint64_t sequence_ = 0;  // begin_step calls so far (same on every rank)
  uint64_t outgoing_ = 0;  // send buffer: must outlive the sends
};

// Version string of the MPI library linked at run time.
std::string mpi_library_version();

}  // namespace mgpu
