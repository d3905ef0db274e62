// --state-dir snapshots: the file format, the atomic write, and the
// bookkeeping of snapshots waiting for their job to reopen.
//
// Snapshot file (one per job, <state-dir>/job-<hex(job id)>.dmst):
//   "DMUONST1" | u64 header length | StateHeader | per parameter, its fp32
//   momentum (row-major) | u32 CRC-32 (zlib) of everything before it.
// Written to a temporary file, fsynced, renamed over the old one, and the
// directory fsynced: a crash leaves the old or the new file, never a torn one.
// Read when a job of that id is next created (PendingSnapshots), not
// before: a daemon keeps no momentum in memory for jobs nobody reopens.
// Files are read a chunk (kSnapshotReadChunk) at a time, never whole: at
// start each is checked (its CRC) through one chunk buffer, and an open
// reads the momentum straight into its vectors, so a restart holds at most
// one chunk beyond the momentum of the jobs it reopens (snapshot_file.cc).

#ifndef DMUON_SERVER_SNAPSHOT_STORE_H_
#define DMUON_SERVER_SNAPSHOT_STORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/dmuon.pb.h"

namespace dmuon::server {

// A snapshot file's contents: its header (in a StateChunk) and momentum, by
// parameter.
struct SnapshotFile {
  v1::StateChunk head;
  std::vector<std::vector<float>> momentum;
};

// The most bytes a read of a snapshot file (SnapshotStore::Read, Check)
// holds beyond the momentum it returns: it reads this much at a time.
inline constexpr size_t kSnapshotReadChunk = size_t{1} << 20;

// The file's bytes of `header` and `momentum` (by parameter, fp32 row-major).
std::string EncodeSnapshot(
    const v1::StateHeader& header,
    const std::vector<const std::vector<float>*>& momentum);

// Writes `bytes` to the new file `tmp` and fsyncs it (the caller renames it
// into place); on failure UNAVAILABLE naming the file, and `tmp` is removed.
absl::Status WriteSynced(const std::string& tmp, const std::string& bytes);

// What went wrong with a snapshot (SnapshotStore's `failed` callback and
// the dmuon_snapshot_failures_total{kind} metric).
inline constexpr char kSnapshotWriteFailed[] = "write";  // I/O error
inline constexpr char kSnapshotStale[] = "stale";      // older than the file's
inline constexpr char kSnapshotCorrupt[] = "corrupt";  // moved aside

// The snapshot files of one directory. Thread-safe.
class SnapshotStore {
 public:
  // (kind, error) of a failure: one of the kinds above.
  using Failed = std::function<void(const char*, const absl::Status&)>;
  // `dir` empty: no snapshots (enabled() false; nothing else may be
  // called). `written` (may be empty) gets each write's duration in
  // seconds, with the store's lock held. `failed` (may be empty) gets each
  // failure, without the store's lock.
  SnapshotStore(std::string dir, std::function<void(double)> written,
                Failed failed = nullptr);

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  // <dir>/job-<hex(job id)>.dmst
  std::string PathOf(const std::string& job_id) const;
  // Where this process writes PathOf(job_id) before renaming it in place:
  // PathOf(job_id) + ".tmp-<pid>", unique per writing process (Scan reads
  // only .dmst names).
  std::string TempPathOf(const std::string& job_id) const;
  // <dir>/job-<hex(job id)>.dmst.prev: the job's previous snapshot. Each
  // write of a later step first keeps the file it replaces there (a hard
  // link renamed into place, so a crash leaves the old pair or the new one),
  // so the directory holds the job's last two snapshotted steps: a trainer
  // that never got the newest one's step_complete (the daemon died between
  // the write and the send) resumes from the one before (UsePrevious;
  // docs/protocol.md "Resume at a step"). Scan does not read it (not a
  // .dmst name); it is read, CRC and all, only when it is used.
  std::string PreviousPathOf(const std::string& job_id) const;

  // Atomically writes `bytes` (EncodeSnapshot) as the snapshot of job
  // `job_serial` taken after `completed_steps`. Writes are serialized, and
  // one older than a snapshot of the same job (serial) already written is
  // skipped (OK): a --snapshot-every write, the idle drop and the shutdown
  // snapshot may race, and the file must end with the newest state. One
  // older than the file of the id written by another serial, or found by
  // Scan, is refused (FAILED_PRECONDITION, kind "stale"): a newer snapshot
  // is never replaced by an older state. A failed write removes its
  // temporary file (kind "write").
  absl::Status Write(const std::string& job_id, uint64_t job_serial,
                     int64_t completed_steps, const std::string& bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A snapshot file that cannot be used (`why`): renamed to
  // `<path>.corrupt-<UTC time>` (never overwritten or deleted), recorded
  // (errors(), kind "corrupt"). Returns the new path, or the rename's error
  // (the file then stays where it is).
  absl::StatusOr<std::string> MoveAside(const std::string& path,
                                        const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The snapshot of `job_id` is discarded (OpenSession with resume=replace,
  // docs/protocol.md "Resume"): its file, if there is one, is renamed to
  // `<path>.replaced-<UTC time>` (kept for the operator to delete, never
  // read again: Scan takes only `.dmst` names), the id's newest write is
  // forgotten, and from now on writes of the id by a job serial below
  // `first_serial` (the replaced job's: an idle drop or shutdown snapshot in
  // flight) are skipped (OK) so that they cannot bring the old state back.
  // Its previous file (PreviousPathOf) is removed: an older copy of the
  // discarded state, which no resume may bring back.
  // Returns the new path, "" when there was no file, or FAILED_PRECONDITION
  // when the file could not be renamed (nothing changed then).
  absl::StatusOr<std::string> Replace(const std::string& job_id,
                                      uint64_t first_serial)
      ABSL_LOCKS_EXCLUDED(mu_);
  // An explicit restore (SetState) of job `job_serial` to
  // `completed_steps`: when the file of `job_id` holds a later step (an
  // earlier run, or this job before the restore), the restored state
  // replaces it now, older or not: `bytes()` (EncodeSnapshot of the
  // restored state) is written atomically, and the file it replaces is
  // kept as `<path>.rolled-back-<UTC time>` (a hard link made before the
  // rename: never read again, kept for the operator). From then on the
  // automatic snapshots of this job continue from the restored step (the
  // rule that an older state never replaces a newer one applies again
  // from there), and the previous file (of the rolled-back run) is removed.
  // Nothing is written when the file is not newer (the next automatic snapshot
  // writes the restored state as usual). Returns the path the newer file was
  // kept as, "" when none; a failed write is an error (kind "write") and leaves
  // the newer file in place. Called with the job's lock held, so that no step
  // of it runs meanwhile.
  absl::StatusOr<std::string> Restore(
      const std::string& job_id, uint64_t job_serial, int64_t completed_steps,
      const std::function<absl::StatusOr<std::string>()>& bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The job's previous snapshot (PreviousPathOf) becomes its snapshot, if it
  // holds `completed_steps` of `job_id` owned by `owner` (the snapshot's
  // owner) and reads back whole (CRC checked before anything is renamed): the
  // newer file it replaces is kept as `<path>.rolled-back-<UTC time>` (never
  // read again, kept for the operator, as Restore keeps one), and from then on
  // the job's snapshots continue from that step. Returns the path the newer
  // file was kept as
  // ("" when there was none); NOT_FOUND naming the previous file's step when
  // it does not hold that step or there is none; UNAVAILABLE when a rename
  // failed (nothing changed then).
  absl::StatusOr<std::string> UsePrevious(const std::string& job_id,
                                          int64_t completed_steps,
                                          const std::string& owner)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks (mark_store.h; docs/protocol.md "Marks") as files (mark_files.cc),
  // in the snapshot format: <PathOf(job id)>.mark-<step> (Scan skips them:
  // not a .dmst name).
  std::string MarkPathOf(const std::string& job_id, int64_t step) const;
  // Writes a mark's `bytes` (EncodeSnapshot) atomically and durably (a
  // temporary file fsynced, renamed, the directory fsynced) before it
  // returns. A failure is recorded in errors() (kind "write") and
  // returned; nothing is left behind.
  absl::Status WriteMark(const std::string& job_id, int64_t step,
                         const std::string& bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes a mark's file (a mark dropped); a failure other than "gone" is
  // recorded in errors(). Takes no lock but errors()' (a leaf): callable
  // with the service's lock held.
  void RemoveMark(const std::string& path);
  // The mark files of the directory, each read as far as its header (the
  // momentum is read, CRC and all, only when the mark is resumed: Read).
  // One whose header cannot be read or is not its name's job and step is
  // moved aside (MoveAside) and left out.
  struct MarkFile {
    std::string job_id;
    v1::StateHeader header;
    std::string path;
  };
  std::vector<MarkFile> ScanMarks() ABSL_LOCKS_EXCLUDED(mu_);

  // The last failures (at most kMaxErrors, oldest first), for Status, each
  // with the job it concerns ("" when a file's name names none), so that
  // whoever may not see a job's id does not see its errors either.
  struct Error {
    std::string job_id;
    std::string message;
  };
  static constexpr size_t kMaxErrors = 32;
  std::vector<Error> errors() const ABSL_LOCKS_EXCLUDED(errors_mu_);
  // The job whose file `path` is by its name (<dir>/job-<hex>.dmst, with
  // any suffix MoveAside adds): "" when the name holds no job id.
  static std::string JobOfPath(const std::string& path);

  // Reads and checks one snapshot file: NOT_FOUND when it does not exist,
  // DATA_LOSS naming the file and what is wrong with it otherwise.
  // Only a regular file is read (opened without following a link or
  // blocking on a FIFO), and only when its size is the one its header
  // declares (checked before anything is allocated: the momentum allocated
  // is at most the file's size). The momentum is read `chunk` bytes at a
  // time straight into its vectors, the CRC computed as it goes; a CRC
  // that does not match at the end discards it. A completed_steps outside
  // [0, kMaxCompletedSteps] is DATA_LOSS too (so Scan moves such a file
  // aside and lists it). A file damaged so that its header is unreadable
  // or inconsistent is reported as a checksum mismatch when it is at most
  // 64 MiB (larger ones are refused on the header alone, unread).
  static absl::StatusOr<SnapshotFile> Read(const std::string& path,
                                           size_t chunk = kSnapshotReadChunk);
  // Read's checks without keeping the momentum: the file is checksummed
  // through one buffer of `chunk` bytes. Its header when it is good.
  static absl::StatusOr<v1::StateHeader> Check(
      const std::string& path, size_t chunk = kSnapshotReadChunk);
  // The header of the snapshot file at `path` alone (preamble and header
  // read, the file's size checked against it; its momentum and CRC are
  // not read): what an open may check before the whole file is read.
  static absl::StatusOr<v1::StateHeader> ReadHeader(const std::string& path);

  // Every snapshot file of the directory, each checked (Check: its CRC, a
  // chunk at a time; no momentum is kept).
  struct ScanResult {
    std::vector<std::pair<std::string, std::string>> good;  // (job id, path)
    std::vector<v1::StateHeader> headers;  // of each of `good`, in order
    // DATA_LOSS for the first bad one (the others are still listed).
    absl::Status first_error;
    // Each bad one is moved aside (MoveAside): job id (by its file's name)
    // -> what happened, for that job's next open.
    std::map<std::string, std::string> moved_aside;
  };
  // FAILED_PRECONDITION when the directory cannot be read.
  absl::StatusOr<ScanResult> Scan() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status WriteLocked(const std::string& job_id, uint64_t job_serial,
                           int64_t completed_steps, const std::string& bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before a write of `completed_steps` replaces the file of `job_id`: that
  // file becomes the previous one, unless it holds the same step (an idle
  // drop rewriting the step just snapshotted keeps the step before).
  // Without a current file, or where no hard link can be made, the previous
  // file is removed instead (the latter recorded in errors()).
  void KeepPreviousLocked(const std::string& job_id, int64_t completed_steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // fsyncs the directory: a rename in it survives a crash.
  void SyncDir() const;
  void Record(const std::string& job_id, const absl::Status& st)
      ABSL_LOCKS_EXCLUDED(errors_mu_);

  const std::string dir_;
  const std::function<void(double)> written_;
  const Failed failed_;
  // Held for a whole write, and taken with no other lock held (only
  // `written_`'s own lock nests inside it), except by Restore (SetState),
  // which holds its job's lock: the store never takes a job's lock.
  mutable absl::Mutex mu_;
  // By job id: the serial that wrote its file last (0: found by Scan) and
  // that file's completed steps.
  std::map<std::string, std::pair<uint64_t, int64_t>> newest_
      ABSL_GUARDED_BY(mu_);
  // By job id: the first job serial whose writes count (Replace); writes by
  // older serials are skipped.
  std::map<std::string, uint64_t> replaced_ ABSL_GUARDED_BY(mu_);
  // A leaf (taken inside mu_ too): Status reads it without waiting for a
  // write in progress.
  mutable absl::Mutex errors_mu_;
  std::vector<Error> errors_ ABSL_GUARDED_BY(errors_mu_);
};

// Snapshots that the next job of their id resumes from: first a file to
// read (every file found at start, and each idle job dropped with a
// snapshot), then, once read, its contents until the job is made. Not
// thread-safe: the service guards it with its own lock, under which it
// also decides whether the job exists.
// What Status lists of a job that is only a snapshot file.
struct SnapshotSummary {
  int64_t completed_steps = 0;
  int parameters = 0;
  uint64_t state_bytes = 0;  // its fp32 momentum
  std::string owner;         // StateHeader.owner
};
SnapshotSummary Summarize(const v1::StateHeader& header);

class PendingSnapshots {
 public:
  // The next job `job_id` resumes from the file at `path`, described by
  // `summary` until it is read.
  void AddFile(const std::string& job_id, const std::string& path,
               SnapshotSummary summary = {});
  // The jobs that are only a file (added, not read): their summaries.
  std::map<std::string, SnapshotSummary> OnDisk() const;
  // Whether the file of `job_id` is being read (StartRead without
  // FinishRead yet): a second reader waits for it.
  bool reading(const std::string& job_id) const {
    return reading_.count(job_id) > 0;
  }
  // Whether `job_id` has a file not read yet (StartRead would return it).
  bool unread(const std::string& job_id) const {
    return files_.count(job_id) > 0;
  }
  // The path to read for `job_id` (now marked being read), or nothing when
  // there is no file or it was read already.
  std::optional<std::string> StartRead(const std::string& job_id);
  // The outcome of reading `path` for `job_id`: kept for Find and Take.
  // OK as well when the file was gone (forgotten: the job starts afresh);
  // DATA_LOSS when it could not be read or is of another job (the job must
  // not silently restart from zero).
  absl::Status FinishRead(const std::string& job_id, const std::string& path,
                          absl::StatusOr<SnapshotFile> file);
  // Forgets the file of `job_id` at `path` (moved aside: the job starts
  // afresh).
  void Forget(const std::string& job_id, const std::string& path);
  // Forgets everything of `job_id`: its file to read and its contents read
  // (the job is replaced: SnapshotStore::Replace). Not while it is being
  // read (reading()).
  void Drop(const std::string& job_id);
  // Ends a StartRead whose file was not read (the open was refused on its
  // header alone): the file stays pending.
  void AbortRead(const std::string& job_id) { reading_.erase(job_id); }
  // The snapshot read for `job_id`, or null.
  const SnapshotFile* Find(const std::string& job_id) const;
  // Removes and returns the snapshot read for `job_id` (Find not null).
  SnapshotFile Take(const std::string& job_id);

  // Opens of `job_id` in flight: a snapshot read for one of them is kept
  // only while one is, and for the job it makes. EndOpen returns whether
  // it ended the last one; then, unless the job was made, Unload.
  void BeginOpen(const std::string& job_id) { ++opening_[job_id]; }
  bool EndOpen(const std::string& job_id);
  // Forgets the contents read for `job_id` but not its file, which the
  // next open reads again: memory is held only for an open that succeeds.
  void Unload(const std::string& job_id);

  // A snapshot of `job_id` that could not be used was moved aside
  // (`notice`: what, why and where to): the next job of the id starts from
  // zero momentum, and its first open says so (TakeMovedAside).
  void AddMovedAside(const std::string& job_id, std::string notice) {
    moved_aside_[job_id] = std::move(notice);
  }
  // The notice of `job_id` (then forgotten), or "".
  std::string TakeMovedAside(const std::string& job_id);
  // The notice of `job_id` (kept), or "".
  std::string MovedAside(const std::string& job_id) const;

 private:
  std::map<std::string, std::string> files_;  // job id -> path, not read
  std::map<std::string, SnapshotSummary> summaries_;  // of files_' jobs
  std::set<std::string> reading_;                     // job ids being read
  std::map<std::string, SnapshotFile> read_;          // job id -> contents
  std::map<std::string, std::string> read_from_;      // job id -> its path
  std::map<std::string, int> opening_;              // job id -> opens in flight
  std::map<std::string, std::string> moved_aside_;  // job id -> notice
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SNAPSHOT_STORE_H_
