// FakeNcclNet (fake_nccl.h): one NCCL communicator's blocking semantics on
// the CPU.

#include "transport/testing/fake_nccl.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace dmuon::transport::testing {

FakeNcclNet::FakeNcclNet(int nranks, std::chrono::milliseconds timeout)
    : nranks_(nranks), timeout_(timeout), ranks_(nranks) {}

absl::Status FakeNcclNet::CheckRank(int rank) const {
  if (rank < 0 || rank >= nranks_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fake nccl: rank ", rank, " is outside [0, ", nranks_, ")"));
  }
  return absl::OkStatus();
}

absl::Status FakeNcclNet::StartJoin(int rank) {
  if (auto st = CheckRank(rank); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  if (ranks_[rank].joined) {
    return absl::InvalidArgumentError(
        absl::StrCat("fake nccl: rank ", rank, " joined twice"));
  }
  ranks_[rank].joined = true;
  return absl::OkStatus();
}

bool FakeNcclNet::AllJoined() {
  absl::MutexLock lock(&mu_);
  for (const RankState& r : ranks_)
    if (!r.joined) return false;
  return true;
}

absl::Status FakeNcclNet::Join(int rank) {
  if (auto st = StartJoin(rank); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  auto all = [this] {
    mu_.AssertReaderHeld();
    for (const RankState& r : ranks_)
      if (!r.joined) return false;
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all),
                            absl::FromChrono(timeout_))) {
    return absl::DeadlineExceededError(
        absl::StrCat("fake nccl: rank ", rank, "'s ncclCommInitRank waited ",
                     timeout_.count(), " ms for the other ranks to join"));
  }
  return absl::OkStatus();
}

bool FakeNcclNet::Connected(const Pair& p) const {
  return send_side_.count(p) > 0 && recv_side_.count(p) > 0;
}

bool FakeNcclNet::Active(const Op& op) const {
  const RankState& r = ranks_[op.rank];
  return !r.aborted && !r.running.empty() &&
         r.running.front().marker == op.group;
}

absl::StatusOr<uint64_t> FakeNcclNet::Group(
    int rank, const std::vector<NcclTransfer>& transfers) {
  if (auto st = CheckRank(rank); !st.ok()) return st;
  for (const NcclTransfer& t : transfers) {
    if (t.peer < 0 || t.peer >= nranks_ || t.peer == rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fake nccl: rank ", rank, " posted a transfer with peer ", t.peer,
          " (communicator of ", nranks_, " ranks)"));
    }
  }
  absl::MutexLock lock(&mu_);
  RankState& me = ranks_[rank];
  if (me.aborted) {
    return absl::FailedPreconditionError(
        absl::StrCat("fake nccl: rank ", rank, "'s communicator was aborted"));
  }
  for (const RankState& r : ranks_) {
    if (!r.joined) {
      return absl::FailedPreconditionError(absl::StrCat(
          "fake nccl: rank ", rank,
          " posted a group before the communicator was initialized"));
    }
  }
  const uint64_t marker = ++me.next_marker;
  me.posted.push_back(transfers);
  me.running.push_back({marker, static_cast<int>(transfers.size())});
  std::vector<Pair> pairs;
  for (const NcclTransfer& t : transfers) {
    const Pair p = t.send ? Pair{rank, t.peer} : Pair{t.peer, rank};
    (t.send ? send_side_ : recv_side_).insert(p);
    (t.send ? sends_ : recvs_)[p].push_back({t, rank, marker});
    pairs.push_back(p);
  }
  Progress();
  // ncclGroupEnd: returns once every pair it uses is connected.
  Pair missing{-1, -1};
  auto connected = [&] {
    mu_.AssertReaderHeld();
    if (ranks_[rank].aborted) return true;
    for (const Pair& p : pairs) {
      if (!Connected(p)) {
        missing = p;
        return false;
      }
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&connected),
                            absl::FromChrono(timeout_))) {
    const bool sending = missing.first == rank;
    const int peer = sending ? missing.second : missing.first;
    AbortLocked(rank);
    return absl::DeadlineExceededError(absl::StrCat(
        "fake nccl: rank ", rank, "'s ncclGroupEnd waited ", timeout_.count(),
        " ms to connect ", sending ? "its send to" : "its receive from",
        " rank ", peer, ", which posted no group ",
        sending ? "receiving from" : "sending to",
        " it: a deadlock with the real NCCL, whose group end blocks until "
        "the peer connects too"));
  }
  if (ranks_[rank].aborted) {
    return absl::FailedPreconditionError(
        absl::StrCat("fake nccl: rank ", rank, "'s communicator was aborted"));
  }
  return marker;
}

void FakeNcclNet::Progress() {
  for (bool moved = true; moved;) {
    moved = false;
    for (auto& [pair, sq] : sends_) {
      std::deque<Op>& rq = recvs_[pair];
      while (!sq.empty() && !rq.empty() && Active(sq.front()) &&
             Active(rq.front())) {
        const Op s = sq.front(), r = rq.front();
        sq.pop_front();
        rq.pop_front();
        if (s.t.bytes != r.t.bytes) {
          const absl::Status mismatch = absl::InvalidArgumentError(absl::StrCat(
              "fake nccl: rank ", s.rank, "'s send of ", s.t.bytes,
              " bytes met rank ", r.rank, "'s receive of ", r.t.bytes,
              " bytes: the two sides posted their transfers out of the "
              "order of the protocol"));
          for (int k : {s.rank, r.rank})
            if (ranks_[k].error.ok()) ranks_[k].error = mismatch;
        } else if (s.t.bytes > 0) {
          std::memcpy(r.t.base + r.t.offset, s.t.base + s.t.offset, s.t.bytes);
        }
        ranks_[s.rank].running.front().open_ops--;
        ranks_[r.rank].running.front().open_ops--;
        moved = true;
      }
    }
    for (RankState& r : ranks_) {
      while (!r.aborted && !r.running.empty() &&
             r.running.front().open_ops == 0) {
        r.completed = r.running.front().marker;
        r.running.pop_front();
        moved = true;
      }
    }
  }
}

absl::StatusOr<bool> FakeNcclNet::Done(int rank, uint64_t marker) {
  if (auto st = CheckRank(rank); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  const RankState& r = ranks_[rank];
  if (!r.error.ok()) return r.error;
  if (r.aborted) {
    return absl::FailedPreconditionError(
        absl::StrCat("fake nccl: rank ", rank, "'s communicator was aborted"));
  }
  return marker <= r.completed;
}

absl::Status FakeNcclNet::Synchronize(int rank) {
  if (auto st = CheckRank(rank); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  auto idle = [this, rank] {
    mu_.AssertReaderHeld();
    const RankState& r = ranks_[rank];
    return r.aborted || !r.error.ok() || r.running.empty();
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&idle),
                            absl::FromChrono(timeout_))) {
    return absl::DeadlineExceededError(absl::StrCat(
        "fake nccl: rank ", rank, "'s stream did not finish within ",
        timeout_.count(),
        " ms: a transfer waits for a peer that never posted its side"));
  }
  const RankState& r = ranks_[rank];
  if (!r.error.ok()) return r.error;
  if (r.aborted) {
    return absl::FailedPreconditionError(
        absl::StrCat("fake nccl: rank ", rank, "'s communicator was aborted"));
  }
  return absl::OkStatus();
}

void FakeNcclNet::AbortLocked(int rank) {
  RankState& me = ranks_[rank];
  if (me.aborted) return;
  me.aborted = true;
  me.running.clear();
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& [pair, q] : *queues) {
      for (auto it = q.begin(); it != q.end();)
        it = it->rank == rank ? q.erase(it) : std::next(it);
    }
  }
  // A connection the rank had only started never forms now.
  for (auto* sides : {&send_side_, &recv_side_}) {
    for (auto it = sides->begin(); it != sides->end();) {
      const bool mine = it->first == rank || it->second == rank;
      it = mine && !Connected(*it) ? sides->erase(it) : std::next(it);
    }
  }
}

void FakeNcclNet::Abort(int rank) {
  if (!CheckRank(rank).ok()) return;
  absl::MutexLock lock(&mu_);
  AbortLocked(rank);
}

std::vector<std::vector<NcclTransfer>> FakeNcclNet::Posted(int rank) {
  if (!CheckRank(rank).ok()) return {};
  absl::MutexLock lock(&mu_);
  return ranks_[rank].posted;
}

namespace {

class FakeDaemonComm final : public NcclComm {
 public:
  FakeDaemonComm(std::shared_ptr<FakeNcclNet> net, int rank)
      : net_(std::move(net)), rank_(rank) {}

  absl::Status Poll() override {
    if (!joining_) {
      joining_ = true;
      join_error_ = net_->StartJoin(rank_);
    }
    if (!join_error_.ok()) return join_error_;
    return net_->AllJoined() ? absl::OkStatus()
                             : absl::UnavailableError("in progress");
  }
  absl::StatusOr<uint64_t> Post(
      const std::vector<NcclTransfer>& transfers) override {
    return net_->Group(rank_, transfers);
  }
  absl::StatusOr<bool> Done(uint64_t marker) override {
    return net_->Done(rank_, marker);
  }
  void Abort() override { net_->Abort(rank_); }
  void Close() override { net_->Abort(rank_); }

 private:
  const std::shared_ptr<FakeNcclNet> net_;
  const int rank_;
  bool joining_ = false;
  absl::Status join_error_;
};

}  // namespace

std::unique_ptr<NcclComm> NewFakeDaemonComm(std::shared_ptr<FakeNcclNet> net,
                                            int rank) {
  return std::make_unique<FakeDaemonComm>(std::move(net), rank);
}

}  // namespace dmuon::transport::testing
