#include "transport/control_channel.h"

#include <fmt/format.h>

#include <climits>

#include "kernels/error.h"

namespace strata {

std::string rank_name(int rank) {
  return rank == kAnySource ? std::string("any rank") : fmt::format("rank {}", rank);
}

ControlChannel::ControlChannel(const Communicator& comm, int tag) : comm_(comm), tag_(tag) {
  STRATA_CHECK(comm.valid(), "control channel on a null communicator");
}

ControlChannel::~ControlChannel() {
  for (PendingSend& p : orphans_) {
    // When MPI cannot confirm the cancel, keep the bytes alive for it rather than risk it
    // reading freed memory: a deliberate leak, a few bytes per dead peer, once.
    if (!abandon_request(p.request)) new std::vector<std::byte>(std::move(p.bytes));
  }
}

void ControlChannel::send(int dest, const ControlMessage& message, const Deadline& deadline) {
  send_bytes(dest, encode(message), deadline);
}

void ControlChannel::send_bytes(int dest, std::vector<std::byte> bytes, const Deadline& deadline) {
  STRATA_CHECK(bytes.size() <= static_cast<size_t>(INT_MAX), "{} bytes", bytes.size());
  PendingSend p{std::move(bytes), MPI_REQUEST_NULL};
  check_mpi(MPI_Isend(p.bytes.data(), static_cast<int>(p.bytes.size()), MPI_BYTE, dest, tag_,
                      comm_.native(), &p.request),
            fmt::format("MPI_Isend of a control message to rank {}", dest));
  int rc = MPI_SUCCESS;
  const bool done = poll_until(deadline, [&] {
    int flag = 0;
    rc = MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE);
    return flag != 0 || rc != MPI_SUCCESS;
  });
  if (done && rc == MPI_SUCCESS) return;
  orphans_.push_back(std::move(p));
  check_mpi(rc, fmt::format("control message to rank {}", dest));
  fail_timeout(deadline, rank_name(dest), "it to take a control message");
}

Received ControlChannel::recv(int source, const Deadline& deadline, std::string_view awaited) {
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status{};
  int rc = MPI_SUCCESS;
  const bool found = poll_until(deadline, [&] {
    int flag = 0;
    rc = MPI_Improbe(source, tag_, comm_.native(), &flag, &message, &status);
    return flag != 0 || rc != MPI_SUCCESS;
  });
  check_mpi(rc, fmt::format("MPI_Improbe for a control message from {}", rank_name(source)));
  if (!found) fail_timeout(deadline, rank_name(source), std::string(awaited));
  return *receive_matched(message, status, deadline);
}

std::optional<Received> ControlChannel::try_recv(int source, const Deadline& deadline) {
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status{};
  int flag = 0;
  check_mpi(MPI_Improbe(source, tag_, comm_.native(), &flag, &message, &status),
            fmt::format("MPI_Improbe for a control message from {}", rank_name(source)));
  if (!flag) return std::nullopt;
  return receive_matched(message, status, deadline);
}

// The matched-probe pair (Improbe + Imrecv) takes exactly the probed message even when
// other threads receive on the same communicator.
std::optional<Received> ControlChannel::receive_matched(MPI_Message& message,
                                                        const MPI_Status& status,
                                                        const Deadline& deadline) {
  const int source = status.MPI_SOURCE;
  int count = 0;
  check_mpi(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count");
  if (static_cast<size_t>(count) > kMaxControlMessageBytes) {
    fail(ErrorKind::kFailed, "control message of {} bytes from rank {} exceeds the limit of {}",
         count, source, kMaxControlMessageBytes);
  }
  std::vector<std::byte> bytes(static_cast<size_t>(count));
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Imrecv(bytes.data(), count, MPI_BYTE, &message, &request), "MPI_Imrecv");
  wait_request(request, MPI_STATUS_IGNORE, deadline, rank_name(source),
               "the rest of a control message");
  try {
    return Received{source, decode(bytes)};
  } catch (const Error& e) {
    throw Error(e.kind(), fmt::format("from rank {}: {}", source, e.what()));
  }
}

}  // namespace strata
