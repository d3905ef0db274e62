// Marks as --state-dir files (SnapshotStore::WriteMark, RemoveMark,
// ScanMarks; the bookkeeping is MarkStore's, mark_store.h): one file per
// mark, <dir>/job-<hex(job id)>.dmst.mark-<step>, in the snapshot file
// format (snapshot_store.h: header, momentum, CRC), written as atomically
// and durably as a snapshot.

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/snapshot_store.h"

namespace dmuon::server {
namespace {

constexpr char kMarkInfix[] = ".dmst.mark-";

// The step a mark file's name `name` carries, or -1 when it is not one.
int64_t StepOfMarkName(const std::string& name) {
  const size_t at = name.find(kMarkInfix);
  if (name.rfind("job-", 0) != 0 || at == std::string::npos) return -1;
  int64_t step = 0;
  if (!absl::SimpleAtoi(name.substr(at + sizeof(kMarkInfix) - 1), &step) ||
      step < 1) {
    return -1;
  }
  return step;
}

}  // namespace

std::string SnapshotStore::MarkPathOf(const std::string& job_id,
                                      int64_t step) const {
  return absl::StrCat(PathOf(job_id), ".mark-", step);
}

absl::Status SnapshotStore::WriteMark(const std::string& job_id, int64_t step,
                                      const std::string& bytes) {
  const std::string path = MarkPathOf(job_id, step);
  const std::string tmp = absl::StrCat(path, ".tmp-", ::getpid());
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    st = WriteSynced(tmp, bytes);
    if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
      st = absl::UnavailableError(
          absl::StrCat("mark: cannot commit ", path, ": ", strerror(errno)));
      ::unlink(tmp.c_str());
    }
    if (st.ok()) SyncDir();
  }
  if (!st.ok()) {
    Record(job_id, st);
    if (failed_) failed_(kSnapshotWriteFailed, st);
  }
  return st;
}

void SnapshotStore::RemoveMark(const std::string& path) {
  // Without mu_ (nothing it guards changes): a caller holding the
  // service's lock never waits for a snapshot being written.
  if (path.empty()) return;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    Record(JobOfPath(path), absl::UnavailableError(absl::StrCat(
                                "mark dropped but its file ", path,
                                " could not be removed: ", strerror(errno))));
    return;
  }
  SyncDir();
}

std::vector<SnapshotStore::MarkFile> SnapshotStore::ScanMarks() {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (StepOfMarkName(n) > 0) names.push_back(n);
    }
    ::closedir(d);
  }
  std::vector<MarkFile> out;
  for (const std::string& n : names) {
    const std::string path = absl::StrCat(dir_, "/", n);
    auto head = ReadHeader(path);
    absl::Status bad = head.status();
    if (head.ok() &&
        MarkPathOf(head->job_id(), head->completed_steps()) != path) {
      bad = absl::DataLossError(
          absl::StrCat("mark ", path, " holds step ", head->completed_steps(),
                       " of job '", head->job_id(), "', whose file is ",
                       MarkPathOf(head->job_id(), head->completed_steps())));
    }
    if (absl::IsNotFound(bad)) continue;  // removed meanwhile
    if (!bad.ok()) {
      (void)MoveAside(path, bad);
      continue;
    }
    out.push_back({head->job_id(), *std::move(head), path});
  }
  return out;
}

}  // namespace dmuon::server
