#include "transport/mpi_session.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "kernels/error.h"

namespace strata {
namespace {

// Map MPI error classes to what a caller can do about them (docs/CONVENTIONS.md, "Errors").
ErrorKind kind_of_mpi_error(int error_class) {
  switch (error_class) {
    case MPI_ERR_NO_MEM:
      return ErrorKind::kOverloaded;
    case MPI_ERR_UNSUPPORTED_OPERATION:
      return ErrorKind::kUnimplemented;
    default:
      return ErrorKind::kFailed;  // truncation, bad arguments, internal errors
  }
}

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

ThreadLevel from_mpi_level(int level) {
  if (level >= MPI_THREAD_MULTIPLE) return ThreadLevel::kMultiple;
  if (level >= MPI_THREAD_SERIALIZED) return ThreadLevel::kSerialized;
  if (level >= MPI_THREAD_FUNNELED) return ThreadLevel::kFunneled;
  return ThreadLevel::kSingle;
}

int to_mpi_level(ThreadLevel level) {
  switch (level) {
    case ThreadLevel::kSingle:
      return MPI_THREAD_SINGLE;
    case ThreadLevel::kFunneled:
      return MPI_THREAD_FUNNELED;
    case ThreadLevel::kSerialized:
      return MPI_THREAD_SERIALIZED;
    case ThreadLevel::kMultiple:
      return MPI_THREAD_MULTIPLE;
  }
  return MPI_THREAD_SINGLE;
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "MPI";
  std::string s(text, static_cast<size_t>(len));
  return s.substr(0, s.find_first_of(",\n"));  // "Open MPI v4.1.4, package: ..." -> first part
}

}  // namespace

void check_mpi(int rc, std::string_view what) {
  if (rc == MPI_SUCCESS) [[likely]]
    return;
  int error_class = rc;
  MPI_Error_class(rc, &error_class);
  fail(kind_of_mpi_error(error_class), "{} failed: {}", what, mpi_error_string(rc));
}

const char* thread_level_name(ThreadLevel level) {
  switch (level) {
    case ThreadLevel::kSingle:
      return "MPI_THREAD_SINGLE";
    case ThreadLevel::kFunneled:
      return "MPI_THREAD_FUNNELED";
    case ThreadLevel::kSerialized:
      return "MPI_THREAD_SERIALIZED";
    case ThreadLevel::kMultiple:
      return "MPI_THREAD_MULTIPLE";
  }
  return "?";
}

// ---- requests ----

bool abandon_request(MPI_Request& request) noexcept {
  if (request == MPI_REQUEST_NULL) return true;
  MPI_Cancel(&request);
  // A cancelled receive completes at once; give a send a moment to acknowledge the cancel
  // so its buffer is released, then let MPI free the request whenever it completes.
  int done = 0;
  for (int i = 0; i < 1000 && !done; ++i) MPI_Test(&request, &done, MPI_STATUS_IGNORE);
  if (!done) MPI_Request_free(&request);
  request = MPI_REQUEST_NULL;
  return done != 0;
}

void wait_request(MPI_Request& request, MPI_Status* status, const Deadline& deadline,
                  const std::string& peer, std::string_view what) {
  int rc = MPI_SUCCESS;
  const bool done = poll_until(deadline, [&] {
    int flag = 0;
    rc = MPI_Test(&request, &flag, status);
    return flag != 0 || rc != MPI_SUCCESS;
  });
  if (rc != MPI_SUCCESS) {
    abandon_request(request);
    check_mpi(rc, fmt::format("{} with {}", what, peer));
  }
  if (!done) {
    abandon_request(request);
    fail_timeout(deadline, peer, std::string(what));
  }
}

// ---- Communicator ----

Communicator::Communicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

Communicator Communicator::borrow(MPI_Comm comm) {
  return Communicator(comm, false);
}

Communicator::Communicator(Communicator&& other) noexcept
    : comm_(std::exchange(other.comm_, MPI_COMM_NULL)),
      owned_(std::exchange(other.owned_, false)),
      rank_(std::exchange(other.rank_, -1)),
      size_(std::exchange(other.size_, 0)) {}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    release();
    comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
    owned_ = std::exchange(other.owned_, false);
    rank_ = std::exchange(other.rank_, -1);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Communicator::~Communicator() {
  release();
}

void Communicator::release() noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
  owned_ = false;
}

Communicator Communicator::dup(const Deadline& deadline) const {
  MPI_Comm copy = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Comm_idup(comm_, &copy, &request), "MPI_Comm_idup");
  wait_request(request, MPI_STATUS_IGNORE, deadline, "all ranks", "communicator duplication");
  return Communicator(copy, true);
}

void Communicator::barrier(const Deadline& deadline, std::string_view what) const {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
  wait_request(request, MPI_STATUS_IGNORE, deadline, "all ranks", what);
}

std::vector<int> Communicator::allgather(int value, const Deadline& deadline,
                                         std::string_view what) const {
  std::vector<int> all(static_cast<size_t>(size_));
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(&value, 1, MPI_INT, all.data(), 1, MPI_INT, comm_, &request),
            "MPI_Iallgather");
  wait_request(request, MPI_STATUS_IGNORE, deadline, "all ranks", what);
  return all;
}

void Communicator::broadcast(std::span<std::byte> bytes, int root, const Deadline& deadline,
                             std::string_view what) const {
  STRATA_CHECK(bytes.size() <= static_cast<size_t>(INT32_MAX), "{} bytes", bytes.size());
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Ibcast(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, root, comm_, &request),
      "MPI_Ibcast");
  wait_request(request, MPI_STATUS_IGNORE, deadline, fmt::format("rank {}", root), what);
}

std::string processor_name() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  check_mpi(MPI_Get_processor_name(name, &len), "MPI_Get_processor_name");
  return std::string(name, static_cast<size_t>(len));
}

int name_key(std::string_view text) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  const auto key = static_cast<int>(h & 0x7fffffffu);
  return key == 0 ? 1 : key;
}

std::vector<std::string> host_names(const Communicator& comm, const Deadline& deadline) {
  constexpr size_t kName = MPI_MAX_PROCESSOR_NAME;
  std::vector<char> mine(kName, 0), all(kName * static_cast<size_t>(comm.size()), 0);
  const std::string name = processor_name();
  std::copy_n(name.begin(), std::min(name.size(), kName - 1), mine.begin());
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(mine.data(), static_cast<int>(kName), MPI_CHAR, all.data(),
                           static_cast<int>(kName), MPI_CHAR, comm.native(), &request),
            "MPI_Iallgather");
  wait_request(request, MPI_STATUS_IGNORE, deadline, "all ranks", "the ranks' host names");
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r)
    out.emplace_back(all.data() + static_cast<size_t>(r) * kName);
  return out;
}

std::vector<std::string> allgather_text(const Communicator& comm, const std::string& text,
                                        const Deadline& deadline, std::string_view what) {
  constexpr size_t kMaxText = size_t{1} << 20;
  if (text.size() > kMaxText)
    fail(ErrorKind::kFailed, "{}: {} bytes, more than {} to gather", what, text.size(), kMaxText);
  const std::vector<int> sizes = comm.allgather(static_cast<int>(text.size()), deadline, what);
  std::vector<int> offsets(sizes.size(), 0);
  for (size_t r = 1; r < sizes.size(); ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  std::vector<char> all(static_cast<size_t>(offsets.back() + sizes.back()) + 1, 0);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgatherv(text.data(), static_cast<int>(text.size()), MPI_CHAR, all.data(),
                            sizes.data(), offsets.data(), MPI_CHAR, comm.native(), &request),
            "MPI_Iallgatherv");
  wait_request(request, MPI_STATUS_IGNORE, deadline, "all ranks", what);
  std::vector<std::string> out;
  for (size_t r = 0; r < sizes.size(); ++r)
    out.emplace_back(all.data() + offsets[r], static_cast<size_t>(sizes[r]));
  return out;
}

int host_local_index(const Communicator& comm, int first_rank, const Deadline& deadline) {
  const std::vector<int> hosts =
      comm.allgather(name_key(processor_name()), deadline, "the ranks' host names");
  const int me = comm.rank();
  if (me < first_rank) return -1;
  int index = 0;
  for (int r = std::max(first_rank, 0); r < me; ++r)
    index += hosts[static_cast<size_t>(r)] == hosts[static_cast<size_t>(me)] ? 1 : 0;
  return index;
}

// ---- MpiSession ----

MpiSession::MpiSession(int* argc, char*** argv, ThreadLevel required) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  if (initialized)
    fail(ErrorKind::kFailed, "MPI is already initialised: one MpiSession per process");
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Init_thread(argc, argv, to_mpi_level(required), &provided), "MPI_Init_thread");
  thread_level_ = from_mpi_level(provided);
  if (thread_level_ < required) {
    MPI_Finalize();
    fail(ErrorKind::kUnimplemented, "MPI offers {} but Strata needs {}",
         thread_level_name(thread_level_), thread_level_name(required));
  }
  world_ = Communicator::borrow(MPI_COMM_WORLD);
  hostname_ = processor_name();
  library_ = library_version();
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  world_ = Communicator();
  if (!finalized) MPI_Finalize();
}

std::string MpiSession::str() const {
  return fmt::format("rank {}/{} on {}, {}, {}", rank(), size(), hostname_,
                     thread_level_name(thread_level_), library_);
}

void MpiSession::abort(int code) const {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort should not return; if it does, do not run destructors
}

}  // namespace strata
