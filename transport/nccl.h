// The nccl transport: trainer and daemon on any GPUs, any hosts.
//
// One communicator per job: trainer rank r is NCCL rank r and the daemon is
// rank world_size of world_size + 1 (NcclRanksFor). NCCL refuses two ranks of
// a communicator on one GPU ("Duplicate GPU detected"), so on one host the
// daemon's GPU for the job must be none of the trainer ranks' (otherwise the
// job's communicator fails to form, and its first transfer reports why). The
// daemon makes the unique id when the job's first session opens and returns it
// in OpenSessionResponse.nccl; every trainer rank and the daemon join with a
// non-blocking ncclCommInitRankConfig. The daemon keeps each session's
// region (the usual layout: gradient and update slots, fp32) in its own GPU
// memory; transfers move slots between it and the trainer's copy.
//
// Warm-up (what keeps the first transfers from deadlocking): NCCL connects
// a pair of ranks lazily, inside the first ncclGroupEnd that uses that pair
// in that direction, and that group end does not return (blocking
// communicator) or stays in progress (non-blocking) until the peer's group
// end sets up its side of the same pair. Without a warm-up the trainer's first
// gradient group would wait for the daemon's receive, which the daemon posts
// only after the GradientsReady that the trainer sends once that group end
// returns (and the first update group has the mirror problem). So the first
// group either side posts on a new communicator is its warm-up, before any
// step's transfer:
//   trainer rank r, right after ncclCommInitRank returns: one group
//     {ncclSend of kNcclWarmUpBytes to daemon_rank, ncclRecv of
//     kNcclWarmUpBytes from daemon_rank} (the contents mean nothing);
//   daemon, queued when the communicator is made (AddJobCommunicator) and so
//     posted as soon as it is initialized: one group with, per trainer rank r
//     in rank order, {ncclRecv of kNcclWarmUpBytes from r, ncclSend of
//     kNcclWarmUpBytes to r} (DaemonWarmUp).
// NCCL matches a pair's point-to-point transfers in posting order, so the
// warm-ups meet each other; once they have, every connection the steps use
// exists in both directions and no later group end waits for a peer (the
// transfers themselves still complete on the streams only when both sides
// have posted them). Every rank joins every communicator at once (init needs
// all of them), so no rank is late for the warm-up; a session that closes ends
// the job's communicator and the reopened ranks join a new one (a new unique
// id), which starts with its own warm-up on every side. A trainer without the
// warm-up (a build before it) cannot meet this daemon: the daemon's warm-up
// waits out its enqueue deadline (NcclPolicy::transfer_timeout_seconds) and
// the job breaks naming it; before the warm-up no NCCL step could complete at
// all, so no working pair of builds is broken by it.
//
// Order (what keeps both sides' GPU streams from waiting on each other):
//   trainer, per GradientsReady message: ncclSend of the listed gradient
//     slots in one group, in message order, then the message; once every
//     gradient of the step is declared, per UpdatesReady message received:
//     ncclRecv of the listed update slots in one group, in message order.
//   daemon, per GradientsReady: ncclRecv of the same slots, same order, one
//     group (Region::Pull; the parameters run once the data has landed);
//     update sends (Region::Push) are held until every gradient of that
//     rank's step has been posted (ExchangeOrder), then posted in the order
//     the updates completed, each followed by its UpdatesReady.
//   absent parameters (GradientsReady.absent_param_ids: no gradient this
//     step) move nothing either way: the trainer sends none, the daemon
//     posts no receive for them but counts them among the step's gradients
//     (Region::Absent), and answers each with an empty group in the push
//     order (its UpdatesReady lists it as absent; nothing to receive).
// So both sides post each pair's transfers in one order: the step's gradient
// transfers, then its update transfers.
//
// Failures: the communicator is polled with ncclCommGetAsyncError; a
// transfer pending past its deadline, an asynchronous error, or the job's
// end (a rank closed or died) aborts it with ncclCommAbort (NcclPolicy), and
// every pending callback gets the reason: the job breaks, never the daemon.
// Every NCCL call of a device comes from its NcclWorker's one thread, which
// visits the device's communicators in a fixed order and posts each one's
// groups in queue order.
//
// The logic (ranks, transfers, order, warm-up, policy, the worker over an
// abstract NcclComm, the daemon's session region over memory it is given) is
// plain C++ (nccl_logic.cc, nccl_worker.cc, nccl_region.cc; tested on the CPU
// with transport/testing/fake_nccl.h, a communicator double with NCCL's
// blocking semantics); the CUDA and NCCL calls are in nccl_cuda.cc
// (--config=cuda). No CUDA or NCCL type appears here.

#ifndef DMUON_TRANSPORT_NCCL_H_
#define DMUON_TRANSPORT_NCCL_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace dmuon::transport {

inline constexpr size_t kNcclUniqueIdBytes = 128;  // ncclUniqueId

struct NcclRanks {
  int nranks = 0;
  int daemon_rank = 0;
};
NcclRanks NcclRanksFor(int world_size);

// One point-to-point transfer of a group: bytes at `offset` of the region,
// to (send) or from (receive) NCCL rank `peer`.
struct NcclTransfer {
  bool send = false;
  int peer = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::byte* base = nullptr;  // the region's memory (set by the region)
};
// The receives of `params`' gradient slots from `peer`, in `params` order.
std::vector<NcclTransfer> GradientReceives(const Layout& layout, int peer,
                                           const std::vector<int>& params);
// The sends of `params`' update slots to `peer`, in `params` order.
std::vector<NcclTransfer> UpdateSends(const Layout& layout, int peer,
                                      const std::vector<int>& params);

// The warm-up's payload each way (one fp32; see the header comment).
inline constexpr uint64_t kNcclWarmUpBytes = 4;
// The daemon's scratch memory for its warm-up: a receive slot per trainer
// rank, then one send slot (ranks.nranks * kNcclWarmUpBytes).
uint64_t NcclWarmUpScratchBytes(NcclRanks ranks);
// The daemon's warm-up group over `scratch` (NcclWarmUpScratchBytes(ranks)
// bytes): per trainer rank r < ranks.daemon_rank, in rank order, a receive of
// kNcclWarmUpBytes from r into slot r, then a send of kNcclWarmUpBytes to r
// from the last slot.
std::vector<NcclTransfer> DaemonWarmUp(NcclRanks ranks, std::byte* scratch);

// One rank's side of the order rule (daemon): a step's update sends wait
// until every one of its `params` gradients has been posted. Thread-
// compatible.
class ExchangeOrder {
 public:
  explicit ExchangeOrder(int params) : params_(params) {}
  // `count` gradients of `step` were posted (or declared absent: nothing to
  // post). Returns the held pushes that may now go, in the order they were
  // held.
  std::vector<uint64_t> GradientsPosted(int64_t step, int count);
  // A push (named by `token`) of `step`: true when it may go now; otherwise
  // it is held until GradientsPosted releases it.
  bool MayPush(int64_t step, uint64_t token);

 private:
  const int params_;
  int64_t step_ = 0;
  int posted_ = 0;
  std::vector<std::pair<int64_t, uint64_t>> held_;
};

// When to give up on a communicator.
struct NcclPolicy {
  double init_timeout_seconds = 300;      // every rank must join by then
  double transfer_timeout_seconds = 120;  // oldest posted group to complete
};
struct NcclHealth {
  bool initialized = false;
  double since_start_seconds = 0;     // since the daemon began joining
  double oldest_pending_seconds = 0;  // 0: nothing pending
  absl::Status async_error;           // ncclCommGetAsyncError's verdict
};
// OK: keep waiting. Otherwise the reason to abort (DEADLINE_EXCEEDED or the
// communicator's error as UNAVAILABLE), naming what timed out and how long.
absl::Status JudgeNccl(const NcclPolicy& policy, const NcclHealth& health);

// One communicator as the worker drives it; the real one wraps NCCL
// (nccl_cuda.cc). Called from the worker thread only.
class NcclComm {
 public:
  virtual ~NcclComm() = default;
  // OK once initialized; UNAVAILABLE while joining; else its error.
  virtual absl::Status Poll() = 0;
  // Posts `transfers` as one group; returns a marker (> 0) for Done.
  virtual absl::StatusOr<uint64_t> Post(
      const std::vector<NcclTransfer>& transfers) = 0;
  // Whether everything posted up to `marker` has completed.
  virtual absl::StatusOr<bool> Done(uint64_t marker) = 0;
  // Tears the communicator down on a failure (ncclCommAbort) ...
  virtual void Abort() = 0;
  // ... or when it is removed with nothing pending.
  virtual void Close() = 0;
};

// The one thread that makes every NCCL call of one device, for all the
// communicators (jobs) on it, visiting them in the order they were added:
// posts each one's queued groups in order once it is ready, reports
// completions, polls for errors and timeouts (JudgeNccl) and aborts a
// communicator on its first failure, failing everything pending on it and
// everything submitted to it later with that reason. The others go on.
class NcclWorker {
 public:
  explicit NcclWorker(NcclPolicy policy);
  ~NcclWorker();  // cancels what is still pending, closes all, joins
  NcclWorker(const NcclWorker&) = delete;
  NcclWorker& operator=(const NcclWorker&) = delete;

  // Takes a communicator (joining starts on the worker thread); returns its
  // id for the calls below.
  int Add(std::unique_ptr<NcclComm> comm);
  // Queues a group. `posted` runs when it has been posted (or failed),
  // `completed` when it has completed (or failed); either may be empty. Both
  // run on the worker thread, never inside Submit.
  void Submit(int comm, std::vector<NcclTransfer> transfers,
              std::function<void(absl::Status)> posted,
              std::function<void(absl::Status)> completed);
  // Aborts a communicator (idempotent): its job is over. AbortAndWait also
  // waits until it is torn down and every callback of it has run (never
  // call it from a callback).
  void Abort(int comm, absl::Status why);
  void AbortAndWait(int comm, absl::Status why);
  // Why it was aborted; OK while it serves.
  absl::Status status(int comm) const;
  // Tears down (Close, or Abort when something is pending) and forgets it.
  void Remove(int comm);

 private:
  struct Group {
    std::vector<NcclTransfer> transfers;
    std::function<void(absl::Status)> posted, completed;
    uint64_t marker = 0;
    bool was_posted = false;
    std::chrono::steady_clock::time_point posted_at;
  };
  struct Entry {
    std::unique_ptr<NcclComm> comm;
    std::chrono::steady_clock::time_point added;
    bool initialized = false;
    std::deque<Group> queued;   // not yet posted (guarded by mu_)
    std::deque<Group> pending;  // posted, not completed (worker thread)
    absl::Status aborted;       // set once torn down by a failure
    absl::Status abort_reason;  // requested by Abort, not yet acted on
    bool abort_requested = false;
    bool remove = false;
    bool done = false;  // torn down, callbacks run
  };
  void Loop();
  // One round for one communicator; returns whether it has work in flight.
  bool Visit(Entry& e);
  void Fail(Entry& e, const absl::Status& why);
  static void FailGroups(std::deque<Group>& groups, const absl::Status& why);

  const NcclPolicy policy_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, std::unique_ptr<Entry>> comms_;  // by id: the visiting order
  int next_id_ = 1;
  bool stop_ = false;
  std::thread thread_;
};

// Adds the daemon's communicator `comm` of a job of `ranks` to `worker` and
// queues the daemon's warm-up (DaemonWarmUp over `scratch`, which must stay
// valid as long as `comm` exists) as its first group, so that the worker
// posts it as soon as the communicator is initialized, before anything a
// session submits. Returns the communicator's id.
int AddJobCommunicator(NcclWorker& worker, std::unique_ptr<NcclComm> comm,
                       NcclRanks ranks, std::byte* scratch);

// The daemon's side of trainer rank `rank`'s session over `worker`'s
// communicator `comm`: `view` (layout.total_bytes of the job's device
// memory, the region's DeviceView) filled by Pull and sent by Push in the
// order of the header comment, with ExchangeOrder holding a step's update
// sends until every gradient of it was posted or declared absent. Its
// destruction ends the job's communicator (AbortAndWait: nothing moves the
// memory any more), fails the pushes still held, then runs `free_memory`.
// Check() is the communicator's status.
std::unique_ptr<Region> NewNcclRegion(std::shared_ptr<NcclWorker> worker,
                                      int comm, int rank, Layout layout,
                                      DeviceView view,
                                      std::function<void()> free_memory);

// --- CUDA side (nccl_cuda.cc; only in the --config=cuda build) ---

// A job's communicator on the daemon's side, shared by its sessions.
class NcclJob {
 public:
  virtual ~NcclJob() = default;
  virtual const std::string& unique_id() const = 0;  // kNcclUniqueIdBytes
  virtual NcclRanks ranks() const = 0;
  // The daemon side of rank `rank`'s session: `layout.total_bytes` of this
  // job's GPU, filled by Pull and sent by Push (see the header comment).
  virtual absl::StatusOr<std::unique_ptr<Region>> OpenRegion(
      int rank, const Layout& layout) = 0;
  // The job is over: abort the communicator (pending transfers fail).
  virtual void Abort(absl::Status why) = 0;
  // Aborted (by a failure or Abort): a new NcclJob is needed.
  virtual bool ended() const = 0;
};

// Makes the unique id and starts joining as the daemon rank of a
// `world_size`-rank job on `worker`'s device (CUDA ordinal `device`).
absl::StatusOr<std::shared_ptr<NcclJob>> StartNcclJob(
    int world_size, int device, std::shared_ptr<NcclWorker> worker,
    NcclPolicy policy);

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_NCCL_H_
