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

// Calls fn(offset, elements) for consecutive pieces of at most `chunk` of `count` elements.
template <typename Fn>
void for_each_chunk(size_t count, size_t chunk, Fn&& fn) {
  for (size_t done = 0; done < count; done += chunk) fn(done, static_cast<int>(std::min(chunk, count - done)));
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
  int level = MPI_THREAD_SINGLE;
  thread_multiple_ = MPI_Query_thread(&level) == MPI_SUCCESS && level == MPI_THREAD_MULTIPLE;
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");

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
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(worker_state_->m);
      worker_state_->stop = true;
    }
    worker_state_->work_cv.notify_all();
    if (broken_)
      worker_.detach();  // it may wait in MPI_Allreduce forever (comm_ is never freed then)
    else
      worker_.join();
  }
  // After a timeout, collectives may never complete: leave them (the job is ending).
  if (finalized || broken_) return;
  if (!pending_.empty()) MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE);
  for (MPI_Request& r : heartbeat_recvs_)
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  for (MPI_Request& r : heartbeat_sends_)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // completes in the background
  MPI_Comm_free(&heartbeat_comm_);
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::ensure_usable() const {
  MGPU_CHECK(!broken_, CommError, "the MPI communicator is unusable after an earlier timeout");
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
  const bool stamped = &requests == &pending_ && stamping();
  if (timeout_seconds_ <= 0.0 && stamped) {
    while (!test_stamped(/*block=*/true)) {
    }
    clear_pending();
    return;
  }
  if (timeout_seconds_ <= 0.0) {
    const int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    requests.clear();
    check(rc, what);
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
        requests.clear();
        check(rc, what);
      }
    }
    if (done) {
      if (stamped) owner_.clear();
      requests.clear();
      return;
    }
    if ((spins & 1023) == 1023) {
      const double now = now_seconds();
      if (now > next_beat) {
        send_heartbeat();
        drain_heartbeats();
        next_beat = now + beat_interval;
      }
      if (now > deadline) fail_timeout(what, 2.5 * beat_interval);
      sched_yield();  // share the core with a peer rank on an oversubscribed node
    }
  }
}

void MpiCommunicator::fail_timeout(const char* what, double silence) {
  broken_ = true;
  std::ostringstream msg;
  msg << what << " at step " << current_step_ << " did not complete within " << timeout_seconds_ << " s on rank "
      << rank_ << ": " << diagnose_stall(silence);
  throw CommError(msg.str());
}

bool MpiCommunicator::heartbeat_from_any_thread() const { return thread_multiple_; }

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

void MpiCommunicator::send_heartbeat() {
  if (watched_.empty()) return;
  // Never block on a heartbeat: if the previous ones are still in flight (a
  // peer is not receiving), skip this one.
  int sent = 1;
  if (!heartbeat_sends_.empty() && MPI_Testall(static_cast<int>(heartbeat_sends_.size()), heartbeat_sends_.data(),
                                               &sent, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    sent = 0;
  if (!sent) return;
  heartbeat_sends_.assign(watched_.size(), MPI_REQUEST_NULL);
  outgoing_ = sequence_;
  for (size_t i = 0; i < watched_.size(); ++i)
    check(MPI_Isend(&outgoing_, 1, MPI_UINT64_T, watched_[i], kHeartbeatTag, heartbeat_comm_, &heartbeat_sends_[i]),
          "MPI_Isend");
}

void MpiCommunicator::allreduce_sum(float* data, size_t count) {
  ensure_usable();
  if (timeout_seconds_ > 0.0 && thread_multiple_) {
    allreduce_on_worker(data, count);
    return;
  }
  if (timeout_seconds_ <= 0.0) {
    for_each_chunk(count, kAllreduceChunk, [&](size_t done, int n) {
      check(MPI_Allreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_), "MPI_Allreduce");
    });
    return;
  }
  std::vector<MPI_Request> requests;
  for_each_chunk(count, kAllreduceChunk, [&](size_t done, int n) {
    requests.emplace_back();
    check(MPI_Iallreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_, &requests.back()), "MPI_Iallreduce");
  });
  wait(requests, "allreduce");
}

namespace {
// The worker: one blocking MPI_Allreduce per job, on `comm`, until told to stop.
// It holds only the shared state and the handle, never the communicator object.
template <typename State>
void allreduce_worker(std::shared_ptr<State> w, MPI_Comm comm) {
  std::unique_lock<std::mutex> lock(w->m);
  for (;;) {
    w->work_cv.wait(lock, [&] { return w->pending || w->stop; });
    if (w->stop) return;
    w->pending = false;
    float* data = w->data;
    const size_t count = w->count;
    lock.unlock();
    int rc = MPI_SUCCESS;
    for_each_chunk(count, kAllreduceChunk, [&](size_t done, int n) {
      if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm);
    });
    lock.lock();
    w->rc = rc;
    w->done = true;
    lock.unlock();
    w->done_cv.notify_one();
    lock.lock();
  }
}
}  // namespace

void MpiCommunicator::allreduce_on_worker(float* data, size_t count) {
  Worker& w = *worker_state_;
  std::unique_lock<std::mutex> lock(w.m);
  if (!worker_.joinable()) worker_ = std::thread(allreduce_worker<Worker>, worker_state_, comm_);
  w.data = data;
  w.count = count;
  w.done = false;
  w.pending = true;
  lock.unlock();
  w.work_cv.notify_one();
  lock.lock();
  // Blocked, not spinning: the worker (and a peer rank on the same cores) needs the CPU.
  const double beat_interval = std::min(1.0, timeout_seconds_ / 4);
  const double deadline = now_seconds() + timeout_seconds_;
  while (!w.done) {
    const double now = now_seconds();
    if (now > deadline) {
      lock.unlock();
      fail_timeout("allreduce", 2.5 * beat_interval);
    }
    const double wake = std::min(deadline, now + beat_interval);
    w.done_cv.wait_for(lock, std::chrono::duration<double>(wake - now), [&] { return w.done; });
    if (!w.done) {  // still waiting: tell the peers this rank is alive, read theirs
      lock.unlock();
      send_heartbeat();
      drain_heartbeats();
      lock.lock();
    }
  }
  const int rc = w.rc;
  lock.unlock();
  check(rc, "MPI_Allreduce");
}

void MpiCommunicator::broadcast(float* data, size_t count, int root) {
  ensure_usable();
  MGPU_CHECK(root >= 0 && root < size_, CommError, "broadcast root ", root, " outside [0, ", size_, ")");
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
  if (timeout_seconds_ <= 0.0) {
    check(MPI_Barrier(comm_), "MPI_Barrier");
    return;
  }
  std::vector<MPI_Request> requests(1);
  check(MPI_Ibarrier(comm_, &requests[0]), "MPI_Ibarrier");
  wait(requests, "barrier");
}

void MpiCommunicator::allreduce_sum_async(float* data, size_t count) {
  ensure_usable();
  const bool stamp = stamping();
  if (stamp) {
    timed_.emplace_back(now_seconds() - timing_start_, -1.0);
    open_requests_.push_back(0);
  }
  for_each_chunk(count, kAllreduceChunk, [&](size_t done, int n) {
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_, &req), "MPI_Iallreduce");
    pending_.push_back(req);
    if (stamp) {
      owner_.push_back(static_cast<int>(timed_.size()) - 1);
      ++open_requests_.back();
    }
  });
  if (stamp && count == 0) timed_.back().second = timed_.back().first;  // nothing to wait for
}

void MpiCommunicator::start_collective_timing() {
  timing_ = pending_.empty();  // requests launched before would have no stamp: then none
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
  if (pending_.empty() || broken_) return;
  if (stamping()) {
    if (test_stamped(/*block=*/false)) clear_pending();
    return;
  }
  int flag = 0;
  // Testing drives OpenMPI's progress engine for the outstanding collectives.
  check(MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
  if (flag) pending_.clear();
}

void MpiCommunicator::wait_all() {
  ensure_usable();
  wait(pending_, "allreduce");
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
