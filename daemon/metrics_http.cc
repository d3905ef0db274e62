#include "daemon/metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "daemon/listen_probe.h"

namespace dmuon::server {
namespace {

constexpr int kWorkers = 4;
constexpr size_t kMaxQueued = 64;
constexpr size_t kMaxRequestBytes = 16 << 10;
constexpr auto kRequestTimeout = std::chrono::seconds(10);
constexpr int kPollSliceMs = 200;  // how often waits look at stop_

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 431:
      return "Request Header Fields Too Large";
    default:
      return "Internal Server Error";
  }
}

// Waits up to `ms` for `events` on `fd`; true when ready.
bool Ready(int fd, short events, int ms) {
  pollfd p{fd, events, 0};
  return poll(&p, 1, ms) > 0;
}

// Sends all of `data` before `deadline` (false: the client went away or
// does not read).
bool SendAll(int fd, std::string_view data,
             std::chrono::steady_clock::time_point deadline,
             const std::atomic<bool>& stop) {
  while (!data.empty()) {
    if (stop || std::chrono::steady_clock::now() > deadline) return false;
    if (!Ready(fd, POLLOUT, kPollSliceMs)) continue;
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// After the response: what the client still sends (a body, the rest of an
// oversized request) is read and dropped for a moment, so that closing with
// unread data does not reset the connection before the client has read
// the response.
void Linger(int fd) {
  shutdown(fd, SHUT_WR);
  char buf[4096];
  size_t total = 0;
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (total < (256 << 10) && std::chrono::steady_clock::now() < end) {
    if (!Ready(fd, POLLIN, 100)) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    total += static_cast<size_t>(n);
  }
}

std::string Response(int status, std::string_view content_type,
                     std::string_view body, bool head,
                     std::string_view extra_headers = "") {
  std::string r = "HTTP/1.1 " + std::to_string(status) + " " + Reason(status) +
                  "\r\nContent-Type: ";
  r.append(content_type);
  r += "\r\nContent-Length: " + std::to_string(body.size()) +
       "\r\nCache-Control: no-store\r\nConnection: close\r\n";
  r.append(extra_headers);
  r += "\r\n";
  if (!head) r.append(body);
  return r;
}

std::string Error(int status, std::string_view message,
                  std::string_view extra_headers = "") {
  return Response(status, "text/plain; charset=utf-8",
                  std::string(message) + "\n", false, extra_headers);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttp>> MetricsHttp::Start(
    const std::string& host, int port, Render render) {
  const std::string address = host + ":" + std::to_string(port);
  auto bound_fd = BindTcp(host, port, /*listen=*/true);
  if (!bound_fd.ok()) {
    return absl::UnavailableError("cannot listen on " + address + ": " +
                                  std::string(bound_fd.status().message()));
  }
  const int fd = *bound_fd;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<MetricsHttp>(
      new MetricsHttp(fd, bound_port, std::move(render)));
}

MetricsHttp::MetricsHttp(int fd, int port, Render render)
    : listen_fd_(fd), port_(port), render_(std::move(render)) {
  for (int i = 0; i < kWorkers; ++i)
    workers_.emplace_back([this] { WorkerLoop(); });
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

MetricsHttp::~MetricsHttp() {
  stop_ = true;
  cv_.notify_all();
  acceptor_.join();
  for (auto& t : workers_) t.join();
  for (int fd : queue_) close(fd);
  close(listen_fd_);
}

void MetricsHttp::AcceptLoop() {
  while (!stop_) {
    if (!Ready(listen_fd_, POLLIN, kPollSliceMs)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> l(mu_);
    if (queue_.size() >= kMaxQueued) {
      close(fd);  // every worker busy and many waiting: shed
      continue;
    }
    queue_.push_back(fd);
    cv_.notify_one();
  }
}

void MetricsHttp::WorkerLoop() {
  for (;;) {
    int fd;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      fd = queue_.front();
      queue_.pop_front();
    }
    Serve(fd);
    Linger(fd);
    close(fd);
  }
}

void MetricsHttp::Serve(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kRequestTimeout;
  std::string req;
  size_t end = std::string::npos;
  char buf[4096];
  // The request line and headers (a body, if any, is not read).
  while (end == std::string::npos) {
    if (req.size() > kMaxRequestBytes) {
      SendAll(fd, Error(431, "request too large"), deadline, stop_);
      return;
    }
    if (stop_) return;
    if (std::chrono::steady_clock::now() > deadline) {
      SendAll(fd, Error(408, "request not complete in time"),
              deadline + std::chrono::seconds(1), stop_);
      return;
    }
    if (!Ready(fd, POLLIN, kPollSliceMs)) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      if (!req.empty()) SendAll(fd, Error(400, "bad request"), deadline, stop_);
      return;
    }
    req.append(buf, static_cast<size_t>(n));
    end = req.find("\r\n\r\n");
    if (end == std::string::npos) end = req.find("\n\n");
  }
  // "METHOD TARGET HTTP/x.y"
  const std::string_view all(req);
  std::string_view line = all.substr(0, all.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t sp1 = line.find(' ');
  const size_t sp2 =
      sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos ||
      line.find(' ', sp2 + 1) != std::string_view::npos ||
      line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0) {
    SendAll(fd, Error(400, "bad request"), deadline, stop_);
    return;
  }
  const std::string_view method = line.substr(0, sp1);
  std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (path != "/metrics" && path.rfind("/metrics/", 0) != 0) {
    SendAll(fd, Error(404, "not found; metrics are at /metrics"), deadline,
            stop_);
    return;
  }
  if (method != "GET" && method != "HEAD") {
    SendAll(fd, Error(405, "only GET", "Allow: GET, HEAD\r\n"), deadline,
            stop_);
    return;
  }
  SendAll(fd,
          Response(200, "text/plain; version=0.0.4; charset=utf-8", render_(),
                   method == "HEAD"),
          deadline, stop_);
}

}  // namespace dmuon::server
