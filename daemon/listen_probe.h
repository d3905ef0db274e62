// Why an address cannot be listened on, for startup errors that name it.

#ifndef DMUON_DAEMON_LISTEN_PROBE_H_
#define DMUON_DAEMON_LISTEN_PROBE_H_

#include <string>

namespace dmuon::server {

// Tries to bind a TCP socket to host:port (host: a name, an IPv4 address
// or a bracketed IPv6 one) as a server would (SO_REUSEADDR, no
// SO_REUSEPORT), and closes it. "" when it could; else why not, e.g.
// "Address already in use".
std::string ListenProbe(const std::string& host, int port);

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_LISTEN_PROBE_H_
