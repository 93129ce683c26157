// MPI communicator over a communicator handed over from mpi4py (duplicated, so
// our collectives never match a user's). Host memory only: the CPU backend's
// buffers, or host-staged GPU gradients.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <string>

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

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<MPI_Request> pending_;
};

// Version string of the MPI library linked at run time.
std::string mpi_library_version();

}  // namespace mgpu
