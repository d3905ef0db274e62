#include "server/snapshot_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/limits.h"

namespace dmuon::server {
namespace {

constexpr char kMagic[] = "DMUONST1";

// Reads `n` bytes at `off` of `fd` whole; false on a short read or error.
bool ReadAt(int fd, uint64_t off, char* out, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, out, n, static_cast<off_t>(off));
    if (r <= 0) return false;
    out += r;
    off += static_cast<uint64_t>(r);
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

// Files up to this size are read whole even when their header is damaged,
// so that random damage is reported as a checksum mismatch.
constexpr uint64_t kSmallFile = uint64_t{64} << 20;

// OK when `fd` (`size` bytes) is as long as its header declares: magic,
// header length, header, the momentum of its parameters' shapes, the CRC.
// Reads at most the preamble and the header; every product and sum is
// checked for overflow.
absl::Status CheckDeclaredSize(int fd, uint64_t size,
                               v1::StateHeader* header = nullptr) {
  char head[16];
  if (size < 20 || !ReadAt(fd, 0, head, 16) ||
      std::memcmp(head, kMagic, 8) != 0) {
    return absl::DataLossError("not a dmuon snapshot");
  }
  uint64_t len;
  std::memcpy(&len, head + 8, 8);
  std::string bytes(len <= size - 20 && len <= (1u << 30) ? len : 0, '\0');
  v1::StateHeader h;
  if (bytes.size() != len || !ReadAt(fd, 16, bytes.data(), len) ||
      !h.ParseFromArray(bytes.data(), static_cast<int>(len))) {
    return absl::DataLossError("unreadable header");
  }
  uint64_t total = 16 + len + 4;
  for (const auto& p : h.parameters()) {
    if (p.shape_size() != 2 || p.shape(0) <= 0 || p.shape(1) <= 0) {
      return absl::DataLossError(
          absl::StrCat("parameter '", p.name(), "' has no [rows, cols] shape"));
    }
    uint64_t n = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(p.shape(0)),
                               static_cast<uint64_t>(p.shape(1)), &n) ||
        __builtin_mul_overflow(n, uint64_t{4}, &n) ||
        __builtin_add_overflow(total, n, &total) || total > size) {
      return absl::DataLossError(
          absl::StrCat("truncated momentum (parameter '", p.name(),
                       "' of shape [", p.shape(0), ", ", p.shape(1), "])"));
    }
  }
  if (total != size) {
    return absl::DataLossError(absl::StrCat("its size, ", size,
                                            " bytes, is more than the ", total,
                                            " its header declares"));
  }
  if (header != nullptr) *header = std::move(h);
  return absl::OkStatus();
}

// `path` opened for reading as a regular file, without following a link
// or blocking on a FIFO; -1 with `*error` set otherwise.
int OpenRegular(const std::string& path, absl::Status* error) {
  const int fd =
      ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    *error = errno == ENOENT ? absl::NotFoundError("gone")
             : errno == ELOOP
                 ? absl::DataLossError("a symbolic link, not a snapshot file")
                 : absl::DataLossError(
                       absl::StrCat("cannot open it: ", strerror(errno)));
  }
  return fd;
}

// The bytes of a regular file, read whole only when its size is the one its
// header declares (or it is small): a FIFO, a device or a sparse file far
// larger than its header says is refused before its contents are read.
absl::StatusOr<std::string> ReadDeclared(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::DataLossError(
        absl::StrCat("cannot stat it: ", strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return absl::DataLossError("not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const absl::Status declared = CheckDeclaredSize(fd, size);
  if (!declared.ok() && size > kSmallFile) return declared;
  std::string data(size, '\0');
  if (!ReadAt(fd, 0, data.data(), size))
    return absl::DataLossError("cannot read it");
  if (declared.ok() || size < 20) return data;
  uint32_t crc;
  std::memcpy(&crc, data.data() + size - 4, 4);
  const bool intact =
      crc == static_cast<uint32_t>(
                 crc32(0L, reinterpret_cast<const Bytef*>(data.data()),
                       static_cast<uInt>(size - 4)));
  // Damaged: Parse names the checksum; intact but inconsistent: crafted.
  if (!intact) return data;
  return declared;
}

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

std::string EncodeSnapshot(
    const v1::StateHeader& header,
    const std::vector<const std::vector<float>*>& momentum) {
  const std::string h = header.SerializeAsString();
  std::string out(kMagic, 8);
  const uint64_t len = h.size();
  out.append(reinterpret_cast<const char*>(&len), sizeof(len));
  out += h;
  for (const std::vector<float>* m : momentum) {
    out.append(reinterpret_cast<const char*>(m->data()),
               m->size() * sizeof(float));
  }
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(out.data()), out.size()));
  out.append(reinterpret_cast<const char*>(&crc), sizeof(crc));
  return out;
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
      const std::string previous = PreviousPathOf(job_id);
      ::unlink(previous.c_str());
      st = WriteLocked(job_id, job_serial, completed_steps, *encoded);
      ::unlink(previous.c_str());
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

absl::Status SnapshotStore::KeepPreviousLocked(const std::string& job_id,
                                               int64_t completed_steps) {
  if (auto it = newest_.find(job_id);
      it != newest_.end() && it->second.second == completed_steps) {
    return absl::OkStatus();  // the same step again: the previous one stays
  }
  const std::string path = PathOf(job_id);
  const std::string previous = PreviousPathOf(job_id);
  const std::string tmp = absl::StrCat(previous, ".tmp-", ::getpid());
  ::unlink(tmp.c_str());
  if (::link(path.c_str(), tmp.c_str()) != 0) {
    if (errno == ENOENT) return absl::OkStatus();  // the job's first file
    return absl::UnavailableError(absl::StrCat("snapshot: cannot keep ", path,
                                               " as ", previous, ": ",
                                               strerror(errno)));
  }
  if (::rename(tmp.c_str(), previous.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat(
        "snapshot: cannot keep ", path, " as ", previous, ": ", strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SnapshotStore::UsePrevious(
    const std::string& job_id, int64_t completed_steps) {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(job_id);
  const std::string previous = PreviousPathOf(job_id);
  auto head = ReadHeader(previous);
  if (!head.ok()) {
    return absl::NotFoundError(
        absl::IsNotFound(head.status())
            ? std::string("no previous snapshot")
            : absl::StrCat("its previous snapshot ", previous,
                           " cannot be used: ", head.status().message()));
  }
  if (head->job_id() != job_id || head->completed_steps() != completed_steps) {
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
  if (auto kept = KeepPreviousLocked(job_id, completed_steps); !kept.ok()) {
    ::unlink(tmp.c_str());
    return kept;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    return fail(absl::StrCat("cannot commit ", path), errno);
  SyncDir();
  newest_[job_id] = {job_serial, completed_steps};
  if (written_) {
    written_(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  return absl::OkStatus();
}

absl::StatusOr<SnapshotFile> SnapshotStore::Read(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("snapshot ", path, ": ", why));
  };
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd < 0) {
    if (absl::IsNotFound(error))
      return absl::NotFoundError(absl::StrCat("snapshot ", path, ": gone"));
    return bad(std::string(error.message()));
  }
  auto data = ReadDeclared(fd);
  ::close(fd);
  if (!data.ok()) return bad(std::string(data.status().message()));
  if (data->size() < 8 + 8 + 4 || data->compare(0, 8, kMagic, 8) != 0)
    return bad("not a dmuon snapshot");
  return Parse(*data, bad);
}

absl::StatusOr<v1::StateHeader> SnapshotStore::ReadHeader(
    const std::string& path) {
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd >= 0) {
    struct stat st;
    v1::StateHeader h;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      error = absl::DataLossError("not a regular file");
    } else {
      error = CheckDeclaredSize(fd, static_cast<uint64_t>(st.st_size), &h);
    }
    ::close(fd);
    if (error.ok()) return h;
  }
  return absl::Status(error.code(),
                      absl::StrCat("snapshot ", path, ": ", error.message()));
}

absl::StatusOr<SnapshotFile> SnapshotStore::Parse(
    const std::string& data,
    const std::function<absl::Status(const std::string&)>& bad) {
  uint32_t crc;
  std::memcpy(&crc, data.data() + data.size() - 4, 4);
  if (crc !=
      static_cast<uint32_t>(crc32(
          0L, reinterpret_cast<const Bytef*>(data.data()), data.size() - 4))) {
    return bad("checksum mismatch");
  }
  uint64_t len;
  std::memcpy(&len, data.data() + 8, 8);
  SnapshotFile out;
  // Every size below is checked against the bytes that are there before
  // anything is allocated or copied: a file is untrusted input (a valid CRC
  // only says it was not damaged, not that it was written by a daemon).
  const uint64_t body_end = data.size() - 4;
  if (len > body_end - 16 || len > (1u << 30) ||
      !out.head.mutable_header()->ParseFromArray(data.data() + 16,
                                                 static_cast<int>(len))) {
    return bad("unreadable header");
  }
  const int64_t steps = out.head.header().completed_steps();
  if (steps < 0 || steps > kMaxCompletedSteps) {
    return bad(
        absl::StrCat("completed_steps ", steps, " is outside [0, 2^62]"));
  }
  uint64_t off = 16 + len;
  for (const auto& p : out.head.header().parameters()) {
    if (p.shape_size() != 2 || p.shape(0) <= 0 || p.shape(1) <= 0) {
      return bad(
          absl::StrCat("parameter '", p.name(), "' has no [rows, cols] shape"));
    }
    const uint64_t rows = static_cast<uint64_t>(p.shape(0));
    const uint64_t cols = static_cast<uint64_t>(p.shape(1));
    const uint64_t left = (body_end - off) / 4;  // floats still in the file
    if (rows > left || cols > left || rows * cols > left) {
      return bad(absl::StrCat("truncated momentum (parameter '", p.name(),
                              "' of shape [", rows, ", ", cols, "])"));
    }
    const uint64_t n = rows * cols;
    out.momentum.emplace_back(n);
    std::memcpy(out.momentum.back().data(), data.data() + off, n * 4);
    off += n * 4;
  }
  if (off != data.size() - 4) return bad("truncated momentum");
  return out;
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
    auto snap = Read(path);
    absl::Status bad = snap.status();
    if (snap.ok() && PathOf(snap->head.header().job_id()) != path) {
      bad = absl::DataLossError(absl::StrCat(
          "snapshot ", path, " holds job '", snap->head.header().job_id(),
          "', whose file is ", PathOf(snap->head.header().job_id())));
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
      newest_[snap->head.header().job_id()] = {
          0, snap->head.header().completed_steps()};
    }
    result.good.emplace_back(snap->head.header().job_id(), path);
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
