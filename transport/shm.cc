// The shm transport's region: a POSIX shared-memory segment.
//
// The daemon creates the segment (CreateShmRegion) and owns its name; the
// client maps it by name (OpenShmRegion). Neither Region ever unlinks the
// name on destruction: the daemon decides when (UnlinkShm), and a mapping
// stays valid after the name is gone.

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "transport/doorbell.h"
#include "transport/sigbus_guard.h"
#include "transport/transport.h"

namespace dmuon::transport {
namespace {

constexpr char kNamePrefix[] = "/dmuon-";
constexpr int kRandomBytes = 16;  // 32 hex digits, 128 bits
constexpr int kCreateAttempts = 8;
constexpr uint64_t kMaxBytes = std::numeric_limits<off_t>::max();

absl::Status ErrnoError(int error, const std::string& what) {
  return absl::ErrnoToStatus(error, what);  // appends strerror(error)
}

// Fills `buf` from the kernel CSPRNG: getrandom(2), or /dev/urandom where
// the system call is missing.
absl::Status RandomBytes(unsigned char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else if (r < 0 && errno == ENOSYS) {
      break;
    } else {
      return ErrnoError(errno, "getrandom");
    }
  }
  if (got == n) return absl::OkStatus();
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open /dev/urandom");
  while (got < n) {
    const ssize_t r = ::read(fd, buf + got, n - got);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (!(r < 0 && errno == EINTR)) {
      const int error = r < 0 ? errno : EIO;
      ::close(fd);
      return ErrnoError(error, "read /dev/urandom");
    }
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RandomName() {
  unsigned char raw[kRandomBytes];
  if (absl::Status s = RandomBytes(raw, sizeof(raw)); !s.ok()) return s;
  return absl::StrCat(kNamePrefix,
                      absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(raw), sizeof(raw))));
}

// shm_open(3) names: "/" then 1..NAME_MAX characters, none of them '/'.
absl::Status ValidateName(const std::string& name) {
  if (name.size() < 2 || name.size() > NAME_MAX + 1 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos ||
      name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid shm segment name '", name, "'"));
  }
  return absl::OkStatus();
}

std::string SizeMismatch(const std::string& name, int64_t holds,
                         uint64_t declared) {
  return absl::StrCat("shm segment '", name, "' holds ", holds, " bytes, ",
                      declared, " declared");
}

class ShmRegion final : public Region {
 public:
  ShmRegion(std::string name, int fd, void* addr, uint64_t size,
            std::shared_ptr<Doorbell> doorbell = nullptr)
      : name_(std::move(name)),
        fd_(fd),
        addr_(addr),
        size_(size),
        doorbell_(std::move(doorbell)) {}
  ~ShmRegion() override {
    if (addr_ != nullptr) ::munmap(addr_, size_);
    ::close(fd_);
  }
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  absl::Span<std::byte> bytes() override {
    return {static_cast<std::byte*>(addr_), size_};
  }

  absl::Status Check() const override {
    if (guard_.broken()) return Lost();
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      return ErrnoError(errno, absl::StrCat("fstat shm segment '", name_, "'"));
    }
    if (static_cast<uint64_t>(st.st_size) < size_) {
      return absl::DataLossError(SizeMismatch(name_, st.st_size, size_));
    }
    return absl::OkStatus();
  }

  // Through the mapping, guarded (sigbus_guard.h): a segment already
  // shrunk fails the size check first; one shrunk during the copy raises
  // SIGBUS inside it, which the guard absorbs, and the copy fails with
  // DATA_LOSS (the region is then lost: every later call fails too).
  absl::Status Read(uint64_t offset, void* out, uint64_t n) override {
    return Guarded(offset, n, [&] { return guard_.CopyOut(offset, out, n); });
  }
  absl::Status Write(uint64_t offset, const void* in, uint64_t n) override {
    return Guarded(offset, n, [&] { return guard_.CopyIn(offset, in, n); });
  }

  const std::string& name() const override { return name_; }

  std::shared_ptr<Doorbell> doorbell() const override { return doorbell_; }

 private:
  // copy() (one of guard_'s) once [offset, offset + n) is in range and the
  // segment still has its declared size.
  template <typename CopyFn>
  absl::Status Guarded(uint64_t offset, uint64_t n, CopyFn copy) {
    if (auto st = CheckRange(offset, n); !st.ok()) return st;
    if (auto st = Check(); !st.ok()) return st;
    if (copy()) return absl::OkStatus();
    return Lost();
  }

  absl::Status CheckRange(uint64_t offset, uint64_t n) const {
    if (offset <= size_ && n <= size_ - offset) return absl::OkStatus();
    return absl::OutOfRangeError(absl::StrCat(
        "bytes [", offset, ", ", offset, " + ", n,
        ") are outside shm segment '", name_, "' (", size_, " bytes)"));
  }

  absl::Status Lost() const {
    return absl::DataLossError(
        absl::StrCat("shm segment '", name_, "' (", size_,
                     " bytes declared) was shrunk while dmuon copied from or "
                     "to it; the region is lost"));
  }

  const std::string name_;
  const int fd_;                              // kept open for Check()
  void* const addr_;                          // nullptr when size_ == 0
  const uint64_t size_;                       // declared and mapped
  const std::shared_ptr<Doorbell> doorbell_;  // null: none
  GuardedMapping guard_{addr_, size_};
};

// Maps `size` bytes of `fd` from `offset` (a page boundary); nullptr for an
// empty region (mmap rejects 0).
absl::StatusOr<void*> Map(int fd, uint64_t size, const std::string& name,
                          uint64_t offset = 0) {
  if (size == 0) return nullptr;
  void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(offset));
  if (addr == MAP_FAILED) {
    return ErrnoError(errno, absl::StrCat("mmap shm segment '", name, "' (",
                                          size, " bytes)"));
  }
  return addr;
}

absl::Status TooLarge(uint64_t bytes) {
  return absl::InvalidArgumentError(
      absl::StrCat("shm region of ", bytes, " bytes exceeds ", kMaxBytes));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> CreateShmRegion(uint64_t tensor_bytes,
                                                        int doorbell_params,
                                                        bool doorbell_waiters) {
  // The doorbell on a page of its own, so that it can be mapped on its own.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t doorbell =
      doorbell_params < 0 ? 0 : DoorbellBytes(doorbell_params);
  if (tensor_bytes > kMaxBytes - doorbell - (doorbell > 0 ? page : 0))
    return TooLarge(tensor_bytes);
  const uint64_t doorbell_at = doorbell_params < 0
                                   ? tensor_bytes
                                   : (tensor_bytes + page - 1) / page * page;
  const uint64_t bytes = doorbell_at + doorbell;
  std::string name;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    absl::StatusOr<std::string> candidate = RandomName();
    if (!candidate.ok()) return candidate.status();
    name = *std::move(candidate);
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) break;
    // EEXIST: 128 random bits collided, or someone squats names; retry.
    if (errno != EEXIST || attempt + 1 >= kCreateAttempts) {
      return ErrnoError(errno, absl::StrCat("shm_open '", name, "'"));
    }
  }
  // From here on the name is ours: unlink it on any failure.
  auto fail = [&](const std::string& what, int error) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return ErrnoError(error, absl::StrCat(what, " shm segment '", name, "'"));
  };
  // The umask may have cleared bits only; set exactly 0600 regardless.
  if (::fchmod(fd, 0600) != 0) return fail("fchmod", errno);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail("ftruncate", errno);
  }
  // Reserve the pages now: a full /dev/shm then fails here with ENOSPC
  // instead of raising SIGBUS on first touch.
  if (bytes > 0) {
    if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        error != 0) {
      return fail(absl::StrCat("reserve ", bytes, " bytes of"), error);
    }
  }
  std::shared_ptr<Doorbell> bell;
  if (doorbell_params >= 0) {
    absl::StatusOr<void*> at = Map(fd, doorbell, name, doorbell_at);
    if (!at.ok()) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      return at.status();
    }
    bell = std::make_shared<Doorbell>(*at, doorbell_at, doorbell_params,
                                      doorbell_waiters);
  }
  absl::StatusOr<void*> addr = Map(fd, tensor_bytes, name);
  if (!addr.ok()) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return addr.status();
  }
  return std::make_unique<ShmRegion>(std::move(name), fd, *addr, tensor_bytes,
                                     std::move(bell));
}

absl::StatusOr<std::unique_ptr<Region>> OpenShmRegion(const std::string& name,
                                                      uint64_t expected_bytes) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (expected_bytes > kMaxBytes) return TooLarge(expected_bytes);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("shm segment '", name, "' does not exist"));
    }
    return ErrnoError(error, absl::StrCat("shm_open '", name, "'"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return ErrnoError(error, absl::StrCat("fstat shm segment '", name, "'"));
  }
  if (static_cast<uint64_t>(st.st_size) < expected_bytes) {
    ::close(fd);
    return absl::FailedPreconditionError(
        SizeMismatch(name, st.st_size, expected_bytes));
  }
  absl::StatusOr<void*> addr = Map(fd, expected_bytes, name);
  if (!addr.ok()) {
    ::close(fd);
    return addr.status();
  }
  return std::make_unique<ShmRegion>(name, fd, *addr, expected_bytes);
}

absl::Status UnlinkShm(const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (::shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    return ErrnoError(errno, absl::StrCat("shm_unlink '", name, "'"));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::transport
