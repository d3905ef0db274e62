// Where a daemon address points: Client::IsLocalAddress.

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/host_port.h"
#include "client/client.h"

namespace dmuon {
namespace {

// The host part of a gRPC target "host:port" or "[v6]:port" (brackets
// dropped).
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host;
}

// The numeric addresses `host` resolves to (empty when it does not).
std::set<std::string> Addresses(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, buf, sizeof(buf), nullptr, 0,
                    NI_NUMERICHOST) == 0) {
      out.insert(buf);
    }
  }
  freeaddrinfo(res);
  return out;
}

}  // namespace

absl::Status Client::CheckAddress(const std::string& address) {
  for (const char* scheme :
       {"unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:"}) {
    if (address.rfind(scheme, 0) == 0 && address.size() > strlen(scheme))
      return absl::OkStatus();
  }
  const std::optional<HostPort> hp = ParseHostPort(address);
  const bool v6 = hp && hp->host.size() > 2 && hp->host.front() == '[';
  if (hp && hp->port >= 1 && !hp->host.empty() &&
      (v6 || hp->host.find_first_of("/[]@ ") == std::string::npos)) {
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  const std::string port =
      colon == std::string::npos ? "" : address.substr(colon + 1);
  const std::string why =
      address.find("://") != std::string::npos
          ? "a URL; give host:port without a scheme"
      : port.empty() || colon == std::string::npos
          ? "no port (dmuond listens on its --listen, 127.0.0.1:50051 by "
            "default)"
          : "not host:port, [v6]:port (port in [1, 65535]) or unix:path";
  return absl::InvalidArgumentError(
      absl::StrCat("dmuond address '", address, "' is ", why));
}

bool Client::IsLocalAddress(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return true;
  const std::string host = HostOf(address);
  if (host == "localhost" || host == "::1" || host == "0.0.0.0" ||
      host.rfind("127.", 0) == 0) {
    return true;
  }
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return false;
  if (host == name) return true;
  const std::set<std::string> mine = Addresses(name);
  for (const std::string& a : Addresses(host))
    if (mine.count(a) > 0) return true;
  return false;
}

}  // namespace dmuon
