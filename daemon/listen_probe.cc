#include "daemon/listen_probe.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace dmuon::server {

absl::StatusOr<int> BindTcp(const std::string& host, int port, bool listen) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']')
    h = h.substr(1, h.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(h.empty() ? nullptr : h.c_str(), service.c_str(),
                          &hints, &res);
      e != 0) {
    return absl::UnavailableError(gai_strerror(e));
  }
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 ||
        (listen && ::listen(fd, 128) != 0)) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError(why);
  return fd;
}

std::string ListenProbe(const std::string& host, int port) {
  auto fd = BindTcp(host, port, /*listen=*/false);
  if (!fd.ok()) return std::string(fd.status().message());
  close(*fd);
  return "";
}

}  // namespace dmuon::server
