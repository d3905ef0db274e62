// The optimizer service: jobs, sessions, steps, state, status. No gRPC types:
// every method returns absl::Status; the gRPC adapter (daemon/grpc_service.cc)
// is the only place a Status becomes a grpc::Status. Unit-tested without
// sockets.
//
// A job is `world_size` ranks sharing a parameter table; each rank opens a
// session. A parameter's step runs when every rank has declared its gradient
// (rows gathered, replicated: rank 0's, unreduced: the mean in rank order),
// on the executor the planner gave it; its update goes back to every rank.
// A session's step is complete when all its parameters' updates are back.

#ifndef DMUON_SERVER_SERVICE_H_
#define DMUON_SERVER_SERVICE_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/protocol.h"
#include "base/trace.h"
#include "kernels/autotune.h"
#include "proto/dmuon.pb.h"
#include "server/deadline_thread.h"
#include "server/device_transport.h"
#include "server/fallbacks.h"
#include "server/limits.h"
#include "server/mark_store.h"
#include "server/principal.h"
#include "server/quota.h"
#include "server/read_budget.h"
#include "server/scheduler.h"
#include "server/service_metrics.h"
#include "server/session_error.h"
#include "server/snapshot_store.h"
#include "server/step_sink.h"
#include "server/step_stats.h"
#include "server/table.h"

namespace dmuon::server {

// A parameter that nothing measured costs the planner its cost-model flops
// (kernels/cost_model.h EstimateCost) at this rate, in the range of one CPU
// socket, so that measured and modelled costs stay on one scale.
inline constexpr double kNominalFlopsPerSecond = 1e11;

// The autotuner's backend (ServiceOptions::autotune_cache): where and how a
// method is measured. The service stays free of device types: a GPU daemon
// plugs its measurement in here.
struct Tuning {
  // TuneKey::device of every cache entry, naming the hardware the times
  // belong to ("cpu:16t", "cuda:NVIDIA H200 (sm_90, 132 SMs)").
  std::string device;
  // TuneKey::dtype: the compute dtype(s) the executors run the methods in.
  std::string dtype = "f32";
  // Largest relative error against the measurement's reference a method may
  // have and still be chosen (Autotuner::Choose); the CPU's by default.
  double tolerance = 1e-3;
  // A measurement of both methods for `batch` matrices of `shape` with
  // these options, run only on a cache miss (Autotuner::Choose), from the
  // thread opening a new job's first session, before it takes the
  // service's lock (other calls go on; two new jobs may measure at once).
  // Empty: the CPU backend (kernels::CpuMeasure, keyed by
  // kernels::CpuDeviceName() and "f32"; `device` and `dtype` are then
  // ignored).
  std::function<kernels::Autotuner::MeasureFn(
      kernels::Shape shape, int64_t batch, const kernels::NsOptions& options)>
      measure;
};

struct ServiceOptions {
  std::string version = kDmuonVersion;  // base/protocol.h
  int max_sessions = kDefaultMaxSessions;
  uint64_t max_message_bytes = kDefaultMaxMessageBytes;
  // Non-finite gradient: true = skip that parameter's step (momentum
  // untouched, update zeros, a ParameterError says so); false = fail the
  // step (the job's streams end with INVALID_ARGUMENT).
  bool skip_nonfinite = true;
  std::string state_dir;  // empty: no snapshots
  // Completed steps between snapshots; 0: shutdown only.
  int snapshot_every = kDefaultSnapshotEvery;
  // Idle-job retention (ReapIdleJobs; docs/protocol.md "Idle jobs").
  // >= 0 (an int of seconds past now cannot overflow steady_clock).
  int job_retention_seconds = kDefaultJobRetentionSeconds;
  // Limits on what one peer can make the daemon hold or do (each refused
  // with a message naming the dmuond flag; docs/security.md "Limits").
  // OpenSession (ValidateOpen, service_open_request.cc): RESOURCE_EXHAUSTED
  // above these, INVALID_ARGUMENT for a malformed job id. Defaults: limits.h
  // (each written once, for dmuond's flags too).
  int max_world_size = kDefaultMaxWorldSize;          // --max-world-size
  int max_job_parameters = kDefaultMaxJobParameters;  // --max-job-parameters
  int64_t max_job_elements = kDefaultMaxJobElements;  // --max-job-elements
  // fp32 momentum bytes of every job the daemon holds (idle ones
  // included) that a new job may bring the total to; 0: no limit.
  uint64_t max_state_bytes = kDefaultMaxStateBytes;  // --max-state-bytes
  // Bytes every GetState stream together may hold (ReadBudget; > 0): a
  // reader past it gets smaller chunks (down to kMinStateChunk), then waits
  // up to state_read_wait, then RESOURCE_EXHAUSTED (Next may be called
  // again: nothing was read).
  uint64_t max_state_read_bytes =
      kDefaultMaxStateReadBytes;                    // --max-state-read-bytes
  absl::Duration state_read_wait = kStateReadWait;  // not a flag: tests
  // --max-ns-steps: ns_steps, a custom schedule's length.
  int max_ns_steps = kDefaultMaxNsSteps;
  int max_job_id_bytes = kDefaultMaxJobIdBytes;  // --max-job-id-bytes
  // Jobs without an open rank kept at once: past it the oldest idle ones
  // are dropped first (snapshotted with state_dir) by the reaper.
  int max_idle_jobs = kDefaultMaxIdleJobs;  // --max-idle-jobs, >= 0
  // A session whose Step stream has not attached this long after
  // OpenSession is closed and its region freed (ExpireUnattached); 0: never.
  // --attach-timeout-seconds.
  int attach_timeout_seconds = kDefaultAttachTimeoutSeconds;
  // Marks (mark_store.h, docs/protocol.md "Marks"): kept per job (the
  // oldest dropped first; >= 1), and the bytes of every job's marks in
  // memory together (the oldest daemon-wide dropped first; 0: no marks).
  int marks_per_job = kDefaultMarksPerJob;  // --marks-per-job
  uint64_t mark_bytes = kDefaultMarkBytes;  // --mark-bytes
  std::vector<std::string> devices;
  // Autotuner cache file: parameters with method "auto" get the method
  // measured fastest for their shape by `tuning` (once; then cached), and
  // the planner balances measured seconds. Empty: the cost model decides.
  std::string autotune_cache;
  // How the autotuner measures; the default measures on the CPU.
  Tuning tuning;
  // Each snapshot failure (write error, stale state refused, corrupt file
  // moved aside), for the daemon to log; may be empty. Called from the
  // thread that failed, with none of the service's locks held.
  std::function<void(const absl::Status&)> snapshot_failed;
  // GPU transports (cuda_ipc, nccl); null on a CPU daemon. Sessions use them
  // only when every executor reads device memory (CUDA executors).
  std::shared_ptr<DeviceTransports> device_transports;
  // dmuond --strict: refuse the fallbacks of fallbacks.h instead of taking
  // them (each kind says what refusing means).
  bool strict = false;
  // Each fallback kind's first occurrence in this process, with its reason,
  // for the daemon to log once; may be empty. Called with none of the
  // service's locks held.
  FallbackCounter::Log fallback_logged;
  // The step timeline (server/step_trace.h; null: none); outlives the
  // service. Recorded only while started (dmuond's --trace-file, or a
  // Trace RPC's window).
  TraceRecorder* trace = nullptr;
  // Test-only (empty in dmuond): called in the middle of each piece of
  // heavy per-job work, with none of the service's locks held, naming the
  // job and the work: "momentum" once OpenSession made a new job (its
  // momentum allocated and zero-filled, its snapshot's moved in), "cover"
  // before the shard cover check of a job's last rank (O(elements /
  // blocks) for SHARDING_BLOCKS), "release" before closed sessions (their
  // regions) and dropped jobs (their momentum, their executors' state) are
  // let go; and "admit" before each attempt to admit an open (after its
  // snapshot was read). A test blocks in it to show that other jobs step
  // meanwhile, or to let the reaper drop a job between an open's read and
  // its admission.
  std::function<void(const std::string& job_id, std::string_view work)>
      heavy_work_hook;
};

class Job;
class OptimizerService;
class RegionRelease;
class Session;
class StepPipeline;

// A GetState stream (OptimizerService::ReadState; state.cc). While a
// reader lives, its job stays at the step boundary it was opened at: a
// parameter whose gradients have all arrived waits (its step is submitted
// when the job's last reader goes) and SetState and Rewind are refused, so
// every byte read is of that boundary. Each Next copies one chunk of at
// most the chunk size out of the job's state; with executors that hold
// state, one parameter at a time is read into the reader. Use from one
// thread; destroy before the service.
class StateReader {
 public:
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;
  // Lets the job step again (submits the parameters that waited).
  ~StateReader();
  // The header first, then each parameter's momentum in order, in chunks;
  // nullopt after the last. ABORTED when the job broke or was dropped
  // meanwhile.
  absl::StatusOr<std::optional<v1::StateChunk>> Next();
  // State bytes the reader holds besides the chunk Next returned: one
  // parameter read from executors that hold state, else 0.
  uint64_t buffered_bytes() const { return buf_.size() * sizeof(float); }

 private:
  friend class OptimizerService;
  StateReader(OptimizerService* service, std::shared_ptr<Job> job,
              v1::StateChunk header, uint64_t max_chunk);
  OptimizerService* const service_;
  const std::shared_ptr<Job> job_;
  std::optional<v1::StateChunk> header_;  // until Next returned it
  // Leases the next chunk's bytes from the service's ReadBudget (waiting up
  // to ServiceOptions::state_read_wait), with `holds_state` the whole
  // parameter's too (buf_, held until the parameter is read): the chunk
  // size, or 0 with lease_error_ set.
  uint64_t LeaseChunk(uint64_t remaining, bool holds_state);

  const uint64_t max_chunk_;
  int param_ = 0;           // the parameter being read
  uint64_t offset_ = 0;     // its next byte
  std::vector<float> buf_;  // it, read from an executor that holds state
  // The bytes of the chunk Next returned last (with holds_state: and of
  // buf_, until the parameter is read), and that chunk's size.
  ReadBudget::Lease lease_;
  uint64_t chunk_ = 0;
  absl::Status lease_error_;
};

// A SetState stream (OptimizerService::WriteState; state.cc): the header
// was checked against the session's job before any momentum is taken; each
// chunk is checked and copied into the new state as it comes (never more
// than the header declared for its parameter); Commit replaces the job's
// state only when every byte arrived.
class StateWriter {
 public:
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;
  // INVALID_ARGUMENT naming the parameter for a chunk that is not the next
  // of its tensor or runs past the bytes its header declared.
  absl::Status Add(const v1::StateChunk& chunk);
  // Every byte arrived and the job is between steps: its momentum and step
  // count replaced; returns its completed steps.
  absl::StatusOr<int64_t> Commit();
  // Momentum bytes taken so far (at most the job's state).
  uint64_t buffered_bytes() const { return buffered_; }

 private:
  friend class OptimizerService;
  StateWriter(OptimizerService* service, std::shared_ptr<Job> job,
              int64_t completed_steps);
  OptimizerService* const service_;
  const std::shared_ptr<Job> job_;
  const int64_t completed_steps_;
  std::vector<std::vector<float>> mom_;  // by parameter, sized on its first
  std::vector<uint64_t> got_;            // bytes received, by parameter
  uint64_t buffered_ = 0;
};

// What one OptimizerService::ReapIdleJobs pass did.
struct ReapResult {
  // Jobs dropped, with whether a snapshot of each was written first (to
  // --state-dir, which a reopen resumes from).
  std::vector<std::pair<std::string, bool>> dropped;
  // Snapshots that failed: those jobs are kept and retried later (their
  // momentum is not thrown away while --state-dir is asked to hold it).
  std::vector<absl::Status> failed;
  // The earliest drop still pending; max() when none.
  std::chrono::steady_clock::time_point next =
      std::chrono::steady_clock::time_point::max();
};

class OptimizerService {
 public:
  // `metrics` (null: nothing observed) must outlive the service.
  OptimizerService(ServiceOptions options, std::unique_ptr<Scheduler> scheduler,
                   ServiceMetrics* metrics);
  ~OptimizerService();

  // `who` (principal.h): a job it does not own is PERMISSION_DENIED; a job
  // it creates is its own. The default (anonymous) may use every job.
  absl::StatusOr<v1::OpenSessionResponse> OpenSession(
      const v1::OpenSessionRequest& req, const Principal& who = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Binds the session's Step stream. One stream per session. `doorbell`
  // (when not null): the session's doorbell when it has one, else null; its
  // declarations come to OnStepRequest from the caller, as Step messages
  // (doorbell_pump.h), like the stream's.
  absl::Status Attach(const std::string& session_id,
                      std::shared_ptr<StepSink> sink,
                      std::shared_ptr<transport::Doorbell>* doorbell = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A gradients_ready or gradient chunk from the session's stream. An error
  // ends that stream; nothing of the message has been applied.
  absl::Status OnStepRequest(const std::string& session_id,
                             const v1::StepRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The stream ended (client closed it or died): the session is reclaimed.
  // Returns false when it was already closed.
  bool Detach(const std::string& session_id, const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Closes the session (a step in progress breaks the job), then waits until
  // `release_by` for its region to be released: every step computation that
  // used it has ended and the daemon no longer maps it (cuda_ipc: the IPC
  // memory handle is closed; the client may free the memory it exported).
  // `*released` (when not null) says whether it was by then. A session whose
  // Step stream ended already (Detach) is waited for alike; NOT_FOUND when
  // the id is unknown: never opened, or closed and released before.
  absl::Status CloseSession(const std::string& session_id,
                            std::chrono::steady_clock::time_point release_by =
                                std::chrono::steady_clock::time_point::min(),
                            bool* released = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // GetState: the session's job held at its step boundary and read chunk
  // by chunk (StateReader). FAILED_PRECONDITION mid-step or when broken.
  // `who`: as OpenSession (the session's job must be its own).
  absl::StatusOr<std::unique_ptr<StateReader>> ReadState(
      const std::string& session_id, const Principal& who = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // SetState: `first` (session_id, header) checked against the session's
  // job before any momentum is taken; then StateWriter::Add each chunk and
  // Commit. `who`: as OpenSession.
  absl::StatusOr<std::unique_ptr<StateWriter>> WriteState(
      const v1::StateChunk& first, const Principal& who = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // (Both as one call, for tests: server/testing/state_streams.h.)

  v1::StatusResponse Status() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every daemon fallback kind's count (fallbacks.h): the service's own and
  // the executors' CUDA-graph fallbacks (graph_eager), summed.
  std::map<std::string, uint64_t> Fallbacks() const;
  // Refuses new sessions from now on; returns the sessions still open.
  int Drain() ABSL_LOCKS_EXCLUDED(mu_);
  // Accepts new sessions again (after Drain).
  void Undrain() ABSL_LOCKS_EXCLUDED(mu_);
  // Records the step timeline (ServiceOptions::trace) for `seconds`, then
  // returns it as one Chrome trace-event file (service_trace.cc; the Trace
  // RPC). INVALID_ARGUMENT naming TraceRequest.seconds outside (0,
  // kMaxTraceSeconds]; FAILED_PRECONDITION when it is recorded already
  // (--trace-file, or another Trace) or there is no recorder. `cancelled`
  // is polled: the caller went away (CANCELLED).
  absl::StatusOr<std::string> CaptureTrace(
      double seconds, const std::function<bool()>& cancelled);
  static constexpr double kMaxTraceSeconds = 600;
  // Job id -> owner (principal.h) of every job, for the adapter to hide
  // other principals' job ids in Status.
  std::map<std::string, std::string> JobOwners() const ABSL_LOCKS_EXCLUDED(mu_);
  // Status's snapshot_errors with the job each concerns, for the adapter
  // to hide other principals' (empty without --state-dir).
  std::vector<SnapshotStore::Error> SnapshotErrors() const;
  bool draining() const ABSL_LOCKS_EXCLUDED(mu_);
  int open_sessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // True while any job is in the middle of a step.
  bool Busy() const ABSL_LOCKS_EXCLUDED(mu_);
  // Snapshots every job to --state-dir (no-op without one).
  absl::Status SnapshotAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Checks the --state-dir snapshots so reconnecting jobs resume from them
  // (each file's momentum is read when its job is reopened; a bad file is
  // reported here, DATA_LOSS, and ignored).
  absl::Status LoadSnapshots() ABSL_LOCKS_EXCLUDED(mu_);
  // Mark (protocol minor 5; docs/protocol.md "Marks"): keeps a copy of the
  // momentum of the session's job at its completed step `req.step()` (0:
  // the step it is at), which must be the step the job is at and not yet
  // computed past (FAILED_PRECONDITION naming the job's step otherwise).
  // Marking a step held already answers as the first Mark did. With
  // --state-dir the mark is also a file, written and fsynced before this
  // returns (a failed write: `not_durable` says why; the mark is kept in
  // memory). (service_marks.cc)
  absl::StatusOr<v1::MarkResponse> Mark(const v1::MarkRequest& req,
                                        const Principal& who = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts an error by code (the adapter calls this for every failed RPC).
  void CountError(const absl::Status& st) const;

  // Drops every job whose drop time (its last rank's close plus
  // job_retention_seconds) is at or before `now`: snapshots it to
  // `state_dir` when there is one (a failed snapshot keeps the job, retried
  // a minute later), then releases its executors' and GPU transports' state
  // and forgets it (Status, metrics). A job reopened meanwhile is kept. Disk
  // writes happen without the service's lock. The reaper thread calls this;
  // tests call it with a clock of their own.
  ReapResult ReapIdleJobs(std::chrono::steady_clock::time_point now)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Starts the reaper thread: it sleeps until the next drop time, or until
  // a job's last rank closes, and runs ReapIdleJobs; `report` (may be
  // empty) gets each pass that dropped a job or failed a snapshot, on that
  // thread. The destructor stops it (waiting for a snapshot in progress).
  // Call at most once.
  void StartReaper(std::function<void(const ReapResult&)> report);
  // Closes every session whose Step stream has not attached within
  // attach_timeout_seconds of its OpenSession at `now` (its shm segment
  // unlinked and unmapped: as a Detach with DEADLINE_EXCEEDED naming
  // --attach-timeout-seconds); returns when the next one is due (max():
  // none). Its own thread runs it (started by the constructor); tests call
  // it with a clock of their own. (service.cc)
  std::chrono::steady_clock::time_point ExpireUnattached(
      std::chrono::steady_clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class StateReader;
  friend class StateWriter;
  // Methods that need a job's lock held are free functions of the files
  // that use them (job_state.h, service_admit.cc, state.cc): an annotation
  // naming job.mu() needs Job complete, and job.h is internal.
  //
  // A job's table as tuned for it (TuneTable): the table, each parameter's
  // planner cost in seconds.
  using Tuned = std::pair<Table, std::vector<double>>;

  std::shared_ptr<Session> FindSession(const std::string& id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // What an open decided under mu_ (AdmitLocked) and carries through the
  // work done without it (service_open.cc) to PublishLocked, or to
  // AbandonLocked when it fails.
  struct OpenAdmission {
    // The job joined, or the new job once BuildJob made it.
    std::shared_ptr<Job> job;
    // A new job: its id is in creating_ and `reserved` (its momentum
    // bytes) in creating_bytes_ until it is published or abandoned.
    bool created = false;
    uint64_t serial = 0;
    uint64_t reserved = 0;
    std::string owner;
    double weight = 1;  // the opener's (Principal::weight), a new job's
    double max_device_share = 1;  // the opener's quota, a new job's
    // The snapshot it resumes from, taken from pending_ (moved into the job
    // by BuildJob), and its summary: the file is pending again when the
    // open fails.
    std::optional<SnapshotFile> snapshot;
    std::optional<SnapshotSummary> resumed;
    // A joined job: its sessions by rank as last seen under mu_, what the
    // cover check reads; this rank is marked joining (Job::BeginJoin).
    std::vector<std::shared_ptr<Session>> ranks;
    // resume=replace: the idle job dropped, let go of without mu_.
    std::shared_ptr<Job> replaced;
    // Made anew (protocol minor 5; service_rebuild.cc): from the job's mark
    // of step `mark_step` (> 0), or from `rebuild_from`, the idle job of
    // the id at another world size, held (its rank 0 joining) until the new
    // job is published (then dropped: `replaced`) or the open abandoned.
    bool rebuilt = false;
    int64_t mark_step = 0;
    std::shared_ptr<Job> rebuild_from;
  };

  // What a section under mu_ lets go of, let go of once mu_ is released:
  // declared before the MutexLock, it is destroyed after it. Closed
  // sessions (a region's unmapping: GiBs for a big job), dropped jobs
  // (their momentum), and the executors' and GPU transports' state of
  // dropped jobs (Scheduler::DropJob). (service.cc)
  class Graveyard {
   public:
    explicit Graveyard(OptimizerService* service) : service_(service) {}
    Graveyard(const Graveyard&) = delete;
    Graveyard& operator=(const Graveyard&) = delete;
    ~Graveyard();
    void Bury(std::shared_ptr<Session> s) { sessions_.push_back(std::move(s)); }
    // `drop_state`: its executors' and transports' state goes too.
    void Bury(std::shared_ptr<Job> job, bool drop_state);

   private:
    OptimizerService* const service_;
    std::vector<std::shared_ptr<Session>> sessions_;
    std::vector<std::pair<std::shared_ptr<Job>, bool>> jobs_;
  };

  // Waits until no other open is making the job, then AdmitLocked, after
  // reading (LoadPendingSnapshot) a snapshot of the id that came back to
  // disk since this open's first read; UNAVAILABLE after 8 such reads.
  // (service_open.cc)
  absl::Status AdmitWithSnapshot(const v1::OpenSessionRequest& req,
                                 const Principal& who, const Table& table,
                                 OpenAdmission* a) ABSL_LOCKS_EXCLUDED(mu_);

  // OpenSession's steps (service_open.cc, service_admit.cc), in order.
  // The request's own checks: protocol, ids, world size, transport.
  absl::Status ValidateOpen(const v1::OpenSessionRequest& req) const;
  // ValidateOpen's limits (ServiceOptions, docs/security.md "Limits"):
  // job id, world size, table size, schedule length.
  absl::Status CheckLimits(const v1::OpenSessionRequest& req) const;
  // Under mu_, cheap: whether `req` may open, and what it opens. An
  // existing job is joined (its owner, the resume rules and CheckJoin
  // passed; the rank marked joining), or a new one is admitted (planned to
  // be made by BuildJob: its id in creating_, its bytes reserved, its
  // snapshot taken). resume=replace drops the idle job first.
  // A job's owner that is not `who` is PERMISSION_DENIED, before anything
  // else about the job (its snapshot is kept).
  absl::Status AdmitLocked(const v1::OpenSessionRequest& req,
                           const Table& table, const Principal& who,
                           OpenAdmission* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AdmitLocked on the existing `job`: joined (a->job set), or, idle and
  // replaced (resume=replace), dropped (a->replaced set) for AdmitLocked
  // to admit anew.
  absl::Status AdmitToJobLocked(const v1::OpenSessionRequest& req,
                                const Table& table, const Principal& who,
                                std::shared_ptr<Job> job, OpenAdmission* a)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Without a lock: makes the admitted new job (tuned with `tuned`, tuning
  // here when it is empty; planned; momentum allocated and zero-filled, or
  // the snapshot's moved in).
  // Before BuildJob: a new job about to be planned around unhealthy
  // executors takes the fallback unhealthy_executor (counted; --strict:
  // refused, FAILED_PRECONDITION, and no job is made).
  absl::Status TakeUnhealthyFallback(const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  void BuildJob(const v1::OpenSessionRequest& req, const Table& table,
                std::optional<Tuned>& tuned, OpenAdmission* a)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Without a lock: the new job made (BuildJob), the cover check when the
  // rank completes the job, the region, the session `*s`; then
  // PublishLocked (the cover checked again while it says so).
  absl::Status MakeSession(const v1::OpenSessionRequest& req,
                           const Principal& who, const Table& table,
                           std::optional<Tuned>& tuned,
                           std::vector<ShardMap> shards,
                           transport::Layout layout, OpenAdmission* a,
                           std::shared_ptr<Session>* s,
                           v1::OpenSessionResponse* resp)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The new session's region (shm, heap or a GPU transport's), made
  // without a lock; a GPU transport may add to `resp`.
  absl::StatusOr<std::unique_ptr<transport::Region>> OpenRegion(
      const OpenAdmission& a, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Under mu_: the session `s` goes on its rank and in sessions_ (a new
  // job in jobs_), unless draining or --max-sessions refuse it now, or its
  // job broke. False with OK when the job's other ranks changed since the
  // cover check read them (`a->ranks` updated): check again.
  absl::StatusOr<bool> PublishLocked(const std::shared_ptr<Session>& s,
                                     OpenAdmission* a,
                                     v1::OpenSessionResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rebuilt jobs (service_rebuild.cc). Whether `req` resumes at a mark of
  // its job (not at the step the job holds in memory or in its snapshot).
  bool ResumesAtMarkLocked(const v1::OpenSessionRequest& req) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admits the job made anew from `old` (the idle job in memory, held by
  // the caller) or, `old` null, from its mark of `mark_step` (its owner
  // checked against `who`, its table against `table`).
  absl::Status AdmitRebuildLocked(const v1::OpenSessionRequest& req,
                                  const Table& table, const Principal& who,
                                  std::shared_ptr<Job> old, int64_t mark_step,
                                  OpenAdmission* a)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A mark of `id` at `step` whose file cannot be used (`why`): moved
  // aside, dropped from the store; DATA_LOSS naming both and the marks left.
  absl::Status DropUnreadableMark(const std::string& id, int64_t step,
                                  const server::Mark& mark,
                                  const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Without mu_: `a->snapshot` becomes the mark's momentum (its file read
  // when it is only on disk) or a copy of the old job's, for BuildJob.
  absl::Status LoadRebuildState(const v1::OpenSessionRequest& req,
                                OpenAdmission* a) ABSL_LOCKS_EXCLUDED(mu_);
  // Under mu_, as the new job is published: a mark's run replaces the
  // job's snapshot (SnapshotStore::Replace); the old job is dropped.
  absl::Status PublishRebuildLocked(OpenAdmission* a)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_, the open failed: the old job is let go of (kept as it was).
  void AbandonRebuildLocked(OpenAdmission* a)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: an admitted open failed: its reservation, joining mark and
  // taken snapshot are given back; a job made for nothing goes to `gone`.
  void AbandonLocked(const v1::OpenSessionRequest& req, OpenAdmission* a,
                     Graveyard& gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The response's session, layout and capabilities.
  void FillOpenResponse(const Session& s, v1::OpenSessionResponse* resp) const;

  // Before a job is created: when `job_id` has a snapshot in state_dir not
  // read yet (pending_), reads it, without mu_ held while reading;
  // concurrent ranks of the job wait for one read. Its header is read
  // first: a file owned by another principal than `who` is
  // PERMISSION_DENIED with its momentum unread. An unreadable file is an
  // error (the job does not silently restart from zero); a file that is
  // gone is forgotten. With `resume_step` (> 0; OpenSessionRequest's) and a
  // file of another step, the job's previous snapshot becomes its snapshot
  // if it holds that step (SnapshotStore::UsePrevious), else the open is
  // refused (FAILED_PRECONDITION naming both files' steps). (state.cc)
  absl::Status LoadPendingSnapshot(const std::string& job_id,
                                   const Principal& who, int64_t resume_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Marks (service_marks.cc): those found in --state-dir (by
  // LoadSnapshots), listed with no momentum read; every mark of `job_id`
  // dropped, files and all (a new run of the id); "marks of steps 3, 5"
  // or "no marks", for errors; PERMISSION_DENIED when `who` may not use
  // the job its marks belong to (a new run of the id would drop them).
  void LoadMarks() ABSL_LOCKS_EXCLUDED(mu_);
  void DropMarks(const std::string& job_id);
  std::string MarksHeld(const std::string& job_id) const;
  absl::Status CheckMarksOwner(const Principal& who,
                               const std::string& job_id) const;
  // LoadPendingSnapshot's switch to the previous snapshot for an open asking
  // for step `want` of a job whose snapshot holds `held`. (state.cc)
  // `head`: the snapshot's header (its step and owner).
  absl::Status UsePreviousSnapshot(const std::string& job_id, int64_t want,
                                   const v1::StateHeader& head)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What no open may exceed, checked before a snapshot is read and again
  // when the open is admitted: draining, --max-sessions, and for a new job
  // --max-state-bytes (counting the bytes reserved by new jobs being
  // made). Draining and --max-sessions (CheckSessionsLocked) are checked a
  // last time when the session is published. (service_admit.cc)
  absl::Status CheckCapacityLocked(const v1::OpenSessionRequest& req,
                                   const Table& table) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckSessionsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the jobs of principal `owner` hold, created or being created
  // (quota.h). (service_admit.cc)
  QuotaUse QuotaUseLocked(const std::string& owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The request's Resume as this daemon honours it (protocol 1.0 knew
  // none). (service_admit.cc)
  static v1::Resume ResumeOf(const v1::OpenSessionRequest& req);
  // OpenSession once the request is checked and its table built: the
  // snapshot, the job, the session. (service_open.cc)
  absl::StatusOr<v1::OpenSessionResponse> OpenChecked(
      const v1::OpenSessionRequest& req, const Principal& who,
      const Table& table, std::vector<ShardMap> shards,
      transport::Layout layout) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes `s` (service.cc); what it lets go of goes to `gone`.
  void CloseLocked(std::shared_ptr<Session> s, const absl::Status& why,
                   Graveyard& gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Past max_idle_jobs jobs without an open rank, makes the oldest idle
  // ones due now and kicks the reaper (which drops them, snapshotted with
  // --state-dir). (service.cc)
  void LimitIdleJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The scheduler's executor stats with the per-step load of the open jobs
  // filled in (ExecutorStatus in dmuon.proto), for /metrics. Takes mu_ and
  // the jobs' locks. (service_status.cc)
  std::vector<ExecutorStats> ExecutorStatsWithLoad() const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every job in memory with its share, queue wait and exposed latency, for
  // /metrics. Takes mu_ and the jobs' locks. (service_status.cc)
  std::vector<JobMetrics> JobMetricsNow() const ABSL_LOCKS_EXCLUDED(mu_);
  // Resolves method "auto" by measurement and returns each parameter's
  // planner cost in seconds (measured, or the cost model at a nominal rate).
  // (service_open_request.cc)
  std::vector<double> TuneTable(Table& table);
  // GPU transports: whether `t` can be opened here. (service_open_request.cc)
  bool DeviceTransportAvailable(v1::Transport t) const;

  const ServiceOptions options_;
  std::unique_ptr<Scheduler> scheduler_;
  // What GetState streams hold (StateReader::LeaseChunk).
  ReadBudget read_budget_{std::max<uint64_t>(options_.max_state_read_bytes, 1)};
  std::unique_ptr<kernels::Autotuner> autotuner_;
  ServiceMetrics* const metrics_;  // never null: NoServiceMetrics at least
  const std::chrono::steady_clock::time_point started_;
  FallbackCounter fallbacks_;  // its lock is a leaf
  // --state-dir's files. Its lock is held for a whole write, never with
  // another: snapshots are copied under a job's lock and written after.
  // (SnapshotStore::Replace, an OpenSession with resume=replace, takes it
  // under mu_ and the replaced job's lock: nothing holding the store's lock
  // waits for either, and the rename must happen with the job's drop.)
  SnapshotStore snapshots_;
  // Marks (mark_store.h); its lock is a leaf.
  MarkStore marks_{options_.marks_per_job, options_.mark_bytes};
  mutable StepStats stats_;  // its lock is a leaf
  // A step's path (step_pipeline.h): messages in, work out, updates back.
  const std::unique_ptr<StepPipeline> pipeline_;

  // Lock order: mu_, then a job's mu() (job.h), then a leaf lock (the
  // reaper's, a StepStats', a StepSink's, a transport's); the snapshot
  // store's: see snapshots_ above (docs/design.md). (clang-14 cannot check an
  // order between locks of different objects, so ABSL_ACQUIRED_AFTER is not
  // used across them.) Every call takes mu_ (a Step message to find its
  // session), so nothing heavy runs under it or under a published job's
  // lock: a job's momentum allocation, cover check, region, and the
  // release of closed sessions and dropped jobs (Graveyard) happen with
  // neither held (service_open.cc; docs/design.md).
  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_job_serial_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::shared_ptr<Session>> sessions_
      ABSL_GUARDED_BY(mu_);
  // Closed sessions whose region may still be in use (CloseLocked adds them;
  // released ones are pruned there and by CloseSession). session id ->
  // its release.
  std::map<std::string, std::shared_ptr<RegionRelease>> closing_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // New jobs admitted and being made without mu_ (BuildJob, the cover
  // check, the region): their ids (another open of the id waits until the
  // job is published or abandoned) and their momentum bytes, which
  // --max-state-bytes counts as held.
  // By job id: the owner and reserved bytes of a job being created (quotas).
  struct Creating {
    std::string owner;
    uint64_t bytes = 0;
  };
  std::map<std::string, Creating> creating_ ABSL_GUARDED_BY(mu_);
  uint64_t creating_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Snapshots the next job of their id resumes from (LoadSnapshots, and
  // each idle job dropped with a snapshot), read by LoadPendingSnapshot.
  PendingSnapshots pending_ ABSL_GUARDED_BY(mu_);
  // StartReaper's thread; stopped first by the destructor.
  DeadlineThread reaper_;
  // ExpireUnattached's thread (attach_timeout_seconds > 0), started by the
  // constructor, kicked by each OpenSession; stopped by the destructor.
  DeadlineThread attach_reaper_;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SERVICE_H_
