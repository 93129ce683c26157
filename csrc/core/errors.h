// Typed errors of the native core. Each maps to a Python exception in the
// bindings; nothing in the extension calls exit() or abort().
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace mgpu {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A bad argument, shape or setting supplied by the caller.
struct ConfigError : Error {
  using Error::Error;
};
// A device is missing, out of memory, or a kernel/library call failed.
struct DeviceError : Error {
  using Error::Error;
};
// A collective failed, timed out, or the communicator is unusable.
struct CommError : Error {
  using Error::Error;
};
// Training hit a non-finite loss or gradient.
struct NumericsError : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace mgpu

// MGPU_CHECK(cond, ErrorType, message parts...) throws ErrorType when cond is false.
#define MGPU_CHECK(cond, ErrorType, ...)                               \
  do {                                                                 \
    if (!(cond)) throw ErrorType(::mgpu::detail::concat(__VA_ARGS__)); \
  } while (0)
