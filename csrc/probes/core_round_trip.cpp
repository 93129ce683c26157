// The cache-line round trip of core_round_trip.h: two threads, each pinned to its CPU.
#include "core_round_trip.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../core/errors.h"

namespace mgpu {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

double core_round_trip_ns(int cpu_a, int cpu_b, int batches, double timeout_s) {
  MGPU_CHECK(cpu_a >= 0 && cpu_b >= 0 && cpu_a != cpu_b && cpu_a < CPU_SETSIZE && cpu_b < CPU_SETSIZE, ConfigError,
             "the round trip needs two different CPUs in [0, ", CPU_SETSIZE, "), got ", cpu_a, " and ", cpu_b);
  MGPU_CHECK(batches >= 1 && timeout_s > 0 && timeout_s <= 3600, ConfigError,
             "batches must be >= 1 and timeout_s in (0, 3600], got ", batches, " and ", timeout_s);
  constexpr int kPerBatch = 64;
  struct alignas(64) Shared {
    std::atomic<int> ball{0};  // 1: the initiator's serve is in flight; 0: returned
    char pad[60];
    std::atomic<bool> give_up{false};
    std::atomic<int> pin_errors[2] = {0, 0};
  } shared;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  auto pin = [&](int cpu, int who) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (rc != 0) {
      shared.pin_errors[who] = rc;
      shared.give_up = true;
    }
    return rc == 0;
  };
  // Spins until `ball` reads `want`; false when the other side gave up or time ran out.
  auto await = [&](int want) {
    for (unsigned spins = 1;; ++spins) {
      if (shared.ball.load(std::memory_order_acquire) == want) return true;
      if ((spins & 4095) == 0 && (shared.give_up.load() || Clock::now() > deadline)) {
        shared.give_up = true;
        return false;
      }
    }
  };
  std::vector<double> ns(static_cast<size_t>(batches));
  auto respond = [&] {
    if (!pin(cpu_b, 1)) return;
    for (int i = 0; i < batches * kPerBatch; ++i) {
      if (!await(1)) return;
      shared.ball.store(0, std::memory_order_release);
    }
  };
  std::thread responder;
  try {
    responder = std::thread(respond);
  } catch (const std::system_error& e) {
    throw DeviceError(std::string("the cache-line round trip could not start a thread: ") + e.what());
  }
  std::thread initiator;
  try {
    initiator = std::thread([&] {
      if (!pin(cpu_a, 0)) return;
      for (int b = 0; b < batches; ++b) {
        const auto t0 = Clock::now();
        for (int i = 0; i < kPerBatch; ++i) {
          shared.ball.store(1, std::memory_order_release);
          if (!await(0)) return;
        }
        const auto t1 = Clock::now();
        ns[static_cast<size_t>(b)] = std::chrono::duration<double, std::nano>(t1 - t0).count() / kPerBatch;
        if (t1 > deadline) {  // round trips too quick for await's own check: the deadline holds anyway
          shared.give_up = true;
          return;
        }
      }
    });
  } catch (const std::system_error& e) {  // no second thread: release the first, never terminate
    shared.give_up = true;
    responder.join();
    throw DeviceError(std::string("the cache-line round trip could not start a thread: ") + e.what());
  }
  initiator.join();
  responder.join();
  for (int who = 0; who < 2; ++who)
    MGPU_CHECK(shared.pin_errors[who] == 0, ConfigError, "cannot run a thread on CPU ", who == 0 ? cpu_a : cpu_b, ": ",
               std::strerror(shared.pin_errors[who]));
  MGPU_CHECK(!shared.give_up, DeviceError, "the cache-line round trip between CPUs ", cpu_a, " and ", cpu_b,
             " did not finish within ", timeout_s, " s (a CPU busy with a higher-priority task?)");
  std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
  return ns[ns.size() / 2];
}

}  // namespace mgpu
