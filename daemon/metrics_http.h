// The Prometheus endpoint: GET /metrics, served by a small HTTP/1.1 server
// of our own (not civetweb).
//
// It used to be prometheus-cpp's Exposer on Debian's civetweb 1.15, whose
// workers run on 100 KiB stacks out of which glibc also carves the
// process's static TLS: OpenBLAS's alone is 60 KiB, so in dmuond the ~30
// KiB left overflowed in civetweb's own error response (GET /, /favicon.ico
// or garbage killed dmuond with SIGSEGV), and in dmuond_cuda (cuBLASLt,
// cuBLAS and NCCL add another 120 KiB of TLS) civetweb could not start a
// worker at all, so --metrics-port failed at startup.
//
// This server answers every request itself, on threads with ordinary
// stacks: GET (or HEAD) /metrics -> 200 and the text exposition format;
// another path -> 404; another method -> 405; a malformed request -> 400;
// a request over 16 KiB -> 431; one not complete within 10 s of its
// connection's accept -> 408. One request per connection (Connection:
// close). A connection has 10 s from its accept for everything (waiting for
// a worker, the TLS handshake, the request): a slow or idle client holds one
// of 4 workers for at most that, the others serve meanwhile, connections
// that waited past it in the queue are closed unserved (so a crowd of
// half-sent requests expires together, in 10 s, not 10 s per worker turn),
// and beyond 64 connections waiting for a worker new ones are closed at
// once.
//
// Optionally (Security, docs/security.md "The metrics port"): HTTPS, with a
// certificate that can be replaced while serving (SetTls: the daemon's
// --tls-cert-file re-read on SIGHUP; a TLS handshake that fails, or a
// plaintext request, gets no HTTP answer), and bearer tokens: GET /metrics
// without `Authorization: Bearer <token>` that `token_ok` accepts gets 401.

#ifndef DMUON_DAEMON_METRICS_HTTP_H_
#define DMUON_DAEMON_METRICS_HTTP_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace dmuon::server {

class MetricsHttp {
 public:
  // The body of GET /metrics, called once per scrape from a worker thread.
  using Render = std::function<std::string()>;

  // An OpenSSL SSL_CTX (opaque here), freed with the last connection using
  // it.
  using TlsContext = std::shared_ptr<void>;
  // A server context for `cert_pem` (chain) and `key_pem`; INVALID_ARGUMENT
  // when they do not parse or do not match.
  static absl::StatusOr<TlsContext> MakeTlsContext(const std::string& cert_pem,
                                                   const std::string& key_pem);

  struct Security {
    TlsContext tls;  // null: plain HTTP
    // Set: /metrics needs a bearer token it accepts (called on a worker
    // thread with the token, without "Bearer ").
    std::function<bool(const std::string& token)> token_ok;
  };

  // Serves `render` at http://host:port/metrics (host: a name, an IPv4
  // address or a bracketed IPv6 one; port 0 picks a free one). UNAVAILABLE
  // "cannot listen on host:port: why" when that address cannot be bound
  // (taken, or not an address of this host).
  static absl::StatusOr<std::unique_ptr<MetricsHttp>> Start(
      const std::string& host, int port, Render render, Security security = {});
  ~MetricsHttp();  // stops serving; requests in progress end within 200 ms

  // New connections use `tls` (a server serving HTTPS only; null ignored).
  void SetTls(TlsContext tls);

  MetricsHttp(const MetricsHttp&) = delete;
  MetricsHttp& operator=(const MetricsHttp&) = delete;

  int port() const { return port_; }

  struct Conn;  // one connection, plain or TLS (metrics_http.cc)

 private:
  MetricsHttp(int fd, int port, Render render, Security security);
  void AcceptLoop();
  void WorkerLoop();
  // Answers the request on `c`, which must be complete by `deadline` (its
  // accept plus 10 s).
  void Serve(Conn& c, std::chrono::steady_clock::time_point deadline);
  TlsContext tls() const;

  const int listen_fd_;
  const int port_;
  const Render render_;
  const std::function<bool(const std::string&)> token_ok_;
  mutable std::mutex tls_mu_;
  TlsContext tls_;  // guarded by tls_mu_
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  struct Waiting {
    int fd = -1;
    std::chrono::steady_clock::time_point deadline;  // accept + 10 s
  };
  std::deque<Waiting> queue_;  // accepted, waiting for a worker
  std::thread acceptor_;
  std::vector<std::thread> workers_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_METRICS_HTTP_H_
