// MPI communicator implementation (see mpi_communicator.h).
#include "mpi_communicator.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <sstream>
#include <string>

#include "../core/errors.h"

namespace mgpu {

namespace {
void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw CommError(std::string(what) + " failed: " + std::string(msg, len));
}
// MPI counts are int: larger buffers go in chunks.
constexpr size_t kMaxChunk = static_cast<size_t>(INT_MAX);
// Allreduces go in chunks of at most 8 MiB: OpenMPI's shared-memory MPI_Allreduce keeps
// its bandwidth up to 8 MiB and collapses from 16-32 MiB on (docs/journal.md). Elsewhere
// a chunk adds one collective's latency (microseconds) per 8 MiB moved: at most a few
// percent even over a slow network.
constexpr size_t kAllreduceChunk = size_t{8} << 20 >> 2;
// All-gathers go in windows of at most this many elements (MPI counts and displacements
// are int): unlike the allreduce, OpenMPI's MPI_Allgatherv is faster in one call than in
// 8 MiB windows (scripts/experiments/reduce_scatter_choice.py). A reduce-scatter of a
// range one rank owns is an MPI_Reduce to it, in kAllreduceChunk pieces: MPI_Reduce
// collapses on large messages as MPI_Allreduce does. A range several ranks own parts of
// goes round a ring (ring_reduce_scatter): one MPI_Reduce per part would leave every
// rank but the part's owner idle while it sums, and MPI_Reduce_scatter is several times
// slower (docs/journal.md).
constexpr size_t kGatherChunk = kMaxChunk;

// Calls fn(offset, elements) for consecutive pieces of at most `chunk` of `count` elements.
template <typename Fn>
void for_each_chunk(size_t count, size_t chunk, Fn&& fn) {
  for (size_t done = 0; done < count; done += chunk) fn(done, static_cast<int>(std::min(chunk, count - done)));
}
// Calls fn(owner, offset, elements) for consecutive pieces of at most kAllreduceChunk of
// each nonzero part (a reduce-scatter's reductions to each part's owner).
template <typename Fn>
void for_each_part_chunk(const size_t* parts, int size, Fn&& fn) {
  size_t offset = 0;
  for (int r = 0; r < size; offset += parts[r], ++r)
    for_each_chunk(parts[r], kAllreduceChunk, [&](size_t done, int n) { fn(r, offset + done, n); });
}
// Counts (out[0, size)) and displacements (out[size, 2 size)) of the window [begin, end)
// of a range cut into parts, for MPI_Allgatherv over it: each part's intersection with it.
void gather_window(const size_t* parts, int size, size_t begin, size_t end, int* out) {
  size_t lo = 0;
  for (int r = 0; r < size; lo += parts[r], ++r) {
    const size_t a = std::min(std::max(lo, begin), end), b = std::min(std::max(lo + parts[r], begin), end);
    out[r] = static_cast<int>(b - a);
    out[size + r] = static_cast<int>(a - begin);
  }
}
// The ring's messages: on comm_, which carries no other point-to-point traffic.
constexpr int kRingTag = 11;

// An in-place reduce-scatter over parts several ranks own, in windows of
// kAllreduceChunk elements of every part: size - 1 times, each rank sends a part's
// window (its values plus those added so far) to the next rank and adds what the
// previous rank sent into its copy of another part's window, so every rank sums at
// once, and ends holding the sum of its own part (the ring of NCCL's reduce-scatter).
// Two ranks add a + b, each the other's: what an allreduce of two gives, bit for bit.
int ring_reduce_scatter(float* data, const size_t* parts, int rank, int size, MPI_Comm comm,
                        std::vector<float>& window) {
  size_t longest = 0;
  for (int r = 0; r < size; ++r) longest = std::max(longest, parts[r]);
  window.resize(std::min(longest, kAllreduceChunk));
  auto start = [&](int part) {
    size_t offset = 0;
    for (int r = 0; r < part; ++r) offset += parts[r];
    return offset;
  };
  auto length = [&](int part, size_t w) { return parts[part] > w ? std::min(kAllreduceChunk, parts[part] - w) : 0; };
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (size_t w = 0; w < longest; w += kAllreduceChunk)
    for (int s = 0; s < size - 1; ++s) {
      const int send = (rank - s - 1 + 2 * size) % size, recv = (rank - s - 2 + 2 * size) % size;
      const size_t ns = length(send, w), nr = length(recv, w);
      const int rc =
          MPI_Sendrecv(data + start(send) + w, static_cast<int>(ns), MPI_FLOAT, next, kRingTag, window.data(),
                       static_cast<int>(nr), MPI_FLOAT, prev, kRingTag, comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return rc;
      float* sum = data + start(recv) + w;
      for (size_t i = 0; i < nr; ++i) sum[i] += window[i];
    }
  return MPI_SUCCESS;
}

// Up to this many ranks everyone watches everyone (size - 1 tiny messages per
// rank and step); beyond it heartbeats go to rank 0 and back.
constexpr int kAllToAllHeartbeats = 32;
constexpr int kHeartbeatTag = 7;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

MpiCommunicator::MpiCommunicator(uintptr_t handle) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  MGPU_CHECK(initialized && !finalized, CommError,
             "MPI is not initialised (import mpi4py.MPI before creating an MPI communicator)");
  MPI_Comm parent = reinterpret_cast<MPI_Comm>(handle);
  MGPU_CHECK(parent != MPI_COMM_NULL, CommError, "MPI communicator handle is MPI_COMM_NULL");
  check(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
  check(MPI_Comm_dup(parent, &heartbeat_comm_), "MPI_Comm_dup");
  // Errors come back as return codes (and then exceptions) instead of aborting.
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_set_errhandler(heartbeat_comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  // Whether queued collectives run on the worker (a ring of MPI_Sendrecv) or as
  // non-blocking calls (MPI_Ireduce per part) decides which calls meet on comm_:
  // every rank takes the same path, MPI_THREAD_MULTIPLE only where all have it.
  int level = MPI_THREAD_SINGLE;
  int multiple = MPI_Query_thread(&level) == MPI_SUCCESS && level == MPI_THREAD_MULTIPLE ? 1 : 0;
  heartbeat_any_thread_ = multiple == 1;  // this rank's own: thread safety is per process
  check(MPI_Allreduce(MPI_IN_PLACE, &multiple, 1, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
  thread_multiple_ = multiple == 1;

  for (int r = 0; r < size_; ++r)
    if (r != rank_ && (size_ <= kAllToAllHeartbeats || rank_ == 0 || r == 0)) watched_.push_back(r);
  heard_.assign(watched_.size(), 0);
  heard_at_.assign(watched_.size(), now_seconds());
  incoming_.assign(watched_.size(), 0);
  heartbeat_recvs_.assign(watched_.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < watched_.size(); ++i)
    check(MPI_Irecv(&incoming_[i], 1, MPI_UINT64_T, watched_[i], kHeartbeatTag, heartbeat_comm_, &heartbeat_recvs_[i]),
          "MPI_Irecv");
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (worker_.joinable() && !broken_ && !finalized && timeout_seconds_ > 0.0) {
    try {  // not closed: what is queued completes under the deadline, or the communicator breaks
      drain_worker();
    } catch (...) {
    }
  }
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(worker_state_->m);
      worker_state_->stop = true;
      worker_state_->drop = broken_ || finalized;  // else what is queued still runs, as pending_ is waited for below
    }
    worker_state_->work_cv.notify_all();
    if (broken_)
      worker_.detach();  // it may wait in MPI_Allreduce forever (comm_ is never freed then)
    else
      worker_.join();
  }
  if (finalized) return;
  end_heartbeats();
  // After a timeout or an abort, collectives may never complete: leave them and comm_ (the job is ending).
  if (broken_ && !closed_) return;
  if (!pending_.empty()) MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE);
  MPI_Comm_free(&heartbeat_comm_);
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::end_heartbeats() {
  for (MPI_Request& r : heartbeat_recvs_)
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);  // returns at once for a cancelled receive: incoming_ is free after it
    }
  if (heartbeats_sent()) return;
  for (MPI_Request& r : heartbeat_sends_)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // completes in the background, reading outgoing_:
  outgoing_.release();                                // deliberately never freed
}

void MpiCommunicator::ensure_usable() const {
  MGPU_CHECK(!broken_, CommError, "the MPI communicator is unusable: ", broken_why_);
}

void MpiCommunicator::mark_broken(std::string why) {
  if (!broken_) broken_why_ = std::move(why);
  broken_ = true;
}

bool MpiCommunicator::may_write_after_failure() const {
  if (!broken_) return false;
  if (!pending_.empty() || !abandoned_.empty()) return true;
  std::lock_guard<std::mutex> lock(worker_state_->m);
  return worker_state_->started > worker_state_->finished;  // a job the worker could not be stopped in
}

bool MpiCommunicator::test_stamped(bool block) {
  std::vector<int>& done = completed_;  // kept: the deadline path tests in a tight loop
  done.resize(pending_.size());
  int count = 0;
  const int n = static_cast<int>(pending_.size());
  const int rc = block ? MPI_Waitsome(n, pending_.data(), &count, done.data(), MPI_STATUSES_IGNORE)
                       : MPI_Testsome(n, pending_.data(), &count, done.data(), MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) {
    clear_pending();
    check(rc, block ? "MPI_Waitsome" : "MPI_Testsome");
  }
  if (count == MPI_UNDEFINED) return true;  // no active request left
  const double t = now_seconds() - timing_start_;
  for (int i = 0; i < count; ++i) {
    const int c = owner_[done[i]];
    if (--open_requests_[c] == 0) timed_[c].second = t;
  }
  for (const MPI_Request& r : pending_)
    if (r != MPI_REQUEST_NULL) return false;
  return true;
}

void MpiCommunicator::wait(std::vector<MPI_Request>& requests, const char* what) {
  if (requests.empty()) return;
  const bool is_pending = &requests == &pending_;
  const bool stamped = is_pending && stamping();
  auto finish = [&] {
    if (is_pending)
      clear_pending();
    else
      requests.clear();
  };
  if (timeout_seconds_ <= 0.0 && stamped) {
    while (!test_stamped(/*block=*/true)) {
    }
    clear_pending();
    return;
  }
  if (timeout_seconds_ <= 0.0) {
    const int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    finish();
    check(rc, what ? what : "wait_all");
    return;
  }
  // While waiting, repeat the heartbeat so peers can tell a waiting rank from a frozen one.
  const double beat_interval = std::min(1.0, timeout_seconds_ / 4);
  const double start = now_seconds();
  const double deadline = start + timeout_seconds_;
  double next_beat = start + beat_interval;
  for (unsigned spins = 0;; ++spins) {
    int done = 0;
    if (stamped) {
      done = test_stamped(/*block=*/false);
    } else {
      const int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        finish();
        check(rc, what ? what : "wait_all");
      }
    }
    if (done) {
      finish();
      return;
    }
    if ((spins & 1023) == 1023) {
      const double now = now_seconds();
      if (now > next_beat) {
        send_heartbeat();
        drain_heartbeats();
        next_beat = now + beat_interval;
      }
      if (now > deadline) {
        if (!is_pending)  // pending_ keeps its own; these may still write the caller's memory
          for (MPI_Request r : requests)
            if (r != MPI_REQUEST_NULL) abandoned_.push_back(r);
        fail_timeout(what ? what : first_open_kind(), 2.5 * beat_interval);
      }
      sched_yield();  // share the core with a peer rank on an oversubscribed node
    }
  }
}

void MpiCommunicator::fail_timeout(const char* what, double silence) {
  std::ostringstream msg;
  msg << what << " at step " << current_step_ << " did not complete within " << timeout_seconds_ << " s on rank "
      << rank_;
  mark_broken("an earlier " + msg.str() + " (a timeout)");
  msg << ": " << diagnose_stall(silence);
  throw CommError(msg.str());
}

bool MpiCommunicator::heartbeat_from_any_thread() const { return heartbeat_any_thread_; }

void MpiCommunicator::heartbeat() {
  send_heartbeat();
  drain_heartbeats();
}

std::string MpiCommunicator::diagnose_stall(double silence) {
  const std::vector<int> missing = missing_peers();
  const std::vector<int> silent = silent_peers(silence);
  return describe_stall(missing, silent, static_cast<int>(watched_.size()) == size_ - 1);
}

std::vector<int> MpiCommunicator::silent_peers(double silence) {
  const double now = now_seconds();
  std::vector<int> silent;
  for (size_t i = 0; i < watched_.size(); ++i)
    if (heard_[i] >= sequence_ && now - heard_at_[i] > silence) silent.push_back(watched_[i]);
  return silent;
}

void MpiCommunicator::drain_heartbeats() {
  for (size_t i = 0; i < watched_.size(); ++i) {
    for (;;) {  // several heartbeats may be queued
      int arrived = 0;
      if (heartbeat_recvs_[i] == MPI_REQUEST_NULL) break;
      if (MPI_Test(&heartbeat_recvs_[i], &arrived, MPI_STATUS_IGNORE) != MPI_SUCCESS || !arrived) break;
      heard_[i] = std::max(heard_[i], incoming_[i]);
      heard_at_[i] = now_seconds();
      if (MPI_Irecv(&incoming_[i], 1, MPI_UINT64_T, watched_[i], kHeartbeatTag, heartbeat_comm_,
                    &heartbeat_recvs_[i]) != MPI_SUCCESS)
        heartbeat_recvs_[i] = MPI_REQUEST_NULL;
    }
  }
}

std::vector<int> MpiCommunicator::missing_peers() {
  drain_heartbeats();
  std::vector<int> missing;
  for (size_t i = 0; i < watched_.size(); ++i)
    if (heard_[i] < sequence_) missing.push_back(watched_[i]);
  return missing;
}

void MpiCommunicator::begin_step(uint64_t step) {
  Communicator::begin_step(step);
  ++sequence_;
  if (watched_.empty()) return;
  drain_heartbeats();  // also keeps MPI's unexpected-message queue short
  send_heartbeat();
}

bool MpiCommunicator::heartbeats_sent() {
  int sent = 1;
  if (!heartbeat_sends_.empty() && MPI_Testall(static_cast<int>(heartbeat_sends_.size()), heartbeat_sends_.data(),
                                               &sent, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    sent = 0;
  return sent != 0;
}

void MpiCommunicator::send_heartbeat() {
  if (watched_.empty()) return;
  // Never block on a heartbeat: if the previous ones are still in flight (a
  // peer is not receiving), skip this one.
  if (!heartbeats_sent()) return;
  heartbeat_sends_.assign(watched_.size(), MPI_REQUEST_NULL);
  *outgoing_ = sequence_;
  for (size_t i = 0; i < watched_.size(); ++i)
    check(
        MPI_Isend(outgoing_.get(), 1, MPI_UINT64_T, watched_[i], kHeartbeatTag, heartbeat_comm_, &heartbeat_sends_[i]),
        "MPI_Isend");
}

void MpiCommunicator::allreduce_sum(float* data, size_t count) { run({Kind::kAllreduce, data, count, nullptr}); }

void MpiCommunicator::reduce_scatter_sum(float* data, const std::vector<size_t>& parts) {
  run({Kind::kReduceScatter, data, parts_total(parts), parts.data()});
}

void MpiCommunicator::all_gather(float* data, const std::vector<size_t>& parts) {
  run({Kind::kAllGather, data, parts_total(parts), parts.data()});
}

const char* MpiCommunicator::words(Kind kind) {
  switch (kind) {
    case Kind::kReduceScatter: return "reduce-scatter";
    case Kind::kAllGather: return "all-gather";
    default: return "allreduce";
  }
}

const char* MpiCommunicator::blocking_call(Kind kind) {
  switch (kind) {
    case Kind::kReduceScatter: return "MPI_Reduce or MPI_Sendrecv";
    case Kind::kAllGather: return "MPI_Allgatherv";
    default: return "MPI_Allreduce";
  }
}

std::vector<int>& MpiCommunicator::next_arrays() {
  if (pending_.empty()) arrays_used_ = 0;
  if (arrays_.size() <= arrays_used_) arrays_.resize(arrays_used_ + 1);
  return arrays_[arrays_used_++];
}

void MpiCommunicator::run(const Job& job) {
  ensure_usable();
  if (timeout_seconds_ > 0.0 && thread_multiple_) {
    run_on_worker(job);
    return;
  }
  if (thread_multiple_) drain_worker();  // comm_'s collectives in the order they were issued
  if (timeout_seconds_ <= 0.0) {
    check(run_blocking(job, comm_, rank_, size_, next_arrays(), window_), blocking_call(job.kind));
    return;
  }
  std::vector<MPI_Request> requests;
  start(job, requests);
  wait(requests, words(job.kind));
}

int MpiCommunicator::run_blocking(const Job& job, MPI_Comm comm, int rank, int size, std::vector<int>& arrays,
                                  std::vector<float>& window) {
  int rc = MPI_SUCCESS;
  switch (job.kind) {
    case Kind::kAllreduce:
      for_each_chunk(job.count, kAllreduceChunk, [&](size_t done, int n) {
        if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, job.data + done, n, MPI_FLOAT, MPI_SUM, comm);
      });
      break;
    case Kind::kReduceScatter:
      if (std::count_if(job.parts, job.parts + size, [](size_t n) { return n > 0; }) > 1)
        return ring_reduce_scatter(job.data, job.parts, rank, size, comm, window);
      for_each_part_chunk(job.parts, size, [&](int owner, size_t offset, int n) {
        float* p = job.data + offset;
        if (rc == MPI_SUCCESS)
          rc = MPI_Reduce(owner == rank ? MPI_IN_PLACE : p, owner == rank ? p : nullptr, n, MPI_FLOAT, MPI_SUM, owner,
                          comm);
      });
      break;
    case Kind::kAllGather:
      arrays.resize(2 * static_cast<size_t>(size));
      for (size_t w = 0; w < job.count && rc == MPI_SUCCESS; w += kGatherChunk) {
        gather_window(job.parts, size, w, std::min(job.count, w + kGatherChunk), arrays.data());
        rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, job.data + w, arrays.data(), arrays.data() + size,
                            MPI_FLOAT, comm);
      }
      break;
  }
  return rc;
}

void MpiCommunicator::start(const Job& job, std::vector<MPI_Request>& requests) {
  switch (job.kind) {
    case Kind::kAllreduce:
      for_each_chunk(job.count, kAllreduceChunk, [&](size_t done, int n) {
        requests.emplace_back();
        check(MPI_Iallreduce(MPI_IN_PLACE, job.data + done, n, MPI_FLOAT, MPI_SUM, comm_, &requests.back()),
              "MPI_Iallreduce");
      });
      break;
    case Kind::kReduceScatter:
      for_each_part_chunk(job.parts, size_, [&](int owner, size_t offset, int n) {
        float* p = job.data + offset;
        requests.emplace_back();
        check(MPI_Ireduce(owner == rank_ ? MPI_IN_PLACE : p, owner == rank_ ? p : nullptr, n, MPI_FLOAT, MPI_SUM, owner,
                          comm_, &requests.back()),
              "MPI_Ireduce");
      });
      break;
    case Kind::kAllGather:
      for (size_t w = 0; w < job.count; w += kGatherChunk) {
        std::vector<int>& a = next_arrays();  // read by MPI until the request completes
        a.resize(2 * static_cast<size_t>(size_));
        gather_window(job.parts, size_, w, std::min(job.count, w + kGatherChunk), a.data());
        requests.emplace_back();
        check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, job.data + w, a.data(), a.data() + size_, MPI_FLOAT,
                              comm_, &requests.back()),
              "MPI_Iallgatherv");
      }
      break;
  }
}

void MpiCommunicator::worker_loop(std::shared_ptr<Worker> w, MPI_Comm comm, int rank, int size) {
  std::unique_lock<std::mutex> lock(w->m);
  for (;;) {
    w->work_cv.wait(lock, [&] { return !w->queue.empty() || w->stop; });
    if (w->drop || (w->stop && w->queue.empty())) return;
    Worker::Queued q = std::move(w->queue.front());
    w->queue.pop_front();
    if (w->rc != MPI_SUCCESS) {  // after a failure the ranks' collectives no longer match: skip the rest
      ++w->started;
      ++w->finished;
      w->done_cv.notify_all();
      continue;
    }
    w->running = q.job.kind;
    ++w->started;
    q.job.parts = q.parts.empty() ? nullptr : q.parts.data();
    lock.unlock();
    int rc = MPI_SUCCESS;
    try {  // nothing may leave this thread: the caller hears of it as an error code
      rc = run_blocking(q.job, comm, rank, size, w->arrays, w->window);
    } catch (const std::bad_alloc&) {
      rc = MPI_ERR_NO_MEM;
    } catch (...) {
      rc = MPI_ERR_INTERN;
    }
    const double done = now_seconds();
    lock.lock();
    if (rc != MPI_SUCCESS && w->rc == MPI_SUCCESS) {
      w->rc = rc;
      w->failed = q.job.kind;
    }
    if (q.stamp >= 0) w->stamps.emplace_back(q.stamp, done);
    ++w->finished;
    lock.unlock();
    w->done_cv.notify_all();
    lock.lock();
  }
}

void MpiCommunicator::Worker::drop_queue() {
  finished += queue.size();  // never to run: no waiter waits for them
  started += queue.size();
  queue.clear();
  drop = true;
  done_cv.notify_all();
}

uint64_t MpiCommunicator::submit(const Job& job, int stamp) {
  Worker& w = *worker_state_;
  std::unique_lock<std::mutex> lock(w.m);
  if (!worker_.joinable()) worker_ = std::thread(worker_loop, worker_state_, comm_, rank_, size_);
  Worker::Queued q;
  q.job = job;
  if (job.parts) q.parts.assign(job.parts, job.parts + size_);  // the caller's may go before the worker runs it
  q.stamp = stamp;
  w.queue.push_back(std::move(q));
  const uint64_t ticket = ++w.submitted;
  lock.unlock();
  w.work_cv.notify_one();
  return ticket;
}

void MpiCommunicator::run_on_worker(const Job& job) { wait_worker(submit(job, -1)); }

bool MpiCommunicator::worker_busy() {
  std::lock_guard<std::mutex> lock(worker_state_->m);
  return worker_state_->finished < worker_state_->submitted;
}

void MpiCommunicator::drain_worker() {
  uint64_t submitted = 0;
  {
    std::lock_guard<std::mutex> lock(worker_state_->m);
    submitted = worker_state_->submitted;
  }
  wait_worker(submitted);
}

void MpiCommunicator::wait_worker(uint64_t ticket) {
  Worker& w = *worker_state_;
  std::unique_lock<std::mutex> lock(w.m);
  if (timeout_seconds_ <= 0.0) {
    w.done_cv.wait(lock, [&] { return w.finished >= ticket || w.drop; });
  } else {
    // Blocked, not spinning: the worker (and a peer rank on the same cores) needs the CPU.
    const double beat_interval = std::min(1.0, timeout_seconds_ / 4);
    const double deadline = now_seconds() + timeout_seconds_;
    while (w.finished < ticket && !w.drop) {
      const double now = now_seconds();
      if (now > deadline) {
        const Kind open = w.running;
        w.drop_queue();  // nothing more starts: the caller may free what they would use
        lock.unlock();
        fail_timeout(words(open), 2.5 * beat_interval);
      }
      const double wake = std::min(deadline, now + beat_interval);
      w.done_cv.wait_for(lock, std::chrono::duration<double>(wake - now), [&] { return w.finished >= ticket; });
      if (w.finished < ticket) {  // still waiting: tell the peers this rank is alive, read theirs
        lock.unlock();
        send_heartbeat();
        drain_heartbeats();
        lock.lock();
      }
    }
  }
  if (w.drop) {  // aborted from another thread: what this wait covered may never have run
    lock.unlock();
    ensure_usable();
    throw CommError("the MPI communicator was aborted while a collective waited");
  }
  for (const auto& [stamp, done] : w.stamps)
    if (timing_ && stamp < static_cast<int>(timed_.size()))
      timed_[static_cast<size_t>(stamp)].second = done - timing_start_;
  w.stamps.clear();
  const int rc = w.rc;
  const Kind failed = w.failed;
  w.rc = MPI_SUCCESS;
  lock.unlock();
  check(rc, blocking_call(failed));
}

void MpiCommunicator::broadcast(float* data, size_t count, int root) {
  ensure_usable();
  MGPU_CHECK(root >= 0 && root < size_, CommError, "broadcast root ", root, " outside [0, ", size_, ")");
  if (thread_multiple_) drain_worker();
  std::vector<MPI_Request> requests;
  for_each_chunk(count, kMaxChunk, [&](size_t done, int n) {
    if (timeout_seconds_ <= 0.0) {
      check(MPI_Bcast(data + done, n, MPI_FLOAT, root, comm_), "MPI_Bcast");
    } else {
      requests.emplace_back();
      check(MPI_Ibcast(data + done, n, MPI_FLOAT, root, comm_, &requests.back()), "MPI_Ibcast");
    }
  });
  wait(requests, "broadcast");
}

void MpiCommunicator::barrier() {
  ensure_usable();
  if (thread_multiple_) drain_worker();
  if (timeout_seconds_ <= 0.0) {
    check(MPI_Barrier(comm_), "MPI_Barrier");
    return;
  }
  std::vector<MPI_Request> requests(1);
  check(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
  wait(requests, "barrier");
}

void MpiCommunicator::allreduce_sum_async(float* data, size_t count) {
  launch({Kind::kAllreduce, data, count, nullptr});
}

void MpiCommunicator::reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) {
  launch({Kind::kReduceScatter, data, parts_total(parts), parts.data()});
}

void MpiCommunicator::all_gather_async(float* data, const std::vector<size_t>& parts) {
  launch({Kind::kAllGather, data, parts_total(parts), parts.data()});
}

void MpiCommunicator::launch(const Job& job) {
  ensure_usable();
  if (thread_multiple_) {
    int stamp = -1;
    if (timing_) {
      const double now = now_seconds() - timing_start_;
      timed_.emplace_back(now, job.count ? -1.0 : now);  // nothing to move: done when launched
      stamp = static_cast<int>(timed_.size()) - 1;
    }
    if (job.count) submit(job, stamp);
    return;
  }
  const bool stamp = stamping();
  if (stamp) timed_.emplace_back(now_seconds() - timing_start_, -1.0);
  const size_t before = pending_.size();
  start(job, pending_);
  pending_kind_.resize(pending_.size(), job.kind);
  if (!stamp) return;
  owner_.resize(pending_.size(), static_cast<int>(timed_.size()) - 1);
  open_requests_.push_back(static_cast<int>(pending_.size() - before));
  if (pending_.size() == before) timed_.back().second = timed_.back().first;  // nothing to wait for
}

void MpiCommunicator::start_collective_timing() {
  // collectives launched before would have no stamp: then none
  timing_ = pending_.empty() && !(thread_multiple_ && worker_busy());
  {
    std::lock_guard<std::mutex> lock(worker_state_->m);
    worker_state_->stamps.clear();  // of an earlier timing, never waited for (an error)
  }
  timing_start_ = now_seconds();
  timed_.clear();
  open_requests_.clear();
  owner_.clear();
}

std::vector<std::pair<double, double>> MpiCommunicator::collective_times() {
  const bool was = timing_;
  timing_ = false;
  owner_.clear();
  if (!was) return {};
  for (const auto& t : timed_)
    if (t.second < 0) return {};  // not seen complete (still in flight, or a wait failed)
  return std::move(timed_);
}

void MpiCommunicator::progress() {
  if (pending_.empty() || broken_) return;  // (the worker's queue needs no help)
  if (stamping()) {
    if (test_stamped(/*block=*/false)) clear_pending();
    return;
  }
  int flag = 0;
  // Testing drives OpenMPI's progress engine for the outstanding collectives.
  check(MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
  if (flag) clear_pending();
}

void MpiCommunicator::abort(const std::string& why) {
  // Queued collectives this rank will not run: the peers' never complete (as an
  // NCCL abort leaves them), and later calls fail, as the peers may wait in
  // collectives of the unwound step that this rank's next call would meet. The
  // one running, if any, cannot be stopped; non-blocking ones are left (never
  // waited for, comm_ never freed).
  if (closed_) return;
  mark_broken(why.empty() ? std::string("aborted") : "aborted (" + why + ")");
  std::lock_guard<std::mutex> lock(worker_state_->m);
  worker_state_->drop_queue();
}

void MpiCommunicator::close() {
  if (closed_) return;
  ensure_usable();
  wait_all();  // what is queued or in flight completes, under the deadline
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(worker_state_->m);
      worker_state_->stop = true;
    }
    worker_state_->work_cv.notify_all();
    worker_.join();  // idle: its queue is empty
  }
  closed_ = true;
  broken_ = true;
  broken_why_ = "it was closed";
}

void MpiCommunicator::wait_all() {
  ensure_usable();
  if (thread_multiple_) drain_worker();
  wait(pending_, nullptr);
}

const char* MpiCommunicator::first_open_kind() {
  // MPI_Testall leaves every request as it was unless all completed: test them
  // with MPI_Testsome, which sets the completed ones to MPI_REQUEST_NULL.
  std::vector<int> done(pending_.size());
  int count = 0;
  MPI_Testsome(static_cast<int>(pending_.size()), pending_.data(), &count, done.data(), MPI_STATUSES_IGNORE);
  for (size_t i = 0; i < pending_.size() && i < pending_kind_.size(); ++i)
    if (pending_[i] != MPI_REQUEST_NULL) return words(pending_kind_[i]);
  return pending_kind_.empty() ? words(Kind::kAllreduce) : words(pending_kind_.back());
}

std::string mpi_library_version() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string v(version, len);
  const auto nl = v.find_first_of("\r\n,");
  return nl == std::string::npos ? v : v.substr(0, nl);
}

}  // namespace mgpu
