#include "server/snapshot_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace dmuon::server {
namespace {

// `<path><suffix><UTC time>`, with "-N" added until the name is free: where
// a file the daemon stops using is kept (never overwritten, never deleted).
std::string StampedName(const std::string& path, const char* suffix) {
  const std::string stamp =
      absl::FormatTime("%Y%m%dT%H%M%SZ", absl::Now(), absl::UTCTimeZone());
  std::string to = absl::StrCat(path, suffix, stamp);
  struct stat st;
  for (int n = 1; ::lstat(to.c_str(), &st) == 0; ++n)
    to = absl::StrCat(path, suffix, stamp, "-", n);
  return to;
}

}  // namespace

absl::Status WriteSynced(const std::string& tmp, const std::string& bytes) {
  // Nothing half-written stays behind: the temporary file goes on failure.
  auto fail = [&tmp](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("snapshot: ", what, ": ", strerror(err)));
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return fail(absl::StrCat("cannot create ", tmp), errno);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      ::close(fd);
      return fail(absl::StrCat("writing ", tmp), err);
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_err = errno;
  ::close(fd);
  if (!synced) return fail(absl::StrCat("cannot sync ", tmp), sync_err);
  return absl::OkStatus();
}

SnapshotStore::SnapshotStore(std::string dir,
                             std::function<void(double)> written, Failed failed)
    : dir_(std::move(dir)),
      written_(std::move(written)),
      failed_(std::move(failed)) {}

void SnapshotStore::Record(const std::string& job_id, const absl::Status& st) {
  absl::MutexLock lock(&errors_mu_);
  if (errors_.size() == kMaxErrors) errors_.erase(errors_.begin());
  errors_.push_back({job_id, std::string(st.message())});
}

std::string SnapshotStore::JobOfPath(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string name =
      path.substr(slash == std::string::npos ? 0 : slash + 1);
  const size_t end = name.find(".dmst");
  if (name.rfind("job-", 0) != 0 || end == std::string::npos) return "";
  const std::string hex = name.substr(4, end - 4);
  if (hex.size() % 2 != 0 ||
      hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
    return "";
  }
  return absl::HexStringToBytes(hex);
}

std::vector<SnapshotStore::Error> SnapshotStore::errors() const {
  absl::MutexLock lock(&errors_mu_);
  return errors_;
}

absl::StatusOr<std::string> SnapshotStore::MoveAside(const std::string& path,
                                                     const absl::Status& why) {
  absl::StatusOr<std::string> out;
  absl::Status report;
  {
    absl::MutexLock lock(&mu_);
    const std::string to = StampedName(path, ".corrupt-");
    if (::rename(path.c_str(), to.c_str()) != 0) {
      out = absl::DataLossError(absl::StrCat(
          why.message(), "; could not be moved aside to ", to, " (",
          strerror(errno), "): left in place, move it away by hand"));
      report = out.status();
    } else {
      out = to;
      report = absl::DataLossError(
          absl::StrCat(why.message(), "; moved aside to ", to));
      for (auto it = newest_.begin(); it != newest_.end();) {
        it = PathOf(it->first) == path ? newest_.erase(it) : std::next(it);
      }
    }
    Record(JobOfPath(path), report);
  }
  if (failed_) failed_(kSnapshotCorrupt, report);
  return out;
}

absl::StatusOr<std::string> SnapshotStore::Replace(const std::string& job_id,
                                                   uint64_t first_serial) {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(job_id);
  std::string to;
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    to = StampedName(path, ".replaced-");
    if (::rename(path.c_str(), to.c_str()) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job_id, "' cannot be replaced: its snapshot ", path,
          " could not be moved aside to ", to, " (", strerror(errno),
          "); move it away by hand and open the job again"));
    }
  }
  ::unlink(PreviousPathOf(job_id).c_str());
  newest_.erase(job_id);
  uint64_t& first = replaced_[job_id];
  first = std::max(first, first_serial);
  return to;
}

absl::StatusOr<std::string> SnapshotStore::Restore(
    const std::string& job_id, uint64_t job_serial, int64_t completed_steps,
    const std::function<absl::StatusOr<std::string>()>& bytes) {
  absl::Status st;
  std::string kept;
  {
    absl::MutexLock lock(&mu_);
    const std::string path = PathOf(job_id);
    auto it = newest_.find(job_id);
    struct stat sb;
    if (it == newest_.end() || it->second.second <= completed_steps ||
        ::stat(path.c_str(), &sb) != 0) {
      return std::string();  // not newer: the next snapshot writes as usual
    }
    auto encoded = bytes();
    if (!encoded.ok()) return encoded.status();
    kept = StampedName(path, ".rolled-back-");
    if (::link(path.c_str(), kept.c_str()) != 0) {
      st = absl::UnavailableError(absl::StrCat(
          "snapshot: restore of job '", job_id, "' to step ", completed_steps,
          ": cannot keep ", path, " as ", kept, ": ", strerror(errno)));
    } else {
      const auto newer = it->second;
      newest_.erase(it);  // the explicit restore may go back
      // Not kept as the previous file: the rolled-back file is kept already,
      // and the previous one (of the same rolled-back run) goes.
      st = WriteLocked(job_id, job_serial, completed_steps, *encoded);
      ::unlink(PreviousPathOf(job_id).c_str());
      if (!st.ok()) {  // the newer file stayed, and stays protected
        ::unlink(kept.c_str());
        newest_[job_id] = newer;
      }
    }
    if (!st.ok()) Record(job_id, st);
  }
  if (!st.ok()) {
    if (failed_) failed_(kSnapshotWriteFailed, st);
    return st;
  }
  return kept;
}

std::string SnapshotStore::PathOf(const std::string& job_id) const {
  return absl::StrCat(dir_, "/job-", absl::BytesToHexString(job_id), ".dmst");
}

void SnapshotStore::SyncDir() const {
  int dir = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

std::string SnapshotStore::PreviousPathOf(const std::string& job_id) const {
  return absl::StrCat(PathOf(job_id), ".prev");
}

void SnapshotStore::KeepPreviousLocked(const std::string& job_id,
                                       int64_t completed_steps) {
  if (auto it = newest_.find(job_id);
      it != newest_.end() && it->second.second == completed_steps) {
    return;  // the same step again: the previous one stays
  }
  const std::string path = PathOf(job_id);
  const std::string previous = PreviousPathOf(job_id);
  const std::string tmp = absl::StrCat(previous, ".tmp-", ::getpid());
  ::unlink(tmp.c_str());
  // No current file (the job's first, or one moved aside): a previous file
  // left is of another run of the id, never to be resumed. Where a link
  // cannot be made (a file system without hard links) the write goes on
  // without a previous file, and Status says so.
  int err = 0;
  if (::link(path.c_str(), tmp.c_str()) != 0) {
    err = errno;
  } else if (::rename(tmp.c_str(), previous.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
  }
  if (err == 0) return;
  ::unlink(previous.c_str());
  if (err != ENOENT) {
    Record(job_id, absl::UnavailableError(absl::StrCat(
                       "snapshot: cannot keep ", path, " as ", previous, " (",
                       strerror(err),
                       "): resume_step can resume only its newest step")));
  }
}

absl::StatusOr<std::string> SnapshotStore::UsePrevious(
    const std::string& job_id, int64_t completed_steps,
    const std::string& owner) {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(job_id);
  const std::string previous = PreviousPathOf(job_id);
  // Checked whole (CRC) before it replaces a good file.
  auto head = Check(previous);
  if (!head.ok()) {
    return absl::NotFoundError(
        absl::IsNotFound(head.status())
            ? std::string("no previous snapshot")
            : absl::StrCat("its previous snapshot ", previous,
                           " cannot be used: ", head.status().message()));
  }
  if (head->job_id() != job_id || head->owner() != owner) {
    return absl::NotFoundError(absl::StrCat("its previous snapshot ", previous,
                                            " is of another job or owner"));
  }
  if (head->completed_steps() != completed_steps) {
    return absl::NotFoundError(
        absl::StrCat("its previous snapshot ", previous, " holds step ",
                     head->completed_steps(),
                     head->job_id() != job_id
                         ? absl::StrCat(" of job '", head->job_id(), "'")
                         : ""));
  }
  std::string kept;
  struct stat sb;
  if (::lstat(path.c_str(), &sb) == 0) {
    kept = StampedName(path, ".rolled-back-");
    if (::link(path.c_str(), kept.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat(
          "snapshot: cannot keep ", path, " as ", kept, ": ", strerror(errno)));
    }
  }
  if (::rename(previous.c_str(), path.c_str()) != 0) {
    const int err = errno;
    if (!kept.empty()) ::unlink(kept.c_str());
    return absl::UnavailableError(absl::StrCat("snapshot: cannot make ",
                                               previous, " the snapshot ", path,
                                               ": ", strerror(err)));
  }
  SyncDir();
  newest_[job_id] = {0, completed_steps};
  return kept;
}

std::string SnapshotStore::TempPathOf(const std::string& job_id) const {
  // Unique per writer: never another process's half-written file (the
  // directory is one daemon's, daemon/state_dir.h; this keeps it so even
  // for a tool writing beside it).
  return absl::StrCat(PathOf(job_id), ".tmp-", ::getpid());
}

absl::Status SnapshotStore::Write(const std::string& job_id,
                                  uint64_t job_serial, int64_t completed_steps,
                                  const std::string& bytes) {
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    st = WriteLocked(job_id, job_serial, completed_steps, bytes);
    if (!st.ok()) Record(job_id, st);
  }
  if (!st.ok() && failed_) {
    failed_(
        absl::IsFailedPrecondition(st) ? kSnapshotStale : kSnapshotWriteFailed,
        st);
  }
  return st;
}

absl::Status SnapshotStore::WriteLocked(const std::string& job_id,
                                        uint64_t job_serial,
                                        int64_t completed_steps,
                                        const std::string& bytes) {
  const std::string path = PathOf(job_id);
  if (auto r = replaced_.find(job_id);
      r != replaced_.end() && job_serial < r->second) {
    return absl::OkStatus();  // a replaced job's late write (Replace)
  }
  if (auto it = newest_.find(job_id);
      it != newest_.end() && it->second.second > completed_steps) {
    if (it->second.first == job_serial)
      return absl::OkStatus();  // a newer state of this job is on disk already
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "snapshot of job '", job_id, "' at step ", completed_steps,
          " not written: ", path, " holds step ", it->second.second,
          " (an earlier run of the job), and a newer snapshot is never "
          "replaced by an older state; move that file aside to snapshot this "
          "job"));
    }
    newest_.erase(it);  // removed by the operator
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string tmp = TempPathOf(job_id);
  if (auto st = WriteSynced(tmp, bytes); !st.ok()) return st;
  KeepPreviousLocked(job_id, completed_steps);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("snapshot: cannot commit ", path, ": ", strerror(err)));
  }
  SyncDir();
  newest_[job_id] = {job_serial, completed_steps};
  if (written_) {
    written_(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  return absl::OkStatus();
}

absl::StatusOr<SnapshotStore::ScanResult> SnapshotStore::Scan() {
  DIR* d = ::opendir(dir_.c_str());
  if (!d) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir ", dir_, ": ", strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.rfind("job-", 0) == 0 &&
        n.substr(n.size() - 5) == ".dmst")
      names.push_back(n);
  }
  ::closedir(d);
  ScanResult result;
  for (const std::string& n : names) {
    const std::string path = absl::StrCat(dir_, "/", n);
    // Checked whole (its checksum) a chunk at a time; its momentum is read
    // again, into the job, only when the job is reopened.
    auto head = Check(path);
    absl::Status bad = head.status();
    if (head.ok() && PathOf(head->job_id()) != path) {
      bad = absl::DataLossError(
          absl::StrCat("snapshot ", path, " holds job '", head->job_id(),
                       "', whose file is ", PathOf(head->job_id())));
    }
    if (!bad.ok()) {
      if (absl::IsNotFound(bad)) continue;  // removed meanwhile
      auto moved = MoveAside(path, bad);
      if (moved.ok()) {
        if (const std::string job = JobOfPath(path); !job.empty()) {
          result.moved_aside[job] = absl::StrCat(
              "its snapshot found at dmuond's start could not be used (",
              bad.message(), ") and was moved aside to ", *moved);
        }
      }
      if (result.first_error.ok()) {
        result.first_error = absl::DataLossError(absl::StrCat(
            bad.message(), "; ",
            moved.ok() ? absl::StrCat("moved aside to ", *moved,
                                      " (its job starts from zero momentum "
                                      "when reopened)")
                       : std::string(moved.status().message())));
      }
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      newest_[head->job_id()] = {0, head->completed_steps()};
    }
    result.good.emplace_back(head->job_id(), path);
    result.headers.push_back(*std::move(head));
  }
  return result;
}

SnapshotSummary Summarize(const v1::StateHeader& header) {
  SnapshotSummary s;
  s.completed_steps = header.completed_steps();
  s.parameters = header.parameters_size();
  for (const auto& p : header.parameters()) {
    if (p.shape_size() == 2 && p.shape(0) > 0 && p.shape(1) > 0) {
      s.state_bytes += static_cast<uint64_t>(p.shape(0)) *
                       static_cast<uint64_t>(p.shape(1)) * sizeof(float);
    }
  }
  s.owner = header.owner();
  return s;
}

void PendingSnapshots::AddFile(const std::string& job_id,
                               const std::string& path,
                               SnapshotSummary summary) {
  files_[job_id] = path;
  summaries_[job_id] = std::move(summary);
}

std::string PendingSnapshots::TakeMovedAside(const std::string& job_id) {
  auto it = moved_aside_.find(job_id);
  if (it == moved_aside_.end()) return "";
  std::string notice = std::move(it->second);
  moved_aside_.erase(it);
  return notice;
}

std::string PendingSnapshots::MovedAside(const std::string& job_id) const {
  auto it = moved_aside_.find(job_id);
  return it == moved_aside_.end() ? "" : it->second;
}

std::map<std::string, SnapshotSummary> PendingSnapshots::OnDisk() const {
  std::map<std::string, SnapshotSummary> out;
  for (const auto& [job_id, path] : files_) {
    auto it = summaries_.find(job_id);
    out[job_id] = it == summaries_.end() ? SnapshotSummary{} : it->second;
  }
  return out;
}

std::optional<std::string> PendingSnapshots::StartRead(
    const std::string& job_id) {
  auto it = files_.find(job_id);
  if (it == files_.end() || read_.count(job_id)) return std::nullopt;
  reading_.insert(job_id);
  return it->second;
}

absl::Status PendingSnapshots::FinishRead(const std::string& job_id,
                                          const std::string& path,
                                          absl::StatusOr<SnapshotFile> file) {
  reading_.erase(job_id);
  if (!file.ok()) {
    if (absl::IsNotFound(file.status())) {
      // Removed by the operator: the job starts afresh.
      if (auto f = files_.find(job_id); f != files_.end() && f->second == path)
        files_.erase(f);
      return absl::OkStatus();
    }
    return absl::DataLossError(
        absl::StrCat("job '", job_id,
                     "' has a snapshot in --state-dir that cannot be read (",
                     file.status().message(), "); remove ", path,
                     " to start the job from zero momentum, or fix it"));
  }
  if (file->head.header().job_id() != job_id) {
    return absl::DataLossError(absl::StrCat(
        "snapshot ", path, " is of job '", file->head.header().job_id(),
        "', not '", job_id, "'; remove it to start the job from zero"));
  }
  files_.erase(job_id);
  read_[job_id] = std::move(*file);
  read_from_[job_id] = path;
  return absl::OkStatus();
}

void PendingSnapshots::Forget(const std::string& job_id,
                              const std::string& path) {
  if (auto f = files_.find(job_id); f != files_.end() && f->second == path)
    files_.erase(f);
}

void PendingSnapshots::Drop(const std::string& job_id) {
  files_.erase(job_id);
  read_.erase(job_id);
  read_from_.erase(job_id);
}

bool PendingSnapshots::EndOpen(const std::string& job_id) {
  auto it = opening_.find(job_id);
  if (it == opening_.end() || --it->second > 0) return false;
  opening_.erase(it);
  return true;
}

void PendingSnapshots::Unload(const std::string& job_id) {
  auto from = read_from_.find(job_id);
  if (from == read_from_.end()) return;
  files_[job_id] = from->second;
  read_from_.erase(from);
  read_.erase(job_id);
}

const SnapshotFile* PendingSnapshots::Find(const std::string& job_id) const {
  auto it = read_.find(job_id);
  return it == read_.end() ? nullptr : &it->second;
}

SnapshotFile PendingSnapshots::Take(const std::string& job_id) {
  auto it = read_.find(job_id);
  SnapshotFile out = std::move(it->second);
  read_.erase(it);
  read_from_.erase(job_id);
  return out;
}

}  // namespace dmuon::server
