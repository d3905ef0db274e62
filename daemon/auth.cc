#include "daemon/auth.h"

#include <grpc/grpc_security_constants.h>
#include <openssl/sha.h>

#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/token.h"
#include "daemon/operator_file.h"

namespace dmuon::server {
namespace {

std::string Sha256(const std::string& s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  return std::string(reinterpret_cast<const char*>(d), sizeof(d));
}

// `field` is one `key=value` option of a token line (auth.h, parsed as
// the quotas file's: quotas_file.h) into `e`.
absl::Status ParseOption(absl::string_view field, int line, TokenEntry* e) {
  PrincipalLimits limits;
  if (auto st = ParseLimitOption(field, line, &limits); !st.ok()) return st;
  Principal p;
  p.weight = e->weight;
  p.quotas = e->quotas;
  limits.ApplyTo(&p);
  e->weight = p.weight;
  e->quotas = p.quotas;
  return absl::OkStatus();
}

Role ParseRole(absl::string_view s) {
  if (s == "reader") return Role::kReader;
  if (s == "trainer") return Role::kTrainer;
  if (s == "operator") return Role::kOperator;
  return Role::kNone;
}

absl::StatusOr<std::map<std::string, TokenEntry>> ReadTokens(
    const std::string& path) {
  auto text =
      ReadOperatorFile(path, kMaxTokenFileBytes, "--auth-token-file=" + path);
  if (!text.ok()) return text.status();
  auto tokens = ParseTokens(*text);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError("--auth-token-file=" + path + ": " +
                                      std::string(tokens.status().message()));
  }
  if (tokens->empty()) {
    return absl::InvalidArgumentError("--auth-token-file=" + path +
                                      ": no tokens in it");
  }
  return tokens;
}

// The first value of `property` of the peer's certificate, or "".
std::string PeerProperty(const grpc::AuthContext& auth, const char* property) {
  for (const grpc::string_ref& v : auth.FindPropertyValues(property))
    if (v.size() > 0) return std::string(v.data(), v.size());
  return "";
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kReader:
      return "reader";
    case Role::kTrainer:
      return "trainer";
    case Role::kOperator:
      return "operator";
    default:
      return "none";
  }
}

absl::StatusOr<std::map<std::string, TokenEntry>> ParseTokens(
    const std::string& text) {
  std::map<std::string, TokenEntry> out;
  std::map<std::string, TokenEntry> principals;  // by name: its first
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    TokenEntry e;
    // Options: the trailing `key=value` fields after the token.
    while (f.size() >= 3 && absl::StrContains(f.back(), '=')) {
      if (absl::Status st = ParseOption(f.back(), n, &e); !st.ok()) return st;
      f.pop_back();
    }
    if (f.size() < 2 || f.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", n,
          ": expected '<role> <token> [name] [weight=<w>] [max_jobs=<n>] "
          "[max_state_bytes=<n>] [max_device_share=<s>]', got ",
          f.size(), " fields"));
    }
    e.role = ParseRole(f[0]);
    if (e.role == Role::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", n, ": role '", f[0],
                       "' is not reader, trainer or operator"));
    }
    const std::string token(f[1]);
    // A token no client could send (gRPC refuses the header) is refused
    // here, at load, rather than never matched.
    if (absl::Status st =
            CheckToken(token, absl::StrCat("line ", n, ": the token"));
        !st.ok()) {
      return st;
    }
    const std::string digest = Sha256(token);
    e.name = f.size() == 3 ? std::string(f[2])
                           : "token-" + absl::BytesToHexString(
                                            Sha256("dmuon principal\n" + token))
                                            .substr(0, 16);
    auto first = principals.emplace(e.name, e);
    if (!first.second && (first.first->second.weight != e.weight ||
                          !(first.first->second.quotas == e.quotas))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", n, ": the weight or quotas of principal '", e.name,
          "' differ from an earlier line's (a principal has one of each)"));
    }
    if (!out.emplace(digest, std::move(e)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", n, ": the same token twice"));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    std::string token_file, bool mtls, const QuotasFile* quotas) {
  std::unique_ptr<Authenticator> a(
      new Authenticator(std::move(token_file), mtls, quotas));
  if (!a->token_file_.empty()) {
    auto n = a->Reload();
    if (!n.ok()) return n.status();
  }
  return a;
}

absl::StatusOr<size_t> Authenticator::Reload() {
  if (token_file_.empty()) return 0;
  auto tokens = ReadTokens(token_file_);
  if (!tokens.ok()) return tokens.status();
  absl::MutexLock l(&mu_);
  tokens_ = *std::move(tokens);
  return tokens_.size();
}

Role Authenticator::RoleOfToken(const std::string& token) const {
  return RoleOfDigest(Sha256(token));
}

Role Authenticator::RoleOfDigest(const std::string& digest) const {
  absl::MutexLock l(&mu_);
  auto t = tokens_.find(digest);
  return t == tokens_.end() ? Role::kNone : t->second.role;
}

absl::StatusOr<Caller> Authenticator::Check(const grpc::ServerContextBase& ctx,
                                            const char* rpc, Role need) const {
  Caller c;
  if (!token_file_.empty()) {
    const auto& md = ctx.client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) {
      return absl::UnauthenticatedError(
          "dmuond requires a token: send 'authorization: Bearer <token>' "
          "metadata (dmuonctl --token-file, DMUON_TOKEN)");
    }
    absl::string_view v(it->second.data(), it->second.size());
    if (!absl::ConsumePrefix(&v, "Bearer ")) {
      return absl::UnauthenticatedError(
          "the authorization metadata is not 'Bearer <token>'");
    }
    const std::string digest = Sha256(std::string(v));
    absl::MutexLock l(&mu_);
    auto t = tokens_.find(digest);
    if (t == tokens_.end()) return absl::UnauthenticatedError("unknown token");
    c.role = t->second.role;
    c.principal.name = t->second.name;
    c.principal.any_job = c.role == Role::kOperator;
    c.principal.weight = t->second.weight;
    c.principal.quotas = t->second.quotas;
    c.token_digest = digest;
    if (quotas_ != nullptr) quotas_->ApplyTo(&c.principal);
  } else if (mtls_) {
    // TLS verified the certificate against --tls-client-ca-file.
    auto auth = ctx.auth_context();
    std::string id;
    if (auth) {
      if (std::string u = PeerProperty(*auth, GRPC_PEER_URI_PROPERTY_NAME);
          !u.empty()) {
        id = "uri:" + u;
      } else if (std::string d =
                     PeerProperty(*auth, GRPC_PEER_DNS_PROPERTY_NAME);
                 !d.empty()) {
        id = "dns:" + d;
      } else if (std::string cn =
                     PeerProperty(*auth, GRPC_X509_CN_PROPERTY_NAME);
                 !cn.empty()) {
        id = "cn:" + cn;
      }
    }
    if (id.empty()) {
      return absl::UnauthenticatedError(
          "the client certificate names no URI or DNS SAN and no CN");
    }
    c.role = Role::kOperator;
    c.principal.name = id;
    if (quotas_ != nullptr) quotas_->ApplyTo(&c.principal);
  } else {
    c.role = Role::kOperator;  // anonymous: no auth configured
    return c;
  }
  if (c.role < need) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " needs role '", RoleName(need),
        "' (or higher); this token's role is '", RoleName(c.role), "'"));
  }
  return c;
}

}  // namespace dmuon::server
