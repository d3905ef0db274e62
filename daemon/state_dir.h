// --state-dir belongs to one dmuond: the directory is made if missing
// (mode 0700), checked writable, and held with an exclusive lock for the
// daemon's life, before any snapshot is read or written. A second daemon on
// the same directory would overwrite the first's acknowledged snapshots (and
// both would write the same temporary files); it is refused at start
// instead, naming the daemon that holds the directory.

#ifndef DMUON_DAEMON_STATE_DIR_H_
#define DMUON_DAEMON_STATE_DIR_H_

#include <string>

#include "absl/status/statusor.h"

namespace dmuon::server {

// The lock on a state directory: flock(LOCK_EX) on `<dir>/.dmuond.lock`,
// which holds the holder's pid. Released when destroyed (or when the
// process ends, however it ends: the kernel drops the lock with the file
// descriptor, so a crashed daemon never leaves the directory locked).
class StateDirLock {
 public:
  // Makes `dir` if it does not exist (0700, parents as needed), checks that
  // it is a writable directory and locks it. FAILED_PRECONDITION naming the
  // flag and the directory when it cannot be made or written, or when
  // another process holds it (with that process's pid).
  static absl::StatusOr<StateDirLock> Acquire(const std::string& dir);

  StateDirLock(StateDirLock&& other) noexcept;
  StateDirLock& operator=(StateDirLock&& other) noexcept;
  StateDirLock(const StateDirLock&) = delete;
  StateDirLock& operator=(const StateDirLock&) = delete;
  ~StateDirLock();

  const std::string& path() const { return path_; }  // the lock file

 private:
  StateDirLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_STATE_DIR_H_
