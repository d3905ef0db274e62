// Marks (protocol minor 5; docs/protocol.md "Marks"): copies of a job's
// momentum at completed steps that its trainer checkpointed, so that a
// trainer restarted from the checkpoint of step N (at any world size)
// continues from exactly the momentum of step N (OpenSessionRequest
// resume_step = N).
//
// Contract of this store (the bookkeeping alone; no I/O: the files are
// SnapshotStore's, mark_files.cc):
// - A mark is (job id, completed step) -> the job's header of that step
//   (its owner, table, completed_steps) and its fp32 whole-matrix momentum
//   by parameter, in memory; or, found in --state-dir at start, only its
//   file's path (0 bytes in memory until it is resumed).
// - Per job at most `per_job` marks: adding one past it drops the job's
//   oldest (the one added first).
// - Daemon-wide, the marks' momentum in memory is at most `budget_bytes`:
//   adding one frees the oldest marks of any job (added first) until it
//   fits: a mark with a file keeps it and stays (on disk only, as if found
//   at start), one without is dropped. A mark larger than the whole budget is
//   RESOURCE_EXHAUSTED naming
//   --mark-bytes and the bytes asked, and nothing is dropped.
// - Adding a step already held replaces that mark (it becomes the newest):
//   a trainer that resumed at an earlier mark and reached the step again
//   has new momentum for it, and its new checkpoint of the step replaces
//   the old one; the old mark belonged to the run it abandoned. The old
//   mark is returned as dropped only when its file is not the new one's.
// - Every mark dropped (by count, by budget, DropJob) is returned with its
//   file's path, for the caller to remove.
// Thread-safe: its lock is a leaf (taken with the service's or a job's
// lock held, never the other way round).

#ifndef DMUON_SERVER_MARK_STORE_H_
#define DMUON_SERVER_MARK_STORE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/dmuon.pb.h"

namespace dmuon::server {

// One mark: its header, its momentum (empty when only on disk), its file
// ("" without --state-dir, or when its write failed).
struct Mark {
  v1::StateHeader header;
  std::vector<std::vector<float>> momentum;
  std::string path;
};

// The marks of one job, for MarkResponse and JobStatus.
struct MarkList {
  std::vector<int64_t> steps;  // oldest first (in the order added)
  uint64_t bytes = 0;          // their momentum in memory
};

class MarkStore {
 public:
  MarkStore(int per_job, uint64_t budget_bytes);
  MarkStore(const MarkStore&) = delete;
  MarkStore& operator=(const MarkStore&) = delete;

  // What Add did: the job's marks after it, whether the step was held
  // already (that mark replaced), and the marks it dropped (their files
  // are the caller's to remove).
  struct Added {
    MarkList list;
    bool existed = false;
    std::vector<Mark> dropped;  // header and path only (momentum freed)
  };
  // Keeps `mark` (header.completed_steps() is its step) of `job_id`.
  absl::StatusOr<Added> Add(const std::string& job_id, Mark mark)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A mark found on disk at start: its header and file, no momentum. Counts
  // against per_job (the oldest dropped first: returned), not the budget.
  std::vector<Mark> AddOnDisk(const std::string& job_id, Mark mark)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The bytes a mark of `momentum` holds in memory.
  static uint64_t BytesOf(const std::vector<std::vector<float>>& momentum);
  // RESOURCE_EXHAUSTED naming --mark-bytes when `bytes` exceed the budget.
  absl::Status CheckFits(uint64_t bytes) const;

  bool Has(const std::string& job_id, int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // A copy of the mark (its momentum too: the mark stays), or nullopt.
  std::optional<Mark> Get(const std::string& job_id, int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The mark's header alone (its owner, table, step), or nullopt.
  std::optional<v1::StateHeader> Header(const std::string& job_id,
                                        int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);
  MarkList List(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every job's list (Status).
  std::map<std::string, MarkList> All() const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the mark of `step` (one whose file cannot be read): returns it
  // (header and path), or nullopt when none is held.
  std::optional<Mark> Remove(const std::string& job_id, int64_t step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every mark of `job_id` (a new run of the id): returns them.
  std::vector<Mark> DropJob(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's marks' momentum bytes in memory.
  uint64_t total_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Held {
    Mark mark;
    uint64_t bytes = 0;
    uint64_t seq = 0;  // order added, daemon-wide
  };
  const Held* FindLocked(const std::string& job_id, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MarkList ListLocked(const std::string& job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the mark, its momentum freed; returns it (header, path).
  Mark RemoveLocked(const std::string& job_id, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's oldest mark while it has `per_job_` or more, dropped.
  void LimitCountLocked(const std::string& job_id, std::vector<Mark>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int per_job_;
  const uint64_t budget_;
  mutable absl::Mutex mu_;
  // job id -> step -> mark.
  std::map<std::string, std::map<int64_t, Held>> marks_ ABSL_GUARDED_BY(mu_);
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_MARK_STORE_H_
