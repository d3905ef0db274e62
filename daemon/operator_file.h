// Files an operator hands dmuond and dmuonctl (TLS certificates and keys,
// token files): read whole, but only a regular file and only up to a bound,
// so that a FIFO, a device (/dev/zero) or a huge file named by mistake is an
// error naming the flag, never a hang or the daemon's memory.

#ifndef DMUON_DAEMON_OPERATOR_FILE_H_
#define DMUON_DAEMON_OPERATOR_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dmuon {

// PEM files (a certificate chain, a key, a CA bundle).
inline constexpr uint64_t kMaxPemFileBytes = uint64_t{1} << 20;
// --auth-token-file: thousands of tokens.
inline constexpr uint64_t kMaxTokenFileBytes = uint64_t{4} << 20;

// The contents of the regular file `path`, at most `max_bytes` long. It is
// opened without blocking (a FIFO is refused, not waited on) and read
// through its descriptor, so what was checked is what is read.
// INVALID_ARGUMENT "<what>: <why>" otherwise (`what`: the flag or variable
// and the path, e.g. "--tls-key-file=/etc/k.pem").
absl::StatusOr<std::string> ReadOperatorFile(const std::string& path,
                                             uint64_t max_bytes,
                                             absl::string_view what);

}  // namespace dmuon

#endif  // DMUON_DAEMON_OPERATOR_FILE_H_
