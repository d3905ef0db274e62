// Binding the daemon's TCP ports, and why an address cannot be listened on,
// for startup errors that name it.

#ifndef DMUON_DAEMON_LISTEN_PROBE_H_
#define DMUON_DAEMON_LISTEN_PROBE_H_

#include <string>

#include "absl/status/statusor.h"

namespace dmuon::server {

// Tries to bind a TCP socket to host:port (host: a name, an IPv4 address
// or a bracketed IPv6 one) as a server would (SO_REUSEADDR, no
// SO_REUSEPORT), and closes it. "" when it could; else why not, e.g.
// "Address already in use".
std::string ListenProbe(const std::string& host, int port);

// A TCP socket (close-on-exec) bound to host:port as above, listening with
// a backlog of 128 when `listen` is true: the first address of the host's
// that works. UNAVAILABLE with why the last one failed ("Address already in
// use") otherwise; the caller adds the address to the message.
absl::StatusOr<int> BindTcp(const std::string& host, int port, bool listen);

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_LISTEN_PROBE_H_
