// MPI bootstrap: one RAII MpiSession per process (MPI_Init_thread .. MPI_Finalize) and
// Communicator, an RAII MPI_Comm. No singletons: main() owns the session and hands out
// references, so MPI is finalized after every communicator is freed (RAII for every
// handle: docs/CONVENTIONS.md, "Structure").
// Every MPI status code goes through check_mpi, which throws strata::Error with the MPI
// error string and a kind the caller can act on (docs/CONVENTIONS.md, "Errors").
#pragma once

#include <mpi.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "transport/deadline.h"

namespace strata {

// Throws Error naming `what` and MPI's own message when rc is not MPI_SUCCESS.
void check_mpi(int rc, std::string_view what);

enum class ThreadLevel { kSingle, kFunneled, kSerialized, kMultiple };
const char* thread_level_name(ThreadLevel level);

class Communicator {
 public:
  Communicator() = default;  // MPI_COMM_NULL
  // Wraps comm without owning it (MPI_COMM_WORLD); sets MPI_ERRORS_RETURN on it so failures
  // come back as status codes instead of aborting the job.
  static Communicator borrow(MPI_Comm comm);

  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator();

  // A private copy (own message space) of this communicator; collective, with a deadline.
  Communicator dup(const Deadline& deadline) const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_; }
  bool valid() const { return comm_ != MPI_COMM_NULL; }

  // Collectives, each nonblocking underneath and polled to the deadline; `what` names the
  // step in the timeout message.
  void barrier(const Deadline& deadline, std::string_view what) const;
  std::vector<int> allgather(int value, const Deadline& deadline, std::string_view what) const;
  void broadcast(std::span<std::byte> bytes, int root, const Deadline& deadline,
                 std::string_view what) const;

 private:
  Communicator(MPI_Comm comm, bool owned);
  void release() noexcept;

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = -1;
  int size_ = 0;
};

// Polls an MPI request to completion or the deadline. On timeout the request is cancelled
// and freed, and Error(kDisconnected) names `peer` and `what`.
void wait_request(MPI_Request& request, MPI_Status* status, const Deadline& deadline,
                  const std::string& peer, std::string_view what);
// Cancels and frees a pending request (timeouts, destructors); never throws. True when MPI
// confirmed the request is over, so its buffer may be freed; false when MPI may still use it.
bool abandon_request(MPI_Request& request) noexcept;

// A non-zero 31-bit digest of a name (a host name, a GPU's host and bus id) that ranks can
// compare after an allgather of ints.
int name_key(std::string_view text);

// This process's host name as MPI reports it.
std::string processor_name();

// Every rank's `text`, in rank order (each up to 1 MiB). Collective over comm.
std::vector<std::string> allgather_text(const Communicator& comm, const std::string& text,
                                        const Deadline& deadline, std::string_view what);

// Every rank's host name (processor_name), in rank order. Collective over comm.
std::vector<std::string> host_names(const Communicator& comm, const Deadline& deadline);

// This rank's index among the ranks >= first_rank that run on the same host (-1 below
// first_rank): the GPU `--device auto` gives a cluster worker. Collective over comm.
int host_local_index(const Communicator& comm, int first_rank, const Deadline& deadline);

class MpiSession {
 public:
  // MPI_Init_thread asking for `required`; throws kUnimplemented when MPI offers less and
  // kFailed when MPI is already initialised in this process (one session per process).
  MpiSession(int* argc, char*** argv, ThreadLevel required = ThreadLevel::kMultiple);
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession();

  const Communicator& world() const { return world_; }
  int rank() const { return world_.rank(); }
  int size() const { return world_.size(); }
  const std::string& hostname() const { return hostname_; }
  ThreadLevel thread_level() const { return thread_level_; }
  std::string str() const;  // "rank 1/3 on node7, MPI_THREAD_MULTIPLE, Open MPI v4.1.4"

  // Ends the whole job (every rank) with `code`: for a main() that cannot go on.
  [[noreturn]] void abort(int code) const;

 private:
  ThreadLevel thread_level_ = ThreadLevel::kSingle;
  std::string hostname_;
  std::string library_;
  Communicator world_;
};

}  // namespace strata
