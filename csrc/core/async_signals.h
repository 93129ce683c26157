// Asynchronous signals held off a thread while native code runs that a handled signal
// would break: oneDNN's JIT GEMM kernels point rsp at a heap workspace, so a signal
// handler run on a thread inside one pushes its frame onto the heap (glibc aborts
// later: "free(): invalid pointer"; uxlfoundation/oneDNN issue 4845, fixed upstream by
// pull 4855 in 2026, after the 2.6 Debian 12 ships). cpu_backend.cpp holds them around
// every oneDNN GEMM and in its OpenMP workers; a training step, a model's forward-only or
// gradient call and the layer timings hold them for their whole length, so that their
// many GEMMs cost two mask changes, not two each.
//
// Held signals are not lost, but a held standard signal sent again merges with the
// pending one. One sent to the process goes to a thread that does not hold it: there a
// default action (SIGTERM, SIGQUIT) still ends the process at once, and a handler runs
// at once (CPython's C handler only records it; Python runs its own between bytecodes
// on the main thread, after the native call in any case). Only where every thread holds
// it (OpenMP workers hold for good, and so does any thread started while its creator
// held: a new thread takes its creator's mask; numpy's BLAS threads and MPI's progress
// threads do not) does it wait for the hold's end. One sent to a holding thread itself
// (tgkill, pthread_kill) waits for that thread's hold to end, for good in a worker.
// Faults the code raises (SIGSEGV and the like) are never held.
#pragma once
#include <pthread.h>
#include <signal.h>

#include <cstdint>

namespace mgpu {

inline const sigset_t& asynchronous_signals() {
  static const sigset_t set = [] {
    sigset_t s;
    sigfillset(&s);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT}) sigdelset(&s, sig);
    return s;
  }();
  return set;
}

// Holds asynchronous signals on this thread for its lifetime; nested holds change nothing.
class AsynchronousSignalsHeld {
 public:
  AsynchronousSignalsHeld() {
    if (state().depth++ == 0) {
      pthread_sigmask(SIG_BLOCK, &asynchronous_signals(), &saved_);
      ++state().generation;
    }
  }
  ~AsynchronousSignalsHeld() {
    if (--state().depth == 0) pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }
  AsynchronousSignalsHeld(const AsynchronousSignalsHeld&) = delete;
  AsynchronousSignalsHeld& operator=(const AsynchronousSignalsHeld&) = delete;

  // Which outermost hold of this thread is the current one (counts from 1): work done
  // once per hold (cpu_backend.cpp's check of its OpenMP workers) compares it.
  static uint64_t generation() { return state().generation; }

 private:
  struct State {
    int depth = 0;
    uint64_t generation = 0;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  sigset_t saved_;
};

}  // namespace mgpu
