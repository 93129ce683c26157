// Asynchronous signals held off a thread while native code runs that a handled signal
// would break: oneDNN's JIT GEMM kernels point rsp at a heap workspace, so a signal
// handler run on a thread inside one pushes its frame onto the heap (glibc aborts
// later: "free(): invalid pointer"; uxlfoundation/oneDNN issue 4845, fixed upstream by
// pull 4855 in 2026, after the 2.6 Debian 12 ships). cpu_backend.cpp holds them around
// every oneDNN GEMM; a training step holds them for its whole length, so that its many
// GEMMs cost two mask changes, not two each.
//
// Held signals are not lost: one sent to the process goes to another thread meanwhile
// (its C handler only records it), one sent to this thread waits for the release.
// Python runs its handlers on the main thread between bytecodes, so a signal reaching
// a native call is handled after the call in any case. Faults the code itself raises
// (SIGSEGV and the like) are never held.
#pragma once
#include <pthread.h>
#include <signal.h>

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
    if (depth()++ == 0) pthread_sigmask(SIG_BLOCK, &asynchronous_signals(), &saved_);
  }
  ~AsynchronousSignalsHeld() {
    if (--depth() == 0) pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }
  AsynchronousSignalsHeld(const AsynchronousSignalsHeld&) = delete;
  AsynchronousSignalsHeld& operator=(const AsynchronousSignalsHeld&) = delete;

 private:
  static int& depth() {
    static thread_local int held = 0;
    return held;
  }
  sigset_t saved_;
};

}  // namespace mgpu
