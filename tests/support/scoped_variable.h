// Sets (or, with nullptr, unsets) one environment variable for a test's length and puts
// back the value the caller read before (`old`; nullopt: it was unset).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace strata::testing {

class ScopedVariable {
 public:
  ScopedVariable(std::string name, const char* value, std::optional<std::string> old)
      : name_(std::move(name)), old_(std::move(old)) {
    set(value);
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;
  ~ScopedVariable() { set(old_ ? old_->c_str() : nullptr); }

 private:
  void set(const char* value) const {
    if (value != nullptr) {
      setenv(name_.c_str(), value, 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace strata::testing
