#include "kernels/error.h"

namespace strata {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kFailed:
      return "failed";
    case ErrorKind::kOverloaded:
      return "overloaded";
    case ErrorKind::kDisconnected:
      return "disconnected";
    case ErrorKind::kUnimplemented:
      return "unimplemented";
    case ErrorKind::kInvalidInput:
      return "invalid input";
  }
  return "unknown";
}

namespace detail {
void check_failed(const char* file, int line, const char* expr, const std::string& detail) {
  throw Error(ErrorKind::kFailed, fmt::format("{}:{}: check failed: {}{}{}", file, line, expr,
                                              detail.empty() ? "" : ": ", detail));
}
}  // namespace detail

}  // namespace strata
