// CheckToken (token.h).

#include "base/token.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dmuon {

absl::Status CheckToken(absl::string_view token, absl::string_view what) {
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", token.size(), " bytes; at most ",
                     kMaxTokenBytes, " are sent"));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has byte 0x%02x at position %d: a token is sent in an HTTP/2 "
          "header, which carries only visible ASCII (0x21-0x7e: no space, "
          "control byte or non-ASCII character)",
          what, c, i));
    }
  }
  return absl::OkStatus();
}

}  // namespace dmuon
