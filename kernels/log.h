// Logging: one named spdlog logger per folder ("kernels", "worker", ...), every line
// prefixed with host, pid, rank and device so multi-rank logs can be merged and filtered.
// Level from STRATA_LOG_LEVEL (trace, debug, info, warn, error, off); default info.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>
#include <string_view>

namespace strata::log {

// Sets the rank and device shown in every line (call once per process, before logging).
void set_identity(int rank, const std::string& device);

// The logger of one folder; created on first use, all write to stderr.
std::shared_ptr<spdlog::logger> get(const std::string& subsystem);

// `text` with every byte outside printable ASCII (and the backslash) as \xHH: what a client
// or producer sent (a request id, a request line), safe to put in a log line.
std::string printable(std::string_view text);

}  // namespace strata::log
