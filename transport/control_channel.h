// Control messages over MPI: one encoded ControlMessage per MPI message on its own tag, so
// the MPI envelope frames it (the receiver probes, reads the byte count, then receives
// exactly that many bytes). Every wait has a deadline; a timeout throws
// Error(kDisconnected) naming the rank and what was awaited.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

#include "transport/messages.h"
#include "transport/mpi_session.h"

namespace strata {

inline constexpr int kControlTag = 0x5c01;
inline constexpr int kAnySource = MPI_ANY_SOURCE;

struct Received {
  int source = -1;
  ControlMessage message;
};

// One user thread per channel (the coordinator's loop, a worker's loop); channels on
// different tags or communicators may be used from different threads.
class ControlChannel {
 public:
  // `comm` must outlive the channel.
  explicit ControlChannel(const Communicator& comm, int tag = kControlTag);
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;
  ~ControlChannel();

  const Communicator& comm() const { return comm_; }

  // Returns once MPI has taken the message (small ones at once, large ones when the peer
  // starts receiving); throws kDisconnected at the deadline.
  void send(int dest, const ControlMessage& message, const Deadline& deadline);
  // Sends raw bytes as one control message (tests of malformed input; relays).
  void send_bytes(int dest, std::vector<std::byte> bytes, const Deadline& deadline);

  // The next message from `source` (or kAnySource). `awaited` says what the caller waits
  // for, for the timeout message. Malformed bytes throw Error(kFailed) naming the source.
  Received recv(int source, const Deadline& deadline, std::string_view awaited);
  // A message when one has arrived, else nullopt; never waits beyond the receive itself.
  std::optional<Received> try_recv(int source, const Deadline& deadline);

 private:
  struct PendingSend {
    std::vector<std::byte> bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  std::optional<Received> receive_matched(MPI_Message& message, const MPI_Status& status,
                                          const Deadline& deadline);

  const Communicator& comm_;
  int tag_;
  // Sends a silent peer never took: MPI may still read their bytes, so they live here
  // until the channel is destroyed.
  std::vector<PendingSend> orphans_;
};

std::string rank_name(int rank);  // "rank 3", or "any rank" for kAnySource

}  // namespace strata
