// The snapshot file format (snapshot_store.h): EncodeSnapshot, and the
// checked, streamed reads of a file (SnapshotStore::Read, Check and
// ReadHeader). A file is read a chunk (kSnapshotReadChunk) at a time,
// straight into the momentum vectors, its CRC-32 computed as it goes: a
// read holds one chunk beyond the momentum it returns, a check one chunk.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/limits.h"
#include "server/snapshot_store.h"

namespace dmuon::server {
namespace {

constexpr char kMagic[] = "DMUONST1";

// Files up to this size are checksummed even when their header is
// damaged, so that random damage is reported as a checksum mismatch.
constexpr uint64_t kSmallFile = uint64_t{64} << 20;

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

// A file's bytes in order from `offset`, at most `chunk` per read, each
// added to the CRC-32 `crc` of the bytes before `offset`.
class ChunkReader {
 public:
  ChunkReader(int fd, uint64_t offset, uLong crc, size_t chunk)
      : fd_(fd), offset_(offset), crc_(crc), chunk_(chunk) {}
  // The next `n` bytes into `out`, or with `out` null into the one chunk
  // buffer (checksummed, then dropped). False on a short read or error.
  bool Next(char* out, uint64_t n) {
    while (n > 0) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, chunk_));
      char* to = out;
      if (to == nullptr) {
        if (buffer_.empty()) buffer_.resize(chunk_);
        to = buffer_.data();
      }
      if (!ReadAt(fd_, offset_, to, k)) return false;
      crc_ =
          crc32(crc_, reinterpret_cast<const Bytef*>(to), static_cast<uInt>(k));
      offset_ += k;
      n -= k;
      if (out != nullptr) out += k;
    }
    return true;
  }
  uint32_t crc() const { return static_cast<uint32_t>(crc_); }

 private:
  const int fd_;
  uint64_t offset_;
  uLong crc_;
  const size_t chunk_;
  std::vector<char> buffer_;  // allocated by the first read without `out`
};

// A chunk size that crc32 (an unsigned int) takes whole: in [1, 1 GiB].
size_t ChunkOf(size_t chunk) {
  return std::clamp<size_t>(chunk, 1, size_t{1} << 30);
}

// Whether `crc` is the CRC-32 of the first `n` bytes of `fd`, read `chunk`
// at a time.
bool CrcOfFirstIs(int fd, uint64_t n, uint32_t crc, size_t chunk) {
  ChunkReader r(fd, 0, crc32(0L, Z_NULL, 0), chunk);
  return r.Next(nullptr, n) && r.crc() == crc;
}

// Whether the CRC-32 at the end of `fd` (`size` >= 4 bytes) is that of the
// bytes before it, read `chunk` at a time.
bool ChecksumMatches(int fd, uint64_t size, size_t chunk) {
  uint32_t stored;
  return ReadAt(fd, size - 4, reinterpret_cast<char*>(&stored), 4) &&
         CrcOfFirstIs(fd, size - 4, stored, chunk);
}

// Files of 4 GiB or more written before the CRC covered them whole: their
// CRC-32 is of the first (size - 4) mod 2^32 bytes (zlib's crc32 takes a
// 32-bit length). Read again only for such a file whose CRC did not match.
bool LegacyChecksumMatches(int fd, uint64_t size, uint32_t stored,
                           size_t chunk) {
  return size - 4 > 0xffffffffu &&
         CrcOfFirstIs(fd, (size - 4) & 0xffffffffu, stored, chunk);
}

// What CheckDeclaredSize read: the header, where the momentum starts, and
// the CRC-32 of the bytes before it (the same bytes the header was parsed
// from, so a file changed meanwhile cannot pass with another header).
struct Declared {
  v1::StateHeader header;
  uint64_t body = 0;  // 16 + the header's length
  uLong crc = 0;
};

// OK when `fd` (`size` bytes) is as long as its header declares: magic,
// header length, header, the momentum of its parameters' shapes, the CRC.
// Reads at most the preamble and the header, its length checked against
// `size` before anything is allocated; every product and sum is checked
// for overflow.
absl::Status CheckDeclaredSize(int fd, uint64_t size, Declared* out) {
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
  out->header = std::move(h);
  out->body = 16 + len;
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(head), 16);
  out->crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()),
                   static_cast<uInt>(len));
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

// Closes a file descriptor at the end of its scope.
struct Closer {
  int fd;
  ~Closer() { ::close(fd); }
};

// The checks of an open regular file `fd` (`size` bytes), in the order of
// trust: the sizes its header declares (before anything is allocated),
// then, streamed, its momentum, each parameter read into `momentum` when
// that is not null (else only checksummed), then the CRC (a mismatch
// discards what was read), then what a valid CRC does not vouch for.
// Errors are the reason alone (Stream names the file).
absl::StatusOr<v1::StateHeader> CheckAndRead(
    int fd, uint64_t size, size_t chunk,
    std::vector<std::vector<float>>* momentum) {
  Declared d;
  if (absl::Status declared = CheckDeclaredSize(fd, size, &d); !declared.ok()) {
    // Damaged or crafted? A small snapshot's checksum tells: a damaged one
    // is reported as such, whatever part of it the damage hit.
    char magic[8];
    if (size >= 20 && size <= kSmallFile && ReadAt(fd, 0, magic, 8) &&
        std::memcmp(magic, kMagic, 8) == 0 &&
        !ChecksumMatches(fd, size, chunk)) {
      return absl::DataLossError("checksum mismatch");
    }
    return declared;
  }
  ChunkReader r(fd, d.body, d.crc, chunk);
  bool read = true;
  if (momentum == nullptr) {
    read = r.Next(nullptr, size - 4 - d.body);
  } else {
    momentum->clear();
    momentum->reserve(static_cast<size_t>(d.header.parameters_size()));
    for (const auto& p : d.header.parameters()) {  // sizes checked above
      momentum->emplace_back(static_cast<size_t>(p.shape(0) * p.shape(1)));
      std::vector<float>& m = momentum->back();
      if (!(read = r.Next(reinterpret_cast<char*>(m.data()), m.size() * 4)))
        break;
    }
  }
  uint32_t stored;
  if (!read || !ReadAt(fd, size - 4, reinterpret_cast<char*>(&stored), 4)) {
    if (momentum != nullptr) momentum->clear();
    return absl::DataLossError("cannot read it");  // shortened meanwhile
  }
  if (stored != r.crc() && !LegacyChecksumMatches(fd, size, stored, chunk)) {
    if (momentum != nullptr) momentum->clear();
    return absl::DataLossError("checksum mismatch");
  }
  const int64_t steps = d.header.completed_steps();
  if (steps < 0 || steps > kMaxCompletedSteps) {
    if (momentum != nullptr) momentum->clear();
    return absl::DataLossError(
        absl::StrCat("completed_steps ", steps, " is outside [0, 2^62]"));
  }
  return std::move(d.header);
}

// Read (`momentum` not null) or Check of the file at `path`.
absl::StatusOr<v1::StateHeader> Stream(
    const std::string& path, size_t chunk,
    std::vector<std::vector<float>>* momentum) {
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd >= 0) {
    Closer closer{fd};
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      error = absl::DataLossError(
          absl::StrCat("cannot stat it: ", strerror(errno)));
    } else if (!S_ISREG(st.st_mode)) {
      error = absl::DataLossError("not a regular file");
    } else {
      auto head = CheckAndRead(fd, static_cast<uint64_t>(st.st_size),
                               ChunkOf(chunk), momentum);
      if (head.ok()) return head;
      error = head.status();
    }
  }
  return absl::Status(error.code(),
                      absl::StrCat("snapshot ", path, ": ", error.message()));
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
  // crc32_z: a length of 64 bits (crc32's is 32: it would cover a file of
  // 4 GiB or more only up to its size modulo 4 GiB).
  const uint32_t crc = static_cast<uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(out.data()), out.size()));
  out.append(reinterpret_cast<const char*>(&crc), sizeof(crc));
  return out;
}

absl::StatusOr<SnapshotFile> SnapshotStore::Read(const std::string& path,
                                                 size_t chunk) {
  SnapshotFile out;
  auto head = Stream(path, chunk, &out.momentum);
  if (!head.ok()) return head.status();
  *out.head.mutable_header() = *std::move(head);
  return out;
}

absl::StatusOr<v1::StateHeader> SnapshotStore::Check(const std::string& path,
                                                     size_t chunk) {
  return Stream(path, chunk, nullptr);
}

absl::StatusOr<v1::StateHeader> SnapshotStore::ReadHeader(
    const std::string& path) {
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd >= 0) {
    Closer closer{fd};
    struct stat st;
    Declared d;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      error = absl::DataLossError("not a regular file");
    } else {
      error = CheckDeclaredSize(fd, static_cast<uint64_t>(st.st_size), &d);
    }
    if (error.ok()) return std::move(d.header);
  }
  return absl::Status(error.code(),
                      absl::StrCat("snapshot ", path, ": ", error.message()));
}

}  // namespace dmuon::server
