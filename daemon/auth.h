// Who may call which RPC (docs/security.md): bearer tokens with roles
// (--auth-token-file) and mTLS client certificates (--tls-client-ca-file),
// checked by the gRPC adapter (grpc_service.cc) before each Optimizer RPC.
// Health and reflection are other services and stay open.
//
// Roles, each including the ones before it: reader (Status), trainer
// (OpenSession, Step, GetState, SetState, CloseSession), operator (Drain,
// Undrain; and every job is its own, server/principal.h).
//
// The token file: one `<role> <token> [name]` per line; blank lines and
// lines starting with '#' are skipped. `name` is the principal that owns
// the jobs the token creates; without one it is "token-" and 16 hex digits
// of a SHA-256 of the token (tokens sharing a name share their jobs).
// Tokens are kept only as SHA-256 digests. Optional trailing `key=value`
// fields are the principal's: `weight=<w>` ([0.01, 1000], default 1), its
// jobs' share of the executors against other backlogged jobs
// (server/scheduler.h); `max_jobs=<n>`, `max_state_bytes=<n>` and
// `max_device_share=<s>`, its quotas (server/quota.h; default none).
// Tokens sharing a name must give the same ones. --quotas-file
// (quotas_file.h) overrides them by principal name, and is the only source
// of them for mTLS principals (weight 1 and no quotas otherwise).

#ifndef DMUON_DAEMON_AUTH_H_
#define DMUON_DAEMON_AUTH_H_

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/quotas_file.h"
#include "server/principal.h"

namespace dmuon::server {

enum class Role { kNone = 0, kReader = 1, kTrainer = 2, kOperator = 3 };
const char* RoleName(Role role);

struct TokenEntry {
  Role role = Role::kNone;
  std::string name;   // the principal
  double weight = 1;  // `weight=`, Principal::weight
  Quotas quotas;      // `max_jobs=`, `max_state_bytes=`, Principal::quotas
};

// SHA-256 digest (raw bytes) of the token -> its entry. Errors name the
// line ("line 3: ...").
absl::StatusOr<std::map<std::string, TokenEntry>> ParseTokens(
    const std::string& text);

// An authenticated caller.
struct Caller {
  Role role = Role::kNone;
  Principal principal;
  // The SHA-256 of its token; empty without one (mTLS, anonymous). A stream
  // keeps it to be ended when a reload revokes the token (grpc_service.h).
  std::string token_digest;
};

class Authenticator {
 public:
  // `token_file`: --auth-token-file (empty: none); `mtls`: client
  // certificates are required and verified by TLS (--tls-client-ca-file).
  // Neither: every caller is anonymous and may call everything. An
  // unreadable or malformed token file is an error naming the flag.
  // `quotas` (--quotas-file; may be null, else outlives this): overrides
  // each authenticated principal's weight and quotas by its name.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      std::string token_file, bool mtls, const QuotasFile* quotas = nullptr);

  // Re-reads the token file (SIGHUP); on an error the tokens stay as they
  // were. Returns the number of tokens now.
  absl::StatusOr<size_t> Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // The role of `token` (without "Bearer "), kNone when it is not one of
  // the token file's (for the metrics port: any role may read /metrics).
  Role RoleOfToken(const std::string& token) const ABSL_LOCKS_EXCLUDED(mu_);
  // The same for a token's digest (Caller::token_digest), after a reload:
  // kNone once the token has left the file.
  Role RoleOfDigest(const std::string& digest) const ABSL_LOCKS_EXCLUDED(mu_);

  // The caller of `rpc`, which needs `need`: UNAUTHENTICATED without a
  // known token (tokens) or a certificate identity (mTLS only),
  // PERMISSION_DENIED naming the role needed when the token's is lower.
  // With mTLS and no tokens every certificate holder may call every RPC,
  // and owns jobs as the certificate's first URI SAN, else DNS SAN, else CN.
  absl::StatusOr<Caller> Check(const grpc::ServerContextBase& ctx,
                               const char* rpc, Role need) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Authenticator(std::string token_file, bool mtls, const QuotasFile* quotas)
      : token_file_(std::move(token_file)), mtls_(mtls), quotas_(quotas) {}
  const std::string token_file_;
  const bool mtls_;
  const QuotasFile* const quotas_;
  mutable absl::Mutex mu_;
  std::map<std::string, TokenEntry> tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_AUTH_H_
