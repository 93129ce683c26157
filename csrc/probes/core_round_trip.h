// A probe of where two CPUs sit relative to each other's caches, by two threads
// pinned to them (the only code of the core that places threads on CPUs).
#pragma once

namespace mgpu {

// Nanoseconds for a cache line to go from CPU cpu_a to cpu_b and back, the median
// of `batches` batches of 64 round trips: short between cores that share a
// last-level cache, several times longer across cache domains (chiplets,
// sockets). Two ranks' allreduce goes through that path, so where a hypervisor
// moves vCPUs between domains it tells which placement a multi-rank timing ran
// in. The caller's affinity is left alone. A CPU that cannot be used throws
// ConfigError; a partner that never answers (its CPU taken away) ends the probe
// at the deadline (timeout_s, in (0, 3600]) with DeviceError instead of hanging.
double core_round_trip_ns(int cpu_a, int cpu_b, int batches, double timeout_s);

}  // namespace mgpu
