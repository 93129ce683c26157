// MPI communicator over a communicator handed over from mpi4py (duplicated, so
// our collectives never match a user's). Host memory only: the CPU backend's
// buffers, or host-staged GPU gradients.
//
// Fault detection: with a timeout set, every collective runs on a worker thread
// (MPI_THREAD_MULTIPLE) or is non-blocking, and is waited on against a
// deadline, so a dead or stopped peer ends the wait with a CommError instead of
// a hang. Heartbeats on a second duplicate tell who is missing: at each step
// every rank sends its step sequence number to the ranks it watches (everyone
// in small worlds; rank 0 and back in large ones), and repeats it while it
// waits in a collective. A peer that has not sent this step's number has not
// reached the step; one that sent it but went silent while the others wait is
// frozen or dead inside the collective.
#pragma once
#include <mpi.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
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
  void reduce_scatter_sum(float* data, const std::vector<size_t>& parts) override;
  void all_gather(float* data, const std::vector<size_t>& parts) override;
  void reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) override;
  void all_gather_async(float* data, const std::vector<size_t>& parts) override;
  void progress() override;
  void wait_all() override;
  // Drops the worker's queued collectives; later calls throw CommError naming `why`.
  void abort(const std::string& why) override;
  // Completes what is queued or in flight under the deadline and stops the worker.
  void close() override;
  bool may_write_after_failure() const override;
  void begin_step(uint64_t step) override;
  // With MPI_THREAD_MULTIPLE the async forms are queued to the worker thread,
  // which runs them in order with the blocking calls (OpenMPI's non-blocking
  // collectives, libnbc, progress only when tested and run several times
  // slower: docs/journal.md); each is stamped done when the worker finishes it.
  // Without it, each is stamped done when a test or wait here sees its last
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
  void mark_broken(std::string why);  // later calls throw CommError naming why (the first reason kept)
  // One collective: an allreduce of `count` elements, or a reduce-scatter or
  // all-gather over the parts (size_ of them, summing to count) cut from data.
  enum class Kind { kAllreduce, kReduceScatter, kAllGather };
  struct Job {
    Kind kind = Kind::kAllreduce;
    float* data = nullptr;
    size_t count = 0;
    const size_t* parts = nullptr;
  };
  // A blocking collective: MPI's blocking calls without a timeout; under a
  // deadline, on the worker with MPI_THREAD_MULTIPLE, else non-blocking calls
  // waited on here.
  void run(const Job& job);
  // run under a deadline: the blocking MPI call runs on worker_ while this thread
  // waits for it against the deadline, sending heartbeats. OpenMPI's
  // MPI_Iallreduce (libnbc) is several times slower than MPI_Allreduce at gradient
  // sizes, tested in a loop or waited on (docs/journal.md). Needs MPI_THREAD_MULTIPLE.
  // comm_ never sees two collectives at once: the worker runs its queue in order,
  // and this thread's own calls on comm_ wait for the queue first (drain_worker).
  void run_on_worker(const Job& job);
  // Hands the job (a copy of its parts) to the worker; returns its ticket.
  // stamp: its index in timed_, or -1.
  uint64_t submit(const Job& job, int stamp);
  // Waits until the worker finished every job up to `ticket`, against the
  // deadline with heartbeats; throws the first failure since the last wait.
  void wait_worker(uint64_t ticket);
  void drain_worker();  // wait_worker for everything submitted
  bool worker_busy();   // jobs submitted and not yet finished
  // The job's blocking MPI calls; returns the first error code. `arrays`: scratch
  // for an all-gather's counts and displacements; `window`: a ring's receive buffer.
  static int run_blocking(const Job& job, MPI_Comm comm, int rank, int size, std::vector<int>& arrays,
                          std::vector<float>& window);
  static const char* words(Kind kind);          // for messages: "allreduce", ...
  static const char* blocking_call(Kind kind);  // the MPI function run_blocking calls
  struct Worker;
  // The worker thread: one run_blocking per job, until told to stop. It holds
  // only the shared state and the handle, never the communicator object.
  static void worker_loop(std::shared_ptr<Worker> w, MPI_Comm comm, int rank, int size);
  // Starts the job's non-blocking calls, appending their requests; the count and
  // displacement arrays they read live in arrays_ until pending_ is empty.
  void start(const Job& job, std::vector<MPI_Request>& requests);
  // The async forms: start(), with each request stamped and its kind kept.
  void launch(const Job& job);
  // Completes `requests` (cleared on return) or throws CommError after the
  // timeout, naming `what`, or for pending_ (what null) the first collective not done.
  void wait(std::vector<MPI_Request>& requests, const char* what);
  // Tests (block: waits for some of) the async collectives' requests, stamping
  // the collectives whose last request completed; true once all have.
  bool test_stamped(bool block);
  bool stamping() const { return timing_ && owner_.size() == pending_.size(); }
  void clear_pending() {
    pending_.clear();
    pending_kind_.clear();
    owner_.clear();
  }
  // The words for the first collective in pending_ that has not completed.
  const char* first_open_kind();
  // A free slot of arrays_ (all free once pending_ is empty).
  std::vector<int>& next_arrays();
  [[noreturn]] void fail_timeout(const char* what, double silence);
  void drain_heartbeats();
  // At the end: the heartbeats' receives cancelled, sends still in flight left with their buffer.
  void end_heartbeats();
  void send_heartbeat();
  bool heartbeats_sent();  // every heartbeat send so far completed (tests them)
  // Peers that reached this step but have not been heard from for `silence` seconds.
  std::vector<int> silent_peers(double silence);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm heartbeat_comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;  // timed out, aborted or closed: requests may still be in flight (not closed)
  bool closed_ = false;
  std::string broken_why_;
  std::vector<MPI_Request> pending_;
  std::vector<Kind> pending_kind_;  // the collective each request of pending_ belongs to
  // Count and displacement arrays of the all-gathers started, [0, arrays_used_)
  // in use; kept (inner buffers keep their address when the outer grows).
  std::vector<std::vector<int>> arrays_;
  size_t arrays_used_ = 0;
  std::vector<float> window_;          // a blocking reduce-scatter's ring window, on this thread
  bool thread_multiple_ = false;       // every rank has MPI_THREAD_MULTIPLE: queued collectives on the worker
  bool heartbeat_any_thread_ = false;  // this rank has it
  // Requests of blocking calls that timed out: never waited for, never freed (their
  // memory may still be written: may_write_after_failure).
  std::vector<MPI_Request> abandoned_;
  // Collective timing: (launch, done) of each async collective since
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
    struct Queued {
      Job job;  // job.parts points into parts once the worker takes it
      std::vector<size_t> parts;
      int stamp = -1;  // index in timed_, or -1
    };
    std::deque<Queued> queue;  // guarded by m: submitted, not yet started, in order
    // Dropped jobs count as started and finished.
    uint64_t submitted = 0, started = 0, finished = 0;
    Kind running = Kind::kAllreduce;             // the job started last (while finished < submitted)
    std::vector<std::pair<int, double>> stamps;  // (stamp, steady seconds) of finished stamped jobs
    std::vector<int> arrays;                     // the all-gather's counts and displacements
    std::vector<float> window;                   // the reduce-scatter's ring window
    bool stop = false, drop = false;             // stop once the queue is empty, or at once (drop)
    int rc = MPI_SUCCESS;                        // the first failure since the last wait, and its job's kind
    Kind failed = Kind::kAllreduce;
    void drop_queue();  // with m held: nothing queued will start, and the worker stops
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
  // Send buffer: must outlive the sends (leaked by a broken communicator whose sends remain).
  std::unique_ptr<uint64_t> outgoing_ = std::make_unique<uint64_t>(0);
};

// Version string of the MPI library linked at run time.
std::string mpi_library_version();

}  // namespace mgpu
