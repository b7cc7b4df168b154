// Errors: three kinds of failure, three mechanisms (docs/CONVENTIONS.md, "Errors").
//  - STRATA_CHECK: a bug or broken precondition; records file, line, expression, values.
//  - check_status-style helpers in each backend for foreign status codes (CUDA, BLAS, ...).
//  - InputError: bad input a user or request can reach; never a crash, always a message
//    that names the file / tensor / field / value at fault.
#pragma once

#include <fmt/format.h>

#include <new>
#include <stdexcept>
#include <string>

namespace strata {

// What the caller can do about a failure (Cap'n Proto's classification).
enum class ErrorKind {
  kFailed,         // give up: a bug, corrupt data, an impossible request
  kOverloaded,     // retry later: out of memory, queue full
  kDisconnected,   // reconnect: a peer, a server or a rank went away
  kUnimplemented,  // not built here: a feature or backend absent from this binary
  kInvalidInput,   // the input is wrong: fix it and try again
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Bad input from a user, a file or a request. The message is shown as is.
class InputError : public Error {
 public:
  explicit InputError(const std::string& what) : Error(ErrorKind::kInvalidInput, what) {}
};

template <typename... Args>
[[noreturn]] void fail_input(fmt::format_string<Args...> f, Args&&... args) {
  throw InputError(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(kind, fmt::format(f, std::forward<Args>(args)...));
}

// Runs `f`; running out of memory inside it (std::bad_alloc, or a backend's kOverloaded
// allocation failure) becomes Error(kOverloaded) saying what was being allocated:
// "out of memory while <what>: <the original message>".
template <typename F>
auto with_oom_context(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::kOverloaded, "out of memory while " + what);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kOverloaded) throw;
    throw Error(ErrorKind::kOverloaded, "out of memory while " + what + ": " + e.what());
  }
}

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* expr,
                               const std::string& detail);
}  // namespace detail

}  // namespace strata

// STRATA_CHECK(cond, "fmt", args...) -- the message says what the values were.
#define STRATA_CHECK(cond, ...)                                                            \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] {                                                            \
      ::strata::detail::check_failed(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
    }                                                                                      \
  } while (0)
