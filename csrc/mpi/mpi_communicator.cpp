// MPI communicator implementation (see mpi_communicator.h).
#include "mpi_communicator.h"

#include <algorithm>
#include <climits>
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
  // Errors come back as return codes (and then exceptions) instead of aborting.
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) {
    if (!pending_.empty()) MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE);
    MPI_Comm_free(&comm_);
  }
}

void MpiCommunicator::allreduce_sum(float* data, size_t count) {
  for (size_t done = 0; done < count; done += kMaxChunk) {
    const int n = static_cast<int>(std::min(kMaxChunk, count - done));
    check(MPI_Allreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_), "MPI_Allreduce");
  }
}

void MpiCommunicator::broadcast(float* data, size_t count, int root) {
  MGPU_CHECK(root >= 0 && root < size_, CommError, "broadcast root ", root, " outside [0, ", size_, ")");
  for (size_t done = 0; done < count; done += kMaxChunk) {
    const int n = static_cast<int>(std::min(kMaxChunk, count - done));
    check(MPI_Bcast(data + done, n, MPI_FLOAT, root, comm_), "MPI_Bcast");
  }
}

void MpiCommunicator::barrier() { check(MPI_Barrier(comm_), "MPI_Barrier"); }

void MpiCommunicator::allreduce_sum_async(float* data, size_t count) {
  for (size_t done = 0; done < count; done += kMaxChunk) {
    const int n = static_cast<int>(std::min(kMaxChunk, count - done));
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data + done, n, MPI_FLOAT, MPI_SUM, comm_, &req),
          "MPI_Iallreduce");
    pending_.push_back(req);
  }
}

void MpiCommunicator::progress() {
  if (pending_.empty()) return;
  int flag = 0;
  // Testing drives OpenMPI's progress engine for the outstanding collectives.
  check(MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &flag, MPI_STATUSES_IGNORE),
        "MPI_Testall");
  if (flag) pending_.clear();
}

void MpiCommunicator::wait_all() {
  if (pending_.empty()) return;
  const int rc = MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE);
  pending_.clear();
  check(rc, "MPI_Waitall");
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
