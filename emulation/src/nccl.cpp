// NCCL stand-in of the GPU emulation (NVIDIA's prototypes from nccl.h):
// allreduce, broadcast and reduce between processes over MPI
// (ncclCommInitRank), between threads of one process through shared memory
// (ncclCommInitAll). Each NCCL group becomes one operation on its stream, like
// the kernel NCCL would launch.
// Stricter than NCCL: before moving any data, the ranks compare what they
// issued (collective, type, op, count, root and the group it belongs to); a
// mismatch, which real NCCL turns into a hang or wrong sums, is an
// asynchronous ncclInvalidUsage naming the ranks and their calls. Results are
// identical on every rank (reduced once, in a fixed order, then shared; a
// reduce's root gets bit-for-bit what an allreduce would give).
// ncclCommAbort ends a collective that waits for a peer; a rank can be made
// to hang or fail at its Nth group (MGPU_EMULATE_NCCL_FAULT=rank:group:hang|error)
// to exercise watchdogs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "mgpu_emu/runtime.h"

namespace {

struct Call {
  enum Kind { kAllReduce, kBroadcast, kReduce } kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
  cudaStream_t stream;
  // Every rank reads its send buffer but a broadcast's non-roots; every rank
  // writes its recv buffer but a reduce's non-roots (NCCL ignores theirs).
  bool reads(int rank) const { return kind != kBroadcast || rank == root; }
  bool writes(int rank) const { return kind != kReduce || rank == root; }
};

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}
const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return "int8";
    case ncclUint8: return "uint8";
    case ncclFloat16: return "float16";
    case ncclBfloat16: return "bfloat16";
    case ncclInt32: return "int32";
    case ncclUint32: return "uint32";
    case ncclFloat32: return "float32";
    case ncclInt64: return "int64";
    case ncclUint64: return "uint64";
    case ncclFloat64: return "float64";
    default: return "?";
  }
}
const char* op_name(ncclRedOp_t o) {
  switch (o) {
    case ncclSum: return "sum";
    case ncclProd: return "prod";
    case ncclMax: return "max";
    case ncclMin: return "min";
    case ncclAvg: return "avg";
    default: return "?";
  }
}

std::string describe(const std::vector<Call>& calls) {
  std::ostringstream o;
  o << "group of " << calls.size() << ": [";
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    if (i) o << ", ";
    if (c.kind == Call::kAllReduce)
      o << "allreduce " << type_name(c.type) << " " << op_name(c.op) << " x" << c.count;
    else if (c.kind == Call::kReduce)
      o << "reduce " << type_name(c.type) << " " << op_name(c.op) << " root " << c.root << " x" << c.count;
    else
      o << "broadcast " << type_name(c.type) << " root " << c.root << " x" << c.count;
  }
  o << "]";
  return o.str();
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Threads of one process that form a communicator (ncclCommInitAll).
struct Clique {
  explicit Clique(int n) : size(n), posted(size_t(n)), descs(size_t(n)) {}
  int size;
  std::mutex m;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<const std::vector<Call>*> posted;
  std::vector<std::string> descs;
  std::atomic<bool> aborted{false};
  std::vector<int> devices;  // rank i drives devices[i]
};

// MGPU_EMULATE_NCCL_FAULT=RANK:GROUP:KIND, KIND hang or error: rank RANK's
// GROUP-th group (1-based) of each communicator hangs until aborted, or fails;
// GROUP "init": its communicator's initialisation does (ncclCommInitRank*).
struct Fault {
  int rank = -1;
  uint64_t group = 0;  // 0 with init
  bool init = false;
  std::string kind;
};

Fault read_fault() {
  Fault f;
  const char* env = std::getenv("MGPU_EMULATE_NCCL_FAULT");
  if (!env || !*env) return f;
  int rank = -1;
  char group[24] = {}, kind[16] = {};
  if (std::sscanf(env, "%d:%23[^:]:%15s", &rank, group, kind) == 3) {
    f.rank = rank;
    f.init = std::string(group) == "init";
    f.group = f.init ? 0 : std::strtoull(group, nullptr, 10);
    f.kind = kind;
  }
  return f;
}

}  // namespace

struct ncclComm {
  int rank = 0, nranks = 1, device = 0;
  bool blocking = true;
  MPI_Comm mpi = MPI_COMM_NULL;
  std::vector<int> world_of;  // NCCL rank -> rank in `mpi`
  MPI_Request init_req = MPI_REQUEST_NULL;
  int init_stage = 0;  // 0 dup pending, 1 table pending, 2 ready, 3 never (injected hang)
  std::vector<long long> init_table;
  long long init_mine[2] = {0, 0};
  std::shared_ptr<Clique> clique;
  std::atomic<bool> aborted{false};
  std::atomic<int> async_error{ncclSuccess};
  std::mutex m;
  std::string last_error;
  uint64_t groups = 0;  // launched so far (host side)
  Fault fault;

  void fail(ncclResult_t code, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(m);
      if (last_error.empty()) last_error = what;
    }
    int expected = ncclSuccess;
    async_error.compare_exchange_strong(expected, int(code));
  }
};

namespace {

std::mutex g_m;
std::string g_last_error;  // of calls without a communicator
thread_local int tl_group_depth = 0;
thread_local std::vector<std::pair<std::shared_ptr<ncclComm>, Call>> tl_pending;
std::map<const ncclComm*, std::shared_ptr<ncclComm>> g_owned;

ncclResult_t fail_call(ncclComm* comm, ncclResult_t code, const std::string& what) {
  if (comm) {
    std::lock_guard<std::mutex> lock(comm->m);
    comm->last_error = what;
  } else {
    std::lock_guard<std::mutex> lock(g_m);
    g_last_error = what;
  }
  return code;
}

std::shared_ptr<ncclComm> lookup(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_m);
  auto it = g_owned.find(comm);
  return it == g_owned.end() ? nullptr : it->second;
}

using Clock = std::chrono::steady_clock;

// Waits on an MPI request, polling so an abort (or an injected hang) can end it.
bool mpi_wait(ncclComm& c, MPI_Request* req) {
  for (unsigned polls = 0;; ++polls) {
    if (c.aborted) return false;
    int done = 0;
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// A barrier of the clique's threads; returns false when this rank's comm is
// aborted. Once a peer aborted, the clique's collectives never complete, as
// on a GPU, where the others' kernels wait until their own comms are aborted.
bool clique_barrier(ncclComm& c, Clique& q) {
  std::unique_lock<std::mutex> lock(q.m);
  auto stuck = [&] {
    while (!c.aborted) q.cv.wait_for(lock, std::chrono::milliseconds(5));
    return false;
  };
  if (q.aborted) return stuck();
  const uint64_t gen = q.generation;
  if (++q.arrived == q.size) {
    q.arrived = 0;
    ++q.generation;
    q.cv.notify_all();
    return true;
  }
  while (q.generation == gen) {
    if (c.aborted) return false;
    if (q.aborted) return stuck();
    q.cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  return true;
}

// Element-wise reduction of `n` values of type t: acc op= x.
void reduce_into(std::vector<double>& acc, const void* x, size_t n, ncclDataType_t t, ncclRedOp_t op, bool first) {
  for (size_t i = 0; i < n; ++i) {
    double v;
    switch (t) {
      case ncclFloat32: v = static_cast<const float*>(x)[i]; break;
      case ncclFloat64: v = static_cast<const double*>(x)[i]; break;
      case ncclFloat16: v = __half2float(static_cast<const __half*>(x)[i]); break;
      case ncclBfloat16: v = __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]); break;
      case ncclInt32: v = static_cast<const int32_t*>(x)[i]; break;
      case ncclInt64: v = double(static_cast<const int64_t*>(x)[i]); break;
      default: v = 0; break;
    }
    if (first) {
      acc[i] = v;
      continue;
    }
    switch (op) {
      case ncclSum:
      case ncclAvg: acc[i] += v; break;
      case ncclProd: acc[i] *= v; break;
      case ncclMax: acc[i] = std::max(acc[i], v); break;
      case ncclMin: acc[i] = std::min(acc[i], v); break;
      default: break;
    }
  }
}

// The reduced values in the element type, rounded like one pass of NCCL's
// kernel: float32 sums are accumulated in float, in rank order.
void store(void* out, const std::vector<double>& acc, size_t n, ncclDataType_t t) {
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case ncclFloat32: static_cast<float*>(out)[i] = float(acc[i]); break;
      case ncclFloat64: static_cast<double*>(out)[i] = acc[i]; break;
      case ncclFloat16: static_cast<__half*>(out)[i] = __float2half_rn(float(acc[i])); break;
      case ncclBfloat16: static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(float(acc[i])); break;
      case ncclInt32: static_cast<int32_t*>(out)[i] = int32_t(acc[i]); break;
      case ncclInt64: static_cast<int64_t*>(out)[i] = int64_t(acc[i]); break;
      default: break;
    }
  }
}

// float32 sums in float arithmetic, in rank order (what a ring of one pass does).
void sum_float_in_order(float* out, const std::vector<const float*>& ins, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float s = ins[0][i];
    for (size_t r = 1; r < ins.size(); ++r) s += ins[r][i];
    out[i] = s;
  }
}

// The reduction of one allreduce or reduce into `out`, input(r) being NCCL
// rank r's send buffer: every path (threads, processes) computes it here, so
// a reduce gives bit-identical values to an allreduce of the same inputs.
void reduce_in_rank_order(void* out, const Call& k, int nranks, const std::function<const void*(int)>& input) {
  if (k.type == ncclFloat32 && k.op == ncclSum) {
    std::vector<const float*> ins;
    for (int r = 0; r < nranks; ++r) ins.push_back(static_cast<const float*>(input(r)));
    sum_float_in_order(static_cast<float*>(out), ins, k.count);
    return;
  }
  std::vector<double> acc(k.count);
  for (int r = 0; r < nranks; ++r) reduce_into(acc, input(r), k.count, k.type, k.op, r == 0);
  if (k.op == ncclAvg)
    for (double& v : acc) v /= nranks;
  store(out, acc, k.count, k.type);
}

// Runs one group of this rank (on the stream's worker thread).
void run_group(const std::shared_ptr<ncclComm>& cp, const std::vector<Call>& calls, uint64_t group) {
  ncclComm& c = *cp;
  if (c.aborted || c.async_error != ncclSuccess) return;
  for (const Call& k : calls) {
    const size_t bytes = k.count * type_size(k.type);
    if (k.reads(c.rank)) mgpu_emu::touch(k.send, bytes, false, false);
    if (k.writes(c.rank)) mgpu_emu::touch(k.recv, bytes, true, false);
  }
  const std::string desc = describe(calls);
  if (c.fault.rank == c.rank && c.fault.group == group) {
    if (c.fault.kind == "hang") {
      while (!c.aborted) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    c.fail(ncclSystemError, "injected failure (MGPU_EMULATE_NCCL_FAULT) at group " + std::to_string(group) +
                                " on rank " + std::to_string(c.rank));
    return;
  }
  mgpu_emu::counters().collectives += calls.size();
  auto mismatch = [&](const std::vector<std::string>& all) {
    std::ostringstream o;
    o << "NCCL calls differ between ranks at group #" << group << " (real NCCL would hang or sum wrongly):";
    for (size_t r = 0; r < all.size(); ++r) o << " rank " << r << " issued " << all[r] << ";";
    const std::string what = o.str();
    mgpu_emu::report_violation(-1, cudaErrorLaunchFailure, what);
    c.fail(ncclInvalidUsage, what);
  };
  if (c.clique) {
    Clique& q = *c.clique;
    {
      std::lock_guard<std::mutex> lock(q.m);
      q.posted[size_t(c.rank)] = &calls;
      q.descs[size_t(c.rank)] = desc;
    }
    if (!clique_barrier(c, q)) return;
    std::vector<std::string> all;
    {
      std::lock_guard<std::mutex> lock(q.m);
      all = q.descs;
    }
    for (const std::string& d : all)
      if (d != desc) {
        mismatch(all);
        clique_barrier(c, q);
        return;
      }
    std::vector<std::vector<char>> results(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      const Call& k = calls[i];
      if (!k.writes(c.rank)) continue;  // a reduce's non-root: nothing to compute
      const size_t bytes = k.count * type_size(k.type);
      results[i].resize(bytes);
      if (k.kind == Call::kBroadcast) {
        std::memcpy(results[i].data(), q.posted[size_t(k.root)]->at(i).send, bytes);
        continue;
      }
      reduce_in_rank_order(results[i].data(), k, q.size, [&](int r) { return q.posted[size_t(r)]->at(i).send; });
    }
    if (!clique_barrier(c, q)) return;  // nobody reads inputs any more
    for (size_t i = 0; i < calls.size(); ++i)
      if (calls[i].writes(c.rank)) std::memcpy(calls[i].recv, results[i].data(), results[i].size());
    return;
  }
  if (c.nranks == 1) {
    for (const Call& k : calls)
      if (k.send != k.recv) std::memmove(k.recv, k.send, k.count * type_size(k.type));
    return;
  }
  // Between processes: compare fingerprints, then reduce on NCCL rank 0 and share.
  unsigned long long mine[2] = {(unsigned long long)group, (unsigned long long)fnv1a(desc)};
  std::vector<unsigned long long> prints(size_t(2 * c.nranks));
  MPI_Request req;
  MPI_Iallgather(mine, 2, MPI_UNSIGNED_LONG_LONG, prints.data(), 2, MPI_UNSIGNED_LONG_LONG, c.mpi, &req);
  if (!mpi_wait(c, &req)) return;
  bool same = true;
  for (int r = 0; r < c.nranks; ++r)
    same = same && prints[size_t(2 * r)] == mine[0] && prints[size_t(2 * r + 1)] == mine[1];
  if (!same) {
    int len = int(desc.size());
    std::vector<int> lens(size_t(c.nranks)), offs(size_t(c.nranks));
    MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, c.mpi, &req);
    if (!mpi_wait(c, &req)) return;
    int total = 0;
    for (int r = 0; r < c.nranks; ++r) {
      offs[size_t(r)] = total;
      total += lens[size_t(r)];
    }
    std::vector<char> text(size_t(total) + 1);
    MPI_Iallgatherv(desc.data(), len, MPI_CHAR, text.data(), lens.data(), offs.data(), MPI_CHAR, c.mpi, &req);
    if (!mpi_wait(c, &req)) return;
    std::vector<std::string> all(size_t(c.nranks));
    for (int w = 0; w < c.nranks; ++w) {
      // Report by NCCL rank.
      for (int r = 0; r < c.nranks; ++r)
        if (c.world_of[size_t(r)] == w)
          all[size_t(r)] = std::string(text.data() + offs[size_t(w)], size_t(lens[size_t(w)]));
    }
    mismatch(all);
    return;
  }
  for (const Call& k : calls) {
    const size_t bytes = k.count * type_size(k.type);
    if (k.kind == Call::kBroadcast) {
      if (k.send != k.recv && c.rank == k.root) std::memmove(k.recv, k.send, bytes);
      MPI_Ibcast(k.recv, int(bytes), MPI_BYTE, c.world_of[size_t(k.root)], c.mpi, &req);
      if (!mpi_wait(c, &req)) return;
      continue;
    }
    // Gather every rank's input on one NCCL rank (0 for an allreduce, a reduce's
    // root), reduce in rank order there; an allreduce then broadcasts the result.
    const int reducer = k.kind == Call::kReduce ? k.root : 0;
    const int root = c.world_of[size_t(reducer)];
    std::vector<char> all(c.rank == reducer ? bytes * size_t(c.nranks) : 0);
    std::vector<char> mine_copy(static_cast<const char*>(k.send), static_cast<const char*>(k.send) + bytes);
    MPI_Igather(mine_copy.data(), int(bytes), MPI_BYTE, all.data(), int(bytes), MPI_BYTE, root, c.mpi, &req);
    if (!mpi_wait(c, &req)) return;
    if (c.rank == reducer)  // `all` is in MPI rank order; reduce in NCCL rank order.
      reduce_in_rank_order(k.recv, k, c.nranks,
                           [&](int r) { return all.data() + size_t(c.world_of[size_t(r)]) * bytes; });
    if (k.kind == Call::kReduce) continue;  // the non-roots' recv is not written
    MPI_Ibcast(k.recv, int(bytes), MPI_BYTE, root, c.mpi, &req);
    if (!mpi_wait(c, &req)) return;
  }
}

// Progresses a non-blocking MPI initialisation; returns ncclInProgress until ready.
ncclResult_t progress_init(ncclComm& c) {
  if (c.init_stage == 3) return c.aborted ? ncclInvalidUsage : ncclInProgress;  // an injected hang
  if (c.init_stage == 2 || c.nranks == 1 || c.clique) return ncclSuccess;
  if (c.aborted) return ncclInvalidUsage;
  int done = 0;
  MPI_Test(&c.init_req, &done, MPI_STATUS_IGNORE);
  if (!done) return ncclInProgress;
  if (c.init_stage == 0) {
    int world_rank = 0;
    MPI_Comm_rank(c.mpi, &world_rank);
    c.init_table.assign(size_t(2 * c.nranks), 0);
    MPI_Iallgather(c.init_mine, 2, MPI_LONG_LONG, c.init_table.data(), 2, MPI_LONG_LONG, c.mpi, &c.init_req);
    c.init_stage = 1;
    return progress_init(c);
  }
  c.world_of.assign(size_t(c.nranks), -1);
  for (int w = 0; w < c.nranks; ++w) {
    const long long r = c.init_table[size_t(2 * w)], id = c.init_table[size_t(2 * w + 1)];
    if (id != c.init_mine[1]) {
      c.fail(ncclInvalidUsage, "ncclCommInitRank: MPI rank " + std::to_string(w) + " passed another unique id");
      return ncclInvalidUsage;
    }
    if (r < 0 || r >= c.nranks || c.world_of[size_t(r)] != -1) {
      c.fail(ncclInvalidUsage, "ncclCommInitRank: NCCL rank " + std::to_string(r) + " claimed twice or out of range");
      return ncclInvalidUsage;
    }
    c.world_of[size_t(r)] = w;
  }
  c.init_stage = 2;
  return ncclSuccess;
}

std::shared_ptr<ncclComm> register_comm(std::shared_ptr<ncclComm> c) {
  std::lock_guard<std::mutex> lock(g_m);
  g_owned[c.get()] = c;
  return c;
}

ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking) {
  if (!out) return fail_call(nullptr, ncclInvalidArgument, "ncclCommInitRank: null comm pointer");
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail_call(nullptr, ncclInvalidArgument,
                     "ncclCommInitRank: rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  if (std::memcmp(id.internal, "mgpu-emu-nccl", 13) != 0)
    return fail_call(nullptr, ncclInvalidArgument,
                     "ncclCommInitRank: not a unique id of the NCCL emulation's ncclGetUniqueId");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fail_call(nullptr, ncclUnhandledCudaError, "ncclCommInitRank: no emulated GPU (cudaGetDevice failed)");
  }
  auto c = std::make_shared<ncclComm>();
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  c->blocking = blocking;
  c->fault = read_fault();
  if (c->fault.init && c->fault.rank == rank) {
    if (c->fault.kind == "error")
      return fail_call(nullptr, ncclSystemError,
                       "ncclCommInitRank: injected failure (MGPU_EMULATE_NCCL_FAULT) on rank " + std::to_string(rank));
    // hang: the others wait for this rank in vain; it never finishes either
    c->init_stage = 3;
    if (blocking)
      while (true) std::this_thread::sleep_for(std::chrono::seconds(1));  // as NCCL's blocking init would
    register_comm(c);
    *out = c.get();
    return ncclInProgress;
  }
  if (nranks > 1) {
    int initialised = 0, level = 0, world = 0;
    MPI_Initialized(&initialised);
    if (!initialised)
      return fail_call(nullptr, ncclInvalidUsage,
                       "the NCCL emulation connects processes through MPI, which is not initialised");
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
      return fail_call(nullptr, ncclInvalidUsage,
                       "the NCCL emulation needs MPI_THREAD_MULTIPLE (its collectives run on stream threads)");
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != nranks)
      return fail_call(nullptr, ncclInvalidUsage,
                       "the NCCL emulation spans MPI_COMM_WORLD (" + std::to_string(world) + " processes); asked for " +
                           std::to_string(nranks) + " ranks");
    long long id_hash = 0;
    std::memcpy(&id_hash, id.internal + 16, sizeof(id_hash));
    c->init_mine[0] = rank;
    c->init_mine[1] = id_hash;
    // Ordered with the caller's other collectives on MPI_COMM_WORLD; completes asynchronously.
    MPI_Comm_idup(MPI_COMM_WORLD, &c->mpi, &c->init_req);
    if (blocking) {
      while (progress_init(*c) == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (c->async_error != ncclSuccess) return fail_call(nullptr, ncclInvalidUsage, c->last_error);
    }
  } else {
    c->init_stage = 2;
  }
  register_comm(c);
  *out = c.get();
  return blocking ? ncclSuccess : ncclInProgress;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  thread_local std::string copy;
  if (comm) {
    auto c = lookup(comm);
    if (c) {
      std::lock_guard<std::mutex> lock(c->m);
      copy = c->last_error;
      return copy.c_str();
    }
  }
  std::lock_guard<std::mutex> lock(g_m);
  copy = g_last_error;
  return copy.c_str();
}

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, "mgpu-emu-nccl", 13);
  std::random_device rd;
  const long long token =
      (static_cast<long long>(rd()) << 32) ^ rd() ^ static_cast<long long>(Clock::now().time_since_epoch().count());
  std::memcpy(id->internal + 16, &token, sizeof(token));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return init_rank(comm, nranks, id, rank, true);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  const bool blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  return init_rank(comm, nranks, id, rank, blocking);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1) return fail_call(nullptr, ncclInvalidArgument, "ncclCommInitAll: no devices");
  std::vector<int> devices(static_cast<size_t>(ndev));
  for (int i = 0; i < ndev; ++i) devices[size_t(i)] = devlist ? devlist[i] : i;
  for (int i = 0; i < ndev; ++i) {
    if (!mgpu_emu::device_valid(devices[size_t(i)]))
      return fail_call(nullptr, ncclInvalidArgument,
                       "ncclCommInitAll: device " + std::to_string(devices[size_t(i)]) + " does not exist");
    for (int j = 0; j < i; ++j)
      if (devices[size_t(j)] == devices[size_t(i)])  // as NCCL 2.28: no duplicate devices
        return fail_call(nullptr, ncclInvalidUsage,
                         "ncclCommInitAll: duplicate device " + std::to_string(devices[size_t(i)]));
  }
  auto clique = std::make_shared<Clique>(ndev);
  clique->devices = devices;
  const Fault fault = read_fault();
  for (int i = 0; i < ndev; ++i) {
    auto c = std::make_shared<ncclComm>();
    c->rank = i;
    c->nranks = ndev;
    c->device = devices[size_t(i)];
    c->clique = clique;
    c->init_stage = 2;
    c->fault = fault;
    register_comm(c);
    comms[i] = c.get();
  }
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  auto c = lookup(comm);
  if (!c || !asyncError) return ncclInvalidArgument;
  const ncclResult_t init = progress_init(*c);
  if (init == ncclInProgress && c->async_error == ncclSuccess) {
    *asyncError = ncclInProgress;
    return ncclSuccess;
  }
  *asyncError = ncclResult_t(c->async_error.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  auto c = lookup(comm);
  if (!c || !count) return ncclInvalidArgument;
  *count = c->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  auto c = lookup(comm);
  if (!c || !rank) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  auto c = lookup(comm);
  if (!c || !device) return ncclInvalidArgument;
  *device = c->device;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return lookup(comm) ? ncclSuccess : ncclInvalidArgument; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::shared_ptr<ncclComm> c;
  {
    std::lock_guard<std::mutex> lock(g_m);
    auto it = g_owned.find(comm);
    if (it == g_owned.end()) return ncclInvalidArgument;
    c = it->second;
    g_owned.erase(it);
  }
  // Operations still queued keep their shared reference; the MPI communicator is
  // released with the last of them only when no collective can be pending on it.
  if (c->mpi != MPI_COMM_NULL && c->init_stage == 2 && !c->aborted && c.use_count() == 1) MPI_Comm_free(&c->mpi);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::shared_ptr<ncclComm> c;
  {
    std::lock_guard<std::mutex> lock(g_m);
    auto it = g_owned.find(comm);
    if (it == g_owned.end()) return ncclSuccess;  // NULL or already gone: nothing to do
    c = it->second;
    g_owned.erase(it);
  }
  c->aborted = true;
  if (c->clique) c->clique->aborted = true;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++tl_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (tl_group_depth <= 0) return fail_call(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--tl_group_depth > 0) return ncclSuccess;
  auto pending = std::move(tl_pending);
  tl_pending.clear();
  // One operation per communicator, on its stream, holding that communicator's calls in order.
  std::vector<std::shared_ptr<ncclComm>> order;
  for (const auto& p : pending)
    if (std::find(order.begin(), order.end(), p.first) == order.end()) order.push_back(p.first);
  ncclResult_t result = ncclSuccess;
  for (const auto& c : order) {
    std::vector<Call> calls;
    for (const auto& p : pending)
      if (p.first == c) calls.push_back(p.second);
    const cudaStream_t stream = calls.front().stream;
    for (const Call& k : calls)
      if (k.stream != stream)
        return fail_call(c.get(), ncclInvalidUsage,
                         "the NCCL emulation runs one group of a communicator on one stream");
    const uint64_t group = ++c->groups;
    // Counted only when it runs once, now (not recorded into a graph capture).
    const bool in_process = c->clique != nullptr && !mgpu_emu::stream_is_capturing(stream);
    if (in_process) mgpu_emu::in_process_collective_queued();
    const cudaError_t rc = mgpu_emu::enqueue(stream, "nccl " + describe(calls), mgpu_emu::OpKind::kCollective,
                                             [c, calls, group, in_process] {
                                               struct Done {
                                                 bool on;
                                                 ~Done() {
                                                   if (on) mgpu_emu::in_process_collective_done();
                                                 }
                                               } done{in_process};
                                               run_group(c, calls, group);
                                             });
    if (rc != cudaSuccess) {
      if (in_process) mgpu_emu::in_process_collective_done();
      result = fail_call(c.get(), ncclUnhandledCudaError, std::string("enqueue failed: ") + cudaGetErrorString(rc));
    }
  }
  if (result == ncclSuccess)
    for (const auto& c : order)
      if (!c->blocking) return ncclInProgress;
  return result;
}

namespace {
ncclResult_t add_call(ncclComm_t comm, const Call& call, const char* name) {
  auto c = lookup(comm);
  if (!c) return fail_call(nullptr, ncclInvalidArgument, std::string(name) + ": invalid or destroyed communicator");
  if (c->aborted) return fail_call(c.get(), ncclInvalidUsage, std::string(name) + " on an aborted communicator");
  if (c->init_stage != 2 && progress_init(*c) != ncclSuccess)
    return fail_call(c.get(), ncclInvalidUsage, std::string(name) + " before the communicator finished initialising");
  if (type_size(call.type) == 0)
    return fail_call(c.get(), ncclInvalidArgument, std::string(name) + ": invalid data type");
  if (call.kind != Call::kAllReduce && (call.root < 0 || call.root >= c->nranks))
    return fail_call(c.get(), ncclInvalidArgument,
                     std::string(name) + ": root " + std::to_string(call.root) + " out of range");
  const size_t bytes = call.count * type_size(call.type);
  // As NCCL: device pointers of the communicator's GPU (checked here, not on a GPU).
  if (bytes > 0) {
    const bool reads = call.reads(c->rank), writes = call.writes(c->rank);
    std::string why = reads ? mgpu_emu::check_device_range(call.send, bytes, c->device, false) : "";
    if (why.empty() && writes) why = mgpu_emu::check_device_range(call.recv, bytes, c->device, false);
    if (!why.empty()) return fail_call(c.get(), ncclInvalidArgument, std::string(name) + ": " + why);
    if (c->clique)
      for (int peer : c->clique->devices) {
        if (peer == c->device) continue;
        if (reads) why = mgpu_emu::check_peer_access(call.send, bytes, peer);
        if (why.empty() && writes) why = mgpu_emu::check_peer_access(call.recv, bytes, peer);
        if (!why.empty()) {
          mgpu_emu::report_violation(c->device, cudaErrorIllegalAddress, std::string(name) + ": " + why);
          return fail_call(c.get(), ncclUnhandledCudaError, std::string(name) + ": " + why);
        }
      }
  }
  if (mgpu_emu::device_of(call.stream) != c->device)
    return fail_call(c.get(), ncclInvalidArgument,
                     std::string(name) + ": stream of another GPU than the communicator's");
  tl_pending.push_back({c, call});
  if (tl_group_depth == 0) {
    ++tl_group_depth;
    return ncclGroupEnd();
  }
  return ncclSuccess;
}
}  // namespace

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  if (int(op) < 0 || int(op) > int(ncclAvg))
    return fail_call(nullptr, ncclInvalidArgument, "ncclAllReduce: invalid op");
  return add_call(comm, {Call::kAllReduce, sendbuff, recvbuff, count, datatype, op, 0, stream}, "ncclAllReduce");
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  if (int(op) < 0 || int(op) > int(ncclAvg)) return fail_call(nullptr, ncclInvalidArgument, "ncclReduce: invalid op");
  return add_call(comm, {Call::kReduce, sendbuff, recvbuff, count, datatype, op, root, stream}, "ncclReduce");
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return add_call(comm, {Call::kBroadcast, sendbuff, recvbuff, count, datatype, ncclSum, root, stream},
                  "ncclBroadcast");
}

}  // extern "C"
