// The one parser of a TCP address, "HOST:PORT" or "[IPv6]:PORT", shared by
// dmuond's --listen (daemon/config.cc) and the client's daemon addresses
// (client/address.cc), which add their own rules on top (port 0, schemes).

#ifndef DMUON_BASE_HOST_PORT_H_
#define DMUON_BASE_HOST_PORT_H_

#include <optional>
#include <string>

namespace dmuon {

struct HostPort {
  std::string host;  // as written: brackets kept for IPv6, may be empty
  int port = 0;      // in [0, 65535]
};

// `address` split at its port's colon: a bracketed host, or a host with no
// other colon (a bare IPv6 address has no port). The port is 1 to 5 digits
// in [0, 65535]. nullopt when `address` is not of that form.
std::optional<HostPort> ParseHostPort(const std::string& address);

}  // namespace dmuon

#endif  // DMUON_BASE_HOST_PORT_H_
