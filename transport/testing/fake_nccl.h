// A CPU double of one NCCL communicator with NCCL's blocking semantics, for
// tests that run both sides of the nccl transport (transport/nccl.h) in one
// process: the daemon's NcclWorker drives its rank through NcclComm
// (NewFakeDaemonComm), a trainer drives its rank through the blocking calls
// below. "Device memory" is host memory; a transfer is a memcpy.
//
// What it models (each a way the real NCCL can hang or fail):
//   init: ncclCommInitRank (Join) returns only once every rank has joined;
//     the daemon's non-blocking join (the first Poll) reports UNAVAILABLE
//     ("in progress") until then.
//   connect is lazy: the first group of a rank that uses a pair (this rank
//     sends to a peer, or receives from it) connects that pair in that
//     direction, and the group end does not return (trainer: Group blocks;
//     daemon: Post waits, as RealComm's WaitIdle does on ncclInProgress)
//     until the peer has posted a group that uses the same pair from its
//     side (the receive for a send, the send for a receive).
//   a transfer completes only when both sides have posted it: a send and a
//     receive of one (sender, receiver) pair match in posting order, and
//     neither completes before the other is posted (rendezvous; the real
//     NCCL may finish small sends early into its buffers, which no correct
//     order may rely on). A matched pair of different sizes fails both
//     groups (INVALID_ARGUMENT naming both; the real NCCL truncates or
//     corrupts).
//   one stream per rank: a rank's groups run one after the other, a group's
//     transfers are matched only once every earlier group of that rank has
//     completed (NCCL kernels on one stream), and completion is in stream
//     order.
//   abort (ncclCommAbort) removes the rank's pending transfers: its peers'
//     matching transfers never complete (they hang until their own
//     deadlines), as with the real NCCL.
// A blocking call that cannot proceed waits up to the net's `timeout`, then
// fails DEADLINE_EXCEEDED naming what it waited for ("... a deadlock"), and
// the rank that gave up is aborted. Thread-safe.

#ifndef DMUON_TRANSPORT_TESTING_FAKE_NCCL_H_
#define DMUON_TRANSPORT_TESTING_FAKE_NCCL_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "transport/nccl.h"

namespace dmuon::transport::testing {

class FakeNcclNet {
 public:
  FakeNcclNet(int nranks, std::chrono::milliseconds timeout);
  FakeNcclNet(const FakeNcclNet&) = delete;
  FakeNcclNet& operator=(const FakeNcclNet&) = delete;

  int nranks() const { return nranks_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // ncclCommInitRank: `rank` joins; returns once every rank has, or
  // DEADLINE_EXCEEDED. INVALID_ARGUMENT for a rank outside [0, nranks) or
  // one that joined already.
  absl::Status Join(int rank);
  // A non-blocking join (ncclCommInitRankConfig, blocking = 0) ...
  absl::Status StartJoin(int rank);
  // ... done once every rank has joined.
  bool AllJoined();

  // ncclGroupStart, ncclSend/ncclRecv of `transfers` in order (each
  // `bytes` at base + offset, to or from `peer`), ncclGroupEnd, on `rank`'s
  // stream. Returns the group's marker once every pair the group uses is
  // connected (the group end returned); DEADLINE_EXCEEDED after the timeout
  // (then `rank` is aborted). INVALID_ARGUMENT for a peer outside the
  // communicator or the rank itself; FAILED_PRECONDITION on an aborted rank.
  absl::StatusOr<uint64_t> Group(int rank,
                                 const std::vector<NcclTransfer>& transfers);
  // Whether `rank`'s group `marker` (and every earlier one) has completed;
  // the error of a failed group.
  absl::StatusOr<bool> Done(int rank, uint64_t marker);
  // cudaStreamSynchronize: waits until every group `rank` posted has
  // completed; DEADLINE_EXCEEDED after the timeout (a transfer whose peer
  // never posted its side).
  absl::Status Synchronize(int rank);
  // ncclCommAbort by `rank` (idempotent).
  void Abort(int rank);

  // The groups `rank` posted, in order (for tests of the order itself).
  std::vector<std::vector<NcclTransfer>> Posted(int rank);

 private:
  struct Op {
    NcclTransfer t;
    int rank = 0;
    uint64_t group = 0;
  };
  struct GroupState {
    uint64_t marker = 0;
    int open_ops = 0;  // transfers not yet matched
  };
  struct RankState {
    bool joined = false;
    bool aborted = false;
    uint64_t next_marker = 0;
    uint64_t completed = 0;          // every group up to it completed
    std::deque<GroupState> running;  // posted, not complete: stream order
    absl::Status error;              // a failed group's
    std::vector<std::vector<NcclTransfer>> posted;
  };
  using Pair = std::pair<int, int>;  // (sender, receiver)

  bool Connected(const Pair& p) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Active(const Op& op) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Matches what can be matched and completes groups, until nothing moves.
  void Progress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRank(int rank) const;

  const int nranks_;
  const std::chrono::milliseconds timeout_;
  absl::Mutex mu_;
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu_);
  // Pairs whose sender / receiver has posted a group using them.
  std::set<Pair> send_side_ ABSL_GUARDED_BY(mu_);
  std::set<Pair> recv_side_ ABSL_GUARDED_BY(mu_);
  // Posted, unmatched transfers of each pair, in posting order.
  std::map<Pair, std::deque<Op>> sends_ ABSL_GUARDED_BY(mu_);
  std::map<Pair, std::deque<Op>> recvs_ ABSL_GUARDED_BY(mu_);
};

// The daemon's non-blocking communicator as rank `rank` of `net`, what
// RealComm (nccl_cuda.cc) does over NCCL: joins at the first Poll, which is
// UNAVAILABLE until every rank joined; Post posts a group and waits while
// it is in progress (connecting), failing DEADLINE_EXCEEDED after the net's
// timeout as RealComm's enqueue deadline does; Done asks the stream; Abort
// and Close abort the rank.
std::unique_ptr<NcclComm> NewFakeDaemonComm(std::shared_ptr<FakeNcclNet> net,
                                            int rank);

}  // namespace dmuon::transport::testing

#endif  // DMUON_TRANSPORT_TESTING_FAKE_NCCL_H_
