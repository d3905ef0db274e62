#include "daemon/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
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
    case 401:
      return "Unauthorized";
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

}  // namespace

// One accepted connection: plain, or TLS (non-blocking socket, SSL on it).
struct MetricsHttp::Conn {
  int fd = -1;
  SSL* ssl = nullptr;
  // After a call that would block: what to wait for.
  short want = POLLIN;

  ~Conn() {
    if (ssl != nullptr) SSL_free(ssl);
  }
  // Bytes read (> 0), 0 at the end or on an error, -1 when it would block
  // (wait for `want`).
  ssize_t Recv(char* buf, size_t n) {
    if (ssl == nullptr) {
      want = POLLIN;
      const ssize_t r = recv(fd, buf, n, 0);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) return -1;
      return r < 0 ? 0 : r;
    }
    const int r = SSL_read(ssl, buf, static_cast<int>(n));
    return r > 0 ? r : Blocked(r);
  }
  // Bytes sent (> 0), 0 on an error, -1 when it would block.
  ssize_t Send(const char* data, size_t n) {
    if (ssl == nullptr) {
      want = POLLOUT;
      const ssize_t r = send(fd, data, n, MSG_NOSIGNAL);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) return -1;
      return r < 0 ? 0 : r;
    }
    const int r = SSL_write(ssl, data, static_cast<int>(n));
    return r > 0 ? r : Blocked(r);
  }
  // Data already decrypted and waiting: read it before polling the socket.
  bool Pending() const { return ssl != nullptr && SSL_pending(ssl) > 0; }

  // -1 (and `want`) when the TLS call would block, else 0.
  ssize_t Blocked(int r) {
    const int e = SSL_get_error(ssl, r);
    ERR_clear_error();
    if (e == SSL_ERROR_WANT_READ) {
      want = POLLIN;
      return -1;
    }
    if (e == SSL_ERROR_WANT_WRITE) {
      want = POLLOUT;
      return -1;
    }
    return 0;
  }
};

namespace {

using Conn = MetricsHttp::Conn;

// The TLS handshake before `deadline` (false: failed, or too slow).
bool Handshake(Conn& c, std::chrono::steady_clock::time_point deadline,
               const std::atomic<bool>& stop) {
  for (;;) {
    const int r = SSL_accept(c.ssl);
    if (r == 1) return true;
    if (c.Blocked(r) != -1) return false;
    if (stop || std::chrono::steady_clock::now() > deadline) return false;
    Ready(c.fd, c.want, kPollSliceMs);
  }
}

// Sends all of `data` before `deadline` (false: the client went away or
// does not read).
bool SendAll(Conn& c, std::string_view data,
             std::chrono::steady_clock::time_point deadline,
             const std::atomic<bool>& stop) {
  while (!data.empty()) {
    if (stop || std::chrono::steady_clock::now() > deadline) return false;
    const ssize_t n = c.Send(data.data(), data.size());
    if (n == 0) return false;
    if (n < 0) {
      Ready(c.fd, c.want, kPollSliceMs);
      continue;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// After the response: what the client still sends (a body, the rest of an
// oversized request) is read and dropped for a moment, so that closing with
// unread data does not reset the connection before the client has read
// the response. (TLS: close_notify first; the rest is read raw.)
void Linger(Conn& c) {
  if (c.ssl != nullptr) {
    (void)SSL_shutdown(c.ssl);
    ERR_clear_error();
  }
  const int fd = c.fd;
  shutdown(fd, SHUT_WR);
  char buf[4096];
  size_t total = 0;
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (total < (256 << 10) && std::chrono::steady_clock::now() < end) {
    if (!Ready(fd, POLLIN, 100)) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;
    total += static_cast<size_t>(n);
  }
}

// (Debian's absl::string_view is not std::string_view: local helpers.)
bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (absl::ascii_tolower(static_cast<unsigned char>(a[i])) !=
        absl::ascii_tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t'))
    s.remove_suffix(1);
  return s;
}

// The value of header `name` (case-insensitive) in `head` (request line and
// headers), or nothing.
std::optional<std::string_view> Header(std::string_view head,
                                       std::string_view name) {
  size_t pos = head.find('\n');
  while (pos != std::string_view::npos && pos + 1 < head.size()) {
    const size_t start = pos + 1;
    const size_t end = head.find('\n', start);
    std::string_view line =
        head.substr(start, end == std::string_view::npos ? end : end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t colon = line.find(':');
    if (colon != std::string_view::npos &&
        EqualsIgnoreCase(line.substr(0, colon), name)) {
      return Trim(line.substr(colon + 1));
    }
    pos = end;
  }
  return std::nullopt;
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

absl::StatusOr<MetricsHttp::TlsContext> MetricsHttp::MakeTlsContext(
    const std::string& cert_pem, const std::string& key_pem) {
  ERR_clear_error();
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_server_method()), SSL_CTX_free);
  if (!ctx) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  auto bio = [](const std::string& s) {
    return std::unique_ptr<BIO, int (*)(BIO*)>(
        BIO_new_mem_buf(s.data(), static_cast<int>(s.size())), BIO_free);
  };
  auto cb = bio(cert_pem);
  X509* leaf = PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr);
  bool ok = leaf != nullptr && SSL_CTX_use_certificate(ctx.get(), leaf) == 1;
  X509_free(leaf);
  // The rest of the chain.
  while (ok) {
    X509* extra = PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr);
    if (extra == nullptr) break;
    if (SSL_CTX_add0_chain_cert(ctx.get(), extra) != 1) {
      X509_free(extra);
      ok = false;
    }
  }
  ERR_clear_error();  // the end of the chain reads as an error
  auto kb = bio(key_pem);
  EVP_PKEY* key =
      ok ? PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr)
         : nullptr;
  ok = key != nullptr && SSL_CTX_use_PrivateKey(ctx.get(), key) == 1 &&
       SSL_CTX_check_private_key(ctx.get()) == 1;
  EVP_PKEY_free(key);
  ERR_clear_error();
  if (!ok) {
    return absl::InvalidArgumentError(
        "the certificate and key do not parse, or do not match");
  }
  return TlsContext(ctx, ctx.get());
}

void MetricsHttp::SetTls(TlsContext tls) {
  if (!tls) return;
  std::lock_guard<std::mutex> l(tls_mu_);
  tls_ = std::move(tls);
}

MetricsHttp::TlsContext MetricsHttp::tls() const {
  std::lock_guard<std::mutex> l(tls_mu_);
  return tls_;
}

absl::StatusOr<std::unique_ptr<MetricsHttp>> MetricsHttp::Start(
    const std::string& host, int port, Render render, Security security) {
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
      new MetricsHttp(fd, bound_port, std::move(render), std::move(security)));
}

MetricsHttp::MetricsHttp(int fd, int port, Render render, Security security)
    : listen_fd_(fd),
      port_(port),
      render_(std::move(render)),
      token_ok_(std::move(security.token_ok)),
      tls_(std::move(security.tls)) {
  for (int i = 0; i < kWorkers; ++i)
    workers_.emplace_back([this] { WorkerLoop(); });
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

MetricsHttp::~MetricsHttp() {
  stop_ = true;
  cv_.notify_all();
  acceptor_.join();
  for (auto& t : workers_) t.join();
  for (const Waiting& w : queue_) close(w.fd);
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
    queue_.push_back({fd, std::chrono::steady_clock::now() + kRequestTimeout});
    cv_.notify_one();
  }
}

void MetricsHttp::WorkerLoop() {
  for (;;) {
    Waiting w;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      w = queue_.front();
      queue_.pop_front();
    }
    const int fd = w.fd;
    // The connection's time counts from its accept, waiting for a worker
    // included: connections queued behind slow ones expire together, not
    // one worker-timeout after another.
    if (std::chrono::steady_clock::now() >= w.deadline) {
      close(fd);
      continue;
    }
    {
      Conn c;
      c.fd = fd;
      bool ok = true;
      if (TlsContext ctx = tls()) {
        // Non-blocking: a slow peer cannot hold SSL_read past the deadline.
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        c.ssl = SSL_new(static_cast<SSL_CTX*>(ctx.get()));
        ok = c.ssl != nullptr && SSL_set_fd(c.ssl, fd) == 1 &&
             Handshake(c, w.deadline, stop_);
      }
      if (ok) {
        Serve(c, w.deadline);
        Linger(c);
      }
    }
    close(fd);
  }
}

void MetricsHttp::Serve(Conn& fd,
                        std::chrono::steady_clock::time_point deadline) {
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
    if (!fd.Pending() && !Ready(fd.fd, fd.want, kPollSliceMs)) continue;
    const ssize_t n = fd.Recv(buf, sizeof(buf));
    if (n < 0) continue;
    if (n == 0) {
      if (!req.empty()) SendAll(fd, Error(400, "bad request"), deadline, stop_);
      return;
    }
    req.append(buf, static_cast<size_t>(n));
    end = req.find("\r\n\r\n");
    if (end == std::string::npos) end = req.find("\n\n");
  }
  // The request is in: its answer gets at least a second to go out, even
  // when it came just before the deadline (as the 408 does).
  deadline = std::max(
      deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
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
  if (token_ok_) {
    const auto auth = Header(all.substr(0, end), "authorization");
    std::string_view token = auth.value_or("");
    // The scheme is case-insensitive (RFC 9110).
    const bool bearer = EqualsIgnoreCase(token.substr(0, 7), "bearer ");
    if (bearer) token = Trim(token.substr(7));
    if (!bearer || token.empty() || !token_ok_(std::string(token))) {
      SendAll(fd,
              Error(401,
                    "/metrics needs 'Authorization: Bearer <token>' with a "
                    "token of --auth-token-file",
                    "WWW-Authenticate: Bearer realm=\"dmuond\"\r\n"),
              deadline, stop_);
      return;
    }
  }
  SendAll(fd,
          Response(200, "text/plain; version=0.0.4; charset=utf-8", render_(),
                   method == "HEAD"),
          deadline, stop_);
}

}  // namespace dmuon::server
