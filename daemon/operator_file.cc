#include "daemon/operator_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dmuon {

absl::StatusOr<std::string> ReadOperatorFile(const std::string& path,
                                             uint64_t max_bytes,
                                             absl::string_view what) {
  auto fail = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return fail(std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail("not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return fail(absl::StrCat(st.st_size, " bytes, more than the ", max_bytes,
                             " such a file may have"));
  }
  // Read up to one byte past the bound: a file that grew meanwhile is
  // refused as well.
  std::string out(static_cast<size_t>(max_bytes) + 1, '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return fail(std::strerror(err));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got > max_bytes) {
    return fail(absl::StrCat("more than the ", max_bytes,
                             " bytes such a file may have"));
  }
  out.resize(got);
  return out;
}

}  // namespace dmuon
