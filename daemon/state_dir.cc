// StateDirLock (state_dir.h).

#include "daemon/state_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace dmuon::server {
namespace {

absl::Status Refuse(const std::string& dir, const std::string& why) {
  return absl::FailedPreconditionError(
      absl::StrCat("--state-dir=", dir, ": ", why));
}

// Makes `dir` and its missing parents, 0700.
absl::Status MakeDirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    const std::string part = dir.substr(0, i);
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
      return Refuse(dir, absl::StrCat("cannot create ", part, ": ",
                                      std::strerror(errno)));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return Refuse(dir, "is not a directory");
  return absl::OkStatus();
}

// The pid the lock file names ("" when unreadable), at most 32 bytes read.
std::string HolderPid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  int64_t pid = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(std::string(buf, n)), &pid))
    return "";
  return absl::StrCat(pid);
}

}  // namespace

absl::StatusOr<StateDirLock> StateDirLock::Acquire(const std::string& dir) {
  if (absl::Status st = MakeDirs(dir); !st.ok()) return st;
  const std::string path = absl::StrCat(dir, "/.dmuond.lock");
  // O_NOFOLLOW: a link planted in the directory is not followed;
  // O_NONBLOCK: a FIFO of that name cannot hang the start.
  const int fd =
      ::open(path.c_str(),
             O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (fd < 0) {
    return Refuse(dir, absl::StrCat("not writable (cannot create ", path, ": ",
                                    std::strerror(errno),
                                    "); snapshots could not be written"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Refuse(dir, absl::StrCat(path, " is not a regular file"));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string pid = HolderPid(fd);
    ::close(fd);
    if (err != EWOULDBLOCK)
      return Refuse(
          dir, absl::StrCat("cannot lock ", path, ": ", std::strerror(err)));
    return Refuse(dir,
                  absl::StrCat("in use by another dmuond (",
                               pid.empty() ? "pid unknown" : "pid " + pid,
                               ", holding ", path,
                               "): one state directory belongs to one daemon; "
                               "give this one its own --state-dir"));
  }
  const std::string me = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) !=
                                     static_cast<ssize_t>(me.size())) {
    const int err = errno;
    ::close(fd);
    return Refuse(dir, absl::StrCat("not writable (writing ", path, ": ",
                                    std::strerror(err), ")"));
  }
  return StateDirLock(path, fd);
}

StateDirLock::StateDirLock(StateDirLock&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

StateDirLock& StateDirLock::operator=(StateDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

StateDirLock::~StateDirLock() {
  if (fd_ >= 0) ::close(fd_);  // the kernel drops the lock with it
}

}  // namespace dmuon::server
