// ParseHostPort (host_port.h).

#include "base/host_port.h"

#include <algorithm>

#include "absl/strings/numbers.h"

namespace dmuon {

std::optional<HostPort> ParseHostPort(const std::string& address) {
  size_t colon = std::string::npos;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find("]:");
    if (close != std::string::npos) colon = close + 1;
  } else if (std::count(address.begin(), address.end(), ':') == 1) {
    colon = address.find(':');
  }
  if (colon == std::string::npos) return std::nullopt;
  const std::string port = address.substr(colon + 1);
  int n = -1;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port, &n) || n > 65535) {
    return std::nullopt;
  }
  return HostPort{address.substr(0, colon), n};
}

}  // namespace dmuon
