// What a bearer token may hold. A token travels in the `authorization`
// header of every gRPC call ("Bearer <token>"), and gRPC aborts the process
// (SIGABRT) on a header value it cannot send; so every place a token is read
// (the client's options, dmuonctl's --token-file, dmuond's --auth-token-file)
// checks it with this one rule first and reports a bad one as an error.

#ifndef DMUON_BASE_TOKEN_H_
#define DMUON_BASE_TOKEN_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dmuon {

// OK when `token` is 1 to kMaxTokenBytes bytes of visible ASCII (0x21 to
// 0x7e: no space, no control byte, nothing outside ASCII); otherwise
// INVALID_ARGUMENT starting with `what` and naming the first bad byte and
// its position (never the token itself).
absl::Status CheckToken(absl::string_view token, absl::string_view what);

inline constexpr size_t kMaxTokenBytes = 4096;

}  // namespace dmuon

#endif  // DMUON_BASE_TOKEN_H_
