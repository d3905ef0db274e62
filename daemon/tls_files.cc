#include "daemon/tls_files.h"

#include <fcntl.h>
#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/operator_file.h"

namespace dmuon::server {
namespace {

// Refresh interval of gRPC's file watcher, seconds.
constexpr unsigned kWatchSeconds = 1;

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "not PEM";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

absl::StatusOr<std::string> ReadFile(const char* flag,
                                     const std::string& path) {
  auto pem =
      ReadOperatorFile(path, kMaxPemFileBytes, absl::StrCat(flag, "=", path));
  if (pem.ok() && pem->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": the file is empty"));
  }
  return pem;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;

Bio MemBio(const std::string& s) {
  return Bio(BIO_new_mem_buf(s.data(), static_cast<int>(s.size())));
}

Cert FirstCert(const std::string& pem) {
  Bio b = MemBio(pem);
  return Cert(b ? PEM_read_bio_X509(b.get(), nullptr, nullptr, nullptr)
                : nullptr);
}

// "subject ..., expires ..." of the first certificate of `pem`.
std::string Describe(const std::string& pem) {
  Cert c = FirstCert(pem);
  if (!c) return "?";
  char subject[256] = "";
  X509_NAME_oneline(X509_get_subject_name(c.get()), subject, sizeof(subject));
  std::string expires = "?";
  Bio out(BIO_new(BIO_s_mem()));
  if (out && ASN1_TIME_print(out.get(), X509_get0_notAfter(c.get()))) {
    char* data = nullptr;
    const long n = BIO_get_mem_data(out.get(), &data);
    expires.assign(data, static_cast<size_t>(n));
  }
  return absl::StrCat("subject ", subject, ", expires ", expires);
}

absl::Status WriteFile(const std::string& path, const std::string& data) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", path, ": ", strerror(errno)));
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n <= 0) {
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot write ", path));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return absl::OkStatus();
}

// Removes the private directories in `base` of dmuond processes of this
// user that are gone (killed: no destructor ran), named
// dmuond-tls-<pid>-XXXXXX.
void RemoveStaleDirs(const std::string& base) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("dmuond-tls-", 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + 11, &end, 10);
    struct stat st;
    if (pid <= 0 || end == nullptr || *end != '-' ||
        ::lstat(e.path().c_str(), &st) != 0 || st.st_uid != ::getuid() ||
        !S_ISDIR(st.st_mode))
      continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code rm;
      std::filesystem::remove_all(e.path(), rm);
    }
  }
}

// A private directory for the published copies: on /dev/shm when it can.
absl::StatusOr<std::string> MakePrivateDir() {
  std::vector<std::string> bases = {"/dev/shm"};
  if (const char* t = getenv("TMPDIR"); t != nullptr && *t != '\0')
    bases.push_back(t);
  bases.push_back("/tmp");
  for (const std::string& base : bases) {
    RemoveStaleDirs(base);
    std::string tmpl =
        absl::StrCat(base, "/dmuond-tls-", ::getpid(), "-XXXXXX");
    if (mkdtemp(tmpl.data()) != nullptr) return tmpl;  // mode 0700
  }
  return absl::UnavailableError(
      "cannot make a private directory for the TLS files (/dev/shm, $TMPDIR "
      "and /tmp refused)");
}

}  // namespace

absl::Status CheckKeyPair(const std::string& cert_pem,
                          const std::string& key_pem) {
  ERR_clear_error();
  Cert cert = FirstCert(cert_pem);
  if (!cert) {
    return absl::InvalidArgumentError("not a PEM certificate (" +
                                      OpenSslError() + ")");
  }
  Bio kb = MemBio(key_pem);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      kb ? PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr)
         : nullptr);
  if (!key) {
    return absl::InvalidArgumentError("not a PEM private key (" +
                                      OpenSslError() + ")");
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        "the private key is not the certificate's");
  }
  return absl::OkStatus();
}

std::string CertificateValidityWarning(const std::string& cert_pem, int64_t now,
                                       int64_t soon_seconds) {
  Cert c = FirstCert(cert_pem);
  if (!c) return "";
  time_t t = static_cast<time_t>(now);
  time_t soon = static_cast<time_t>(now + soon_seconds);
  const std::string described = Describe(cert_pem);
  if (X509_cmp_time(X509_get0_notAfter(c.get()), &t) < 0)
    return absl::StrCat("the certificate has expired (", described,
                        "): TLS clients will refuse it");
  if (X509_cmp_time(X509_get0_notBefore(c.get()), &t) > 0)
    return absl::StrCat("the certificate is not valid yet (", described,
                        "): TLS clients will refuse it");
  if (X509_cmp_time(X509_get0_notAfter(c.get()), &soon) < 0)
    return absl::StrCat("the certificate expires soon (", described,
                        "): renew it and send SIGHUP");
  return "";
}

absl::Status CheckCaBundle(const std::string& ca_pem) {
  ERR_clear_error();
  if (!FirstCert(ca_pem)) {
    return absl::InvalidArgumentError("no PEM certificate in it (" +
                                      OpenSslError() + ")");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Create(
    std::string cert_file, std::string key_file, std::string ca_file) {
  auto dir = MakePrivateDir();
  if (!dir.ok()) return dir.status();
  std::unique_ptr<TlsFiles> t(new TlsFiles(
      std::move(cert_file), std::move(key_file), std::move(ca_file), *dir));
  auto pem = t->ReadAndCheck();
  if (!pem.ok()) return pem.status();
  if (absl::Status st = t->Publish(*pem); !st.ok()) return st;
  const std::string cur = t->dir_ + "/current/";
  t->provider_ =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          cur + "key.pem", cur + "cert.pem",
          t->ca_file_.empty() ? "" : cur + "ca.pem", kWatchSeconds);
  return t;
}

TlsFiles::~TlsFiles() {
  provider_.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

absl::StatusOr<TlsFiles::Pem> TlsFiles::ReadAndCheck() const {
  Pem p;
  auto cert = ReadFile("--tls-cert-file", cert_file_);
  if (!cert.ok()) return cert.status();
  auto key = ReadFile("--tls-key-file", key_file_);
  if (!key.ok()) return key.status();
  if (absl::Status st = CheckKeyPair(*cert, *key); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert-file=", cert_file_,
                     ", --tls-key-file=", key_file_, ": ", st.message()));
  }
  p.cert = *std::move(cert);
  p.key = *std::move(key);
  if (!ca_file_.empty()) {
    auto ca = ReadFile("--tls-client-ca-file", ca_file_);
    if (!ca.ok()) return ca.status();
    if (absl::Status st = CheckCaBundle(*ca); !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-client-ca-file=", ca_file_, ": ", st.message()));
    }
    p.ca = *std::move(ca);
  }
  return p;
}

absl::Status TlsFiles::Publish(const Pem& pem) {
  std::lock_guard<std::mutex> l(mu_);
  const uint64_t gen = generation_ + 1;
  const std::string name = absl::StrCat("g", gen);
  const std::string g = dir_ + "/" + name;
  if (::mkdir(g.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", g, ": ", strerror(errno)));
  }
  const std::pair<const char*, const std::string*> files[] = {
      {"key.pem", &pem.key}, {"cert.pem", &pem.cert}, {"ca.pem", &pem.ca}};
  for (const auto& [file, data] : files) {
    if (data->empty()) continue;  // no CA file
    if (absl::Status st = WriteFile(g + "/" + file, *data); !st.ok()) return st;
  }
  // The watcher sees the old generation or the new one, never a mix of
  // files being written.
  const std::string link = dir_ + "/current";
  const std::string tmp = link + ".tmp";
  ::unlink(tmp.c_str());
  if (::symlink(name.c_str(), tmp.c_str()) != 0 ||
      ::rename(tmp.c_str(), link.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot switch ", link, " to ", g, ": ", strerror(errno)));
  }
  // Two generations back is no longer read by anyone.
  if (gen > 2) {
    std::error_code ec;
    std::filesystem::remove_all(absl::StrCat(dir_, "/g", gen - 2), ec);
  }
  generation_ = gen;
  pem_ = pem;
  return absl::OkStatus();
}

absl::StatusOr<std::string> TlsFiles::Reload() {
  auto pem = ReadAndCheck();
  if (!pem.ok()) return pem.status();
  if (absl::Status st = Publish(*pem); !st.ok()) return st;
  return Describe(pem->cert);
}

std::shared_ptr<grpc::ServerCredentials> TlsFiles::Credentials() {
  grpc::experimental::TlsServerCredentialsOptions opts(provider_);
  opts.watch_identity_key_cert_pairs();
  if (!ca_file_.empty()) {
    opts.watch_root_certs();
    opts.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    opts.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(opts);
}

TlsFiles::Pem TlsFiles::current() const {
  std::lock_guard<std::mutex> l(mu_);
  return pem_;
}

}  // namespace dmuon::server
