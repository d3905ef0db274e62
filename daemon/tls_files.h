// The daemon's TLS files (--tls-cert-file, --tls-key-file,
// --tls-client-ca-file), re-read on SIGHUP so that a rotated certificate
// needs no restart (docs/security.md "Certificate rotation").
//
// gRPC serves them through its FileWatcherCertificateProvider, which
// re-reads files every second but needs them replaced atomically and a key
// that matches its certificate. So the daemon does not point it at the
// operator's files: at start and on each Reload it reads them, checks them
// (each PEM parses, the key is the certificate's, the CA bundle holds a
// certificate), and only then publishes copies into a private directory
// (0700, on /dev/shm when it can: the key copy never touches a disk) as a
// new generation behind a symlink swapped in one rename (the directory is
// removed at exit, and one left by a killed dmuond is removed by the next
// one to start). A bad file on
// SIGHUP is an error and the certificates in use stay. New connections get
// the new certificate within about a second; connections already open (and
// their sessions and streams) continue on the old one.

#ifndef DMUON_DAEMON_TLS_FILES_H_
#define DMUON_DAEMON_TLS_FILES_H_

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dmuon::server {

// INVALID_ARGUMENT unless `cert_pem` is a PEM certificate (chain) and
// `key_pem` the PEM private key of its first certificate.
absl::Status CheckKeyPair(const std::string& cert_pem,
                          const std::string& key_pem);
// INVALID_ARGUMENT unless `ca_pem` holds at least one PEM certificate.
absl::Status CheckCaBundle(const std::string& ca_pem);

// A warning for the log, or "": the first certificate of `cert_pem` has
// expired, is not valid yet, or expires within `soon_seconds` of `now`
// (seconds since the epoch). Clients refuse an expired certificate, so a
// daemon that starts (or reloads) with one serves no TLS client: said at
// once rather than found in every client's error.
std::string CertificateValidityWarning(const std::string& cert_pem, int64_t now,
                                       int64_t soon_seconds);

class TlsFiles {
 public:
  // The files as served now.
  struct Pem {
    std::string cert, key, ca;  // ca: empty without --tls-client-ca-file
  };

  // Reads, checks and publishes the files (`ca_file` empty: no mTLS).
  // Errors name the flag ("--tls-key-file=PATH: ...").
  static absl::StatusOr<std::unique_ptr<TlsFiles>> Create(std::string cert_file,
                                                          std::string key_file,
                                                          std::string ca_file);
  ~TlsFiles();  // removes the private directory

  // Re-reads the files (SIGHUP); on an error nothing changes. Returns the
  // first certificate's subject and expiry, for the log.
  absl::StatusOr<std::string> Reload();

  // TLS credentials for --listen served from the published files (mTLS
  // when there is a CA file: client certificates required and verified).
  std::shared_ptr<grpc::ServerCredentials> Credentials();

  Pem current() const;

 private:
  TlsFiles(std::string cert_file, std::string key_file, std::string ca_file,
           std::string dir)
      : cert_file_(std::move(cert_file)),
        key_file_(std::move(key_file)),
        ca_file_(std::move(ca_file)),
        dir_(std::move(dir)) {}
  absl::StatusOr<Pem> ReadAndCheck() const;
  absl::Status Publish(const Pem& pem);

  const std::string cert_file_, key_file_, ca_file_;
  const std::string dir_;  // the private directory
  mutable std::mutex mu_;
  Pem pem_;                  // guarded by mu_
  uint64_t generation_ = 0;  // guarded by mu_
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_TLS_FILES_H_
