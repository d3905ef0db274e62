// dmuonctl: the operator's command line over dmuond's RPCs.
//   dmuonctl [--server=HOST:PORT] [--timeout-secs=N] [--token-file=F]
//   [--tls-ca-file=F [--tls-cert-file=F --tls-key-file=F]]
//   status [--json] | health | sessions | drain | undrain
//   | trace --out=FILE [--seconds=N]
// A flag left out comes from the environment the Python client reads:
// $DMUON_SERVER, $DMUON_TOKEN or $DMUON_TOKEN_FILE, $DMUON_TLS_CA_FILE,
// $DMUON_TLS_CERT_FILE, $DMUON_TLS_KEY_FILE, $DMUON_TLS_SERVER_NAME.
// Exit status: 0 on success (health: SERVING), 1 otherwise, 2 on usage errors.

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/token.h"
#include "daemon/flags.h"
#include "daemon/operator_file.h"
#include "proto/dmuon.grpc.pb.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(std::string, server, "",
          "dmuond address (default: $DMUON_SERVER, else 127.0.0.1:50051)");
ABSL_FLAG(int, timeout_secs, 5, "deadline of each call");
ABSL_FLAG(bool, json, false, "status/sessions: print JSON instead of a table");
ABSL_FLAG(std::string, out, "",
          "trace: the file to write the step timeline to (Chrome trace-event "
          "JSON; merge it with the trainer's: python -m dmuon.trace merge)");
ABSL_FLAG(double, seconds, 5, "trace: how long to record, in (0, 600]");
ABSL_FLAG(
    std::string, service, "",
    "health: the service to check (\"\" = serving state, NOT_SERVING while "
    "draining; \"dmuon.liveness\" = the process answers)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the token to send (dmuond --auth-token-file; default: "
          "$DMUON_TOKEN_FILE, or the token in $DMUON_TOKEN); health needs "
          "none");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA of dmuond's certificate: connect with TLS (default: "
          "$DMUON_TLS_CA_FILE)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate for mTLS (with --tls-key-file; default: "
          "$DMUON_TLS_CERT_FILE)");
ABSL_FLAG(std::string, tls_key_file, "",
          "PEM key of --tls-cert-file (default: $DMUON_TLS_KEY_FILE)");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check dmuond's certificate against (default: "
          "$DMUON_TLS_SERVER_NAME, else the --server host)");

namespace {

using dmuon::v1::Optimizer;

std::string& Token() {
  static std::string token;
  return token;
}

// The daemon to talk to (Channel sets it).
std::string& Server() {
  static std::string server = "127.0.0.1:50051";
  return server;
}

// `flag`'s value when given, else $`env` ("" when unset); `*from` says
// which, for messages ("--name=value" or "$ENV=value").
std::string Setting(const absl::Flag<std::string>& flag, const char* name,
                    const char* env, std::string* from = nullptr) {
  std::string v = absl::GetFlag(flag);
  if (!v.empty()) {
    if (from) *from = absl::StrCat("--", name, "=", v);
    return v;
  }
  const char* e = std::getenv(env);
  v = e ? e : "";
  if (from) *from = absl::StrCat("$", env, "=", v);
  return v;
}

// The call's deadline and, with --token-file, its token.
void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(absl::GetFlag(FLAGS_timeout_secs)));
  if (!Token().empty()) ctx->AddMetadata("authorization", "Bearer " + Token());
}

// The regular file `path` (ReadOperatorFile: at most `max` bytes, a FIFO or
// device refused without blocking on it), without surrounding whitespace;
// an error naming `what` otherwise.
absl::StatusOr<std::string> ReadFile(const std::string& path, size_t max,
                                     const std::string& what) {
  auto out = dmuon::ReadOperatorFile(path, max, what);
  if (!out.ok()) return out.status();
  const size_t b = out->find_first_not_of(" \t\r\n");
  const size_t e = out->find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : out->substr(b, e - b + 1);
}

// The token to send: --token-file, else $DMUON_TOKEN_FILE, else
// $DMUON_TOKEN (not both variables, as the Python client says); "" for
// none. Checked by base/token.h's rule.
absl::StatusOr<std::string> TokenSetting() {
  std::string from;
  const std::string file =
      Setting(FLAGS_token_file, "token-file", "DMUON_TOKEN_FILE", &from);
  const char* env = std::getenv("DMUON_TOKEN");
  if (file.empty()) {
    if (env == nullptr || *env == '\0') return std::string();
    if (absl::Status st = dmuon::CheckToken(env, "$DMUON_TOKEN"); !st.ok())
      return st;
    return std::string(env);
  }
  if (absl::GetFlag(FLAGS_token_file).empty() && env != nullptr && *env)
    return absl::InvalidArgumentError(
        "set $DMUON_TOKEN or $DMUON_TOKEN_FILE, not both");
  auto token = ReadFile(file, dmuon::kMaxTokenBytes + 2, from);
  if (!token.ok()) return token.status();
  if (absl::Status st = dmuon::CheckToken(*token, from); !st.ok()) return st;
  return token;
}

// A Status lists every job and session: it may exceed gRPC's 4 MiB default
// for a received message (the daemon sends up to its --max-message-bytes).
grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  return args;
}

// The channel to the daemon (--server, else $DMUON_SERVER): TLS with a CA
// file, else plaintext. Null (after a message) when a setting is unusable.
std::shared_ptr<grpc::Channel> Channel() {
  std::string from;
  const std::string server =
      Setting(FLAGS_server, "server", "DMUON_SERVER", &from);
  if (!server.empty()) Server() = server;
  if (Server().find(',') != std::string::npos) {
    std::fprintf(stderr,
                 "dmuonctl: %s lists a pool; dmuonctl talks to one daemon: "
                 "pass --server=HOST:PORT of one of them\n",
                 from.c_str());
    return nullptr;
  }
  auto token = TokenSetting();
  if (!token.ok()) {
    std::fprintf(stderr, "dmuonctl: %s\n",
                 std::string(token.status().message()).c_str());
    return nullptr;
  }
  Token() = *std::move(token);
  const std::string names[] = {"tls-ca-file", "tls-cert-file", "tls-key-file"};
  const absl::Flag<std::string>* flags[] = {
      &FLAGS_tls_ca_file, &FLAGS_tls_cert_file, &FLAGS_tls_key_file};
  const char* envs[] = {"DMUON_TLS_CA_FILE", "DMUON_TLS_CERT_FILE",
                        "DMUON_TLS_KEY_FILE"};
  grpc::SslCredentialsOptions ssl;
  std::string* pems[] = {&ssl.pem_root_certs, &ssl.pem_cert_chain,
                         &ssl.pem_private_key};
  for (int i = 0; i < 3; ++i) {
    const std::string path =
        Setting(*flags[i], names[i].c_str(), envs[i], &from);
    if (path.empty()) continue;
    // PEM files: bounded (a certificate chain is a few KiB).
    auto pem = ReadFile(path, 1 << 20, from);
    if (!pem.ok()) {
      std::fprintf(stderr, "dmuonctl: %s\n",
                   std::string(pem.status().message()).c_str());
      return nullptr;
    }
    *pems[i] = *std::move(pem) + "\n";
  }
  if (ssl.pem_root_certs.empty()) {
    if (!ssl.pem_cert_chain.empty()) {
      std::fprintf(stderr, "dmuonctl: --tls-cert-file needs --tls-ca-file\n");
      return nullptr;
    }
    return grpc::CreateCustomChannel(
        Server(), grpc::InsecureChannelCredentials(), ChannelArgs());
  }
  grpc::ChannelArguments args = ChannelArgs();
  const std::string name = Setting(FLAGS_tls_server_name, "tls-server-name",
                                   "DMUON_TLS_SERVER_NAME");
  if (!name.empty()) args.SetSslTargetNameOverride(name);
  return grpc::CreateCustomChannel(Server(), grpc::SslCredentials(ssl), args);
}

// `s` with every byte a terminal could act on (control bytes, DEL,
// anything outside ASCII) as \xNN: the daemon's strings (errors, paths,
// device names) are printed as text, never as terminal escapes.
std::string Safe(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

int Failed(const char* what, const grpc::Status& st) {
  std::fprintf(stderr, "dmuonctl: %s %s: %s (%d)\n", what,
               Safe(Server()).c_str(), Safe(st.error_message()).c_str(),
               static_cast<int>(st.error_code()));
  return 1;
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

// A line "TITLE  name=n  ..." of `counts`, sorted by name (a proto map's
// order is unspecified); nothing when it is empty.
void PrintCounts(const char* title,
                 const google::protobuf::Map<std::string, uint64_t>& counts) {
  if (counts.empty()) return;
  const std::map<std::string, uint64_t> sorted(counts.begin(), counts.end());
  std::printf("\n%s", title);
  for (const auto& [name, n] : sorted) {
    std::printf("  %s=%llu", Safe(name).c_str(),
                static_cast<unsigned long long>(n));
  }
  std::printf("\n");
}

// The jobs table of `dmuonctl status`.
void PrintJobs(const dmuon::v1::StatusResponse& s) {
  // DROP_IN_S: a job with no open rank is dropped (its momentum freed,
  // snapshotted first with --state-dir) in that many seconds; "-" while a
  // rank is open.
  // SHARE: of the executors' time spent on the listed jobs (the
  // scheduler's accounting); WAIT_MS: a matrix's mean and longest queue
  // wait; WEIGHT: its principal's (docs/design.md, sharing). MARKS: the
  // steps it may be resumed at besides its own (docs/protocol.md "Marks").
  std::printf("\n%-24s %6s %6s %8s %12s %10s %10s %6s %6s %15s %s\n", "JOB",
              "RANKS", "OPEN", "PARAMS", "STATE_MB", "STEPS", "DROP_IN_S",
              "WEIGHT", "SHARE", "WAIT_MS(AVG/MAX)", "MARKS");
  for (const auto& j : s.jobs()) {
    char drop[32] = "-";
    if (j.on_disk())
      std::snprintf(drop, sizeof(drop), "on disk");  // resumes when opened
    else if (j.ranks_open() == 0)
      std::snprintf(drop, sizeof(drop), "%.0f", j.drop_in_seconds());
    char wait[40];
    std::snprintf(wait, sizeof(wait), "%.1f/%.1f",
                  j.queue_wait_mean_seconds() * 1e3,
                  j.queue_wait_max_seconds() * 1e3);
    std::string marks = j.marks_size() > 0 ? "" : "-";
    for (int64_t m : j.marks())
      absl::StrAppend(&marks, marks.empty() ? "" : ",", m);
    std::printf("%-24s %6d %6d %8d %12.1f %10lld %10s %6.2f %5.1f%% %15s %s\n",
                Safe(j.job_id()).c_str(), j.world_size(), j.ranks_open(),
                j.parameters(), j.state_bytes() / 1e6,
                static_cast<long long>(j.completed_steps()), drop, j.weight(),
                j.device_share() * 100, wait, marks.c_str());
    if (j.rewind_waiting_ranks_size() > 0) {
      std::string ranks;
      for (int r : j.rewind_waiting_ranks())
        absl::StrAppend(&ranks, ranks.empty() ? "" : ", ", r);
      std::printf(
          "  rank(s) %s asked to rewind step %lld and wait for the "
          "others\n",
          ranks.c_str(), static_cast<long long>(j.rewind_step()));
    }
  }
}

int Status(Optimizer::Stub& stub, bool sessions_only) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  dmuon::v1::StatusResponse s;
  grpc::Status st = stub.Status(&ctx, dmuon::v1::StatusRequest(), &s);
  if (!st.ok()) return Failed("Status", st);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(s).c_str());
    return 0;
  }
  if (!sessions_only) {
    std::printf("dmuond %s  uptime %.0fs  %s\n", Safe(s.version()).c_str(),
                s.uptime_seconds(), s.serving() ? "SERVING" : "DRAINING");
    const auto& l = s.step_latency();
    std::printf(
        "steps %llu  latency p50 %.4fs  p90 %.4fs  p99 %.4fs  max %.4fs\n",
        static_cast<unsigned long long>(l.count()), l.p50_seconds(),
        l.p90_seconds(), l.p99_seconds(), l.max_seconds());
    // STEP_PRED_MS / STEP_MEAS_MS: the open jobs' per-step load on the
    // executor, as planned and as measured in their last completed steps;
    // MEAS/PRED their ratio ("-" with nothing planned there).
    std::printf("\n%-12s %12s %8s %12s %16s %10s %13s %13s %9s %9s\n",
                "EXECUTOR", "BUSY_S", "QUEUE", "MATRICES", "GFLOP", "MEM_MB",
                "STEP_PRED_MS", "STEP_MEAS_MS", "MEAS/PRED", "HEALTHY");
    for (const auto& e : s.executors()) {
      char ratio[32] = "-";
      if (e.predicted_step_seconds() > 0) {
        std::snprintf(ratio, sizeof(ratio), "%.2f",
                      e.measured_step_seconds() / e.predicted_step_seconds());
      }
      std::printf(
          "%-12s %12.2f %8d %12llu %16.1f %10.1f %13.3f %13.3f %9s %9s\n",
          Safe(e.device()).c_str(), e.busy_seconds(), e.queue_depth(),
          static_cast<unsigned long long>(e.matrices()), e.flops() / 1e9,
          e.memory_bytes() / 1e6, e.predicted_step_seconds() * 1e3,
          e.measured_step_seconds() * 1e3, ratio, e.healthy() ? "yes" : "NO");
      if (!e.last_error().empty())
        std::printf("  %s\n", Safe(e.last_error()).c_str());
      if (e.graph_fallbacks() > 0) {
        std::printf(
            "  %llu kernel plan(s) run eagerly: their CUDA graph "
            "failed (see the daemon's log)\n",
            static_cast<unsigned long long>(e.graph_fallbacks()));
      }
    }
    PrintJobs(s);
    PrintCounts("ERRORS", s.errors());
    // Every fallback kind (docs/design.md "Fallbacks"); a daemon from
    // before them sends none.
    PrintCounts("FALLBACKS", s.fallbacks());
    // With --state-dir: the last snapshot failures (write errors, stale
    // states refused, corrupt files moved aside), oldest first.
    if (s.snapshot_errors_size() > 0) {
      std::printf("\nSNAPSHOT ERRORS (%d, oldest first)\n",
                  s.snapshot_errors_size());
      for (const auto& e : s.snapshot_errors())
        std::printf("  %s\n", Safe(e).c_str());
    }
    std::printf("\n");
  }
  std::printf("%-24s %5s %-16s %8s %12s %12s %10s\n", "SESSION_JOB", "RANK",
              "TRANSPORT", "STEP", "RECEIVED_MB", "SENT_MB", "OPEN_S");
  for (const auto& x : s.sessions()) {
    std::printf("%-24s %5d %-16s %8lld %12.1f %12.1f %10.0f\n",
                Safe(x.job_id()).c_str(), x.rank(),
                dmuon::v1::Transport_Name(x.transport()).c_str(),
                static_cast<long long>(x.step()), x.bytes_received() / 1e6,
                x.bytes_sent() / 1e6, x.open_seconds());
  }
  return 0;
}

int Health(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) return Failed("health check of", st);
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  std::printf("%s\n", name.c_str());
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0
                                                                         : 1;
}

int Drain(Optimizer::Stub& stub) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  dmuon::v1::DrainResponse resp;
  grpc::Status st = stub.Drain(&ctx, dmuon::v1::DrainRequest(), &resp);
  if (!st.ok()) return Failed("Drain", st);
  std::printf("draining: new sessions refused; %d sessions still open\n",
              resp.sessions());
  return 0;
}

// Records dmuond's step timeline for --seconds into --out.
int Trace(Optimizer::Stub& stub) {
  const std::string out = absl::GetFlag(FLAGS_out);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (out.empty()) {
    std::fprintf(stderr, "dmuonctl: trace needs --out=FILE\n");
    return 2;
  }
  if (!(seconds > 0 && seconds <= 600)) {
    std::fprintf(stderr, "dmuonctl: --seconds must be in (0, 600], got %g\n",
                 seconds);
    return 2;
  }
  std::FILE* f = std::fopen(out.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "dmuonctl: --out=%s cannot be written: %s\n",
                 out.c_str(), std::strerror(errno));
    return 2;
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);  // the token; the deadline is the window's plus it
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(
                       1000 * (seconds + absl::GetFlag(FLAGS_timeout_secs)))));
  dmuon::v1::TraceRequest req;
  req.set_seconds(seconds);
  auto reader = stub.Trace(&ctx, req);
  dmuon::v1::TraceChunk c;
  size_t bytes = 0;
  while (reader->Read(&c)) {
    bytes += std::fwrite(c.data().data(), 1, c.data().size(), f);
  }
  const bool closed = std::fclose(f) == 0;
  grpc::Status st = reader->Finish();
  if (!st.ok()) return Failed("Trace", st);
  if (!closed) {
    std::fprintf(stderr, "dmuonctl: --out=%s: write failed\n", out.c_str());
    return 1;
  }
  std::printf(
      "wrote %s (%zu bytes, %g s of dmuond's step timeline); merge it with "
      "the trainer's DMUON_TRACE file: python -m dmuon.trace merge OUT %s "
      "TRAINER.json\n",
      out.c_str(), bytes, seconds, out.c_str());
  return 0;
}

int Undrain(Optimizer::Stub& stub) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  dmuon::v1::UndrainResponse resp;
  grpc::Status st = stub.Undrain(&ctx, dmuon::v1::UndrainRequest(), &resp);
  if (!st.ok()) return Failed("Undrain", st);
  std::printf("undrained: new sessions accepted\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args = dmuon::server::ParseFlags(
      argc, argv,
      "dmuonctl: operator CLI for dmuond.\n"
      "  dmuonctl [--server=HOST:PORT] [--token-file=F] [--tls-ca-file=F "
      "[--tls-cert-file=F --tls-key-file=F]] status [--json] | health | "
      "sessions | drain | undrain | trace --out=FILE [--seconds=N]\n"
      "exit status: 0 ok (health: SERVING), 1 failure or not serving, 2 usage",
      "daemon/dmuonctl.cc");
  if (args.size() != 2) {
    std::fprintf(stderr,
                 "usage: dmuonctl [--server=HOST:PORT] "
                 "status|health|sessions|drain|undrain|trace\n");
    return 2;
  }
  const std::string& cmd = args[1];
  auto ch = Channel();
  if (!ch) return 2;
  auto stub = Optimizer::NewStub(ch);
  if (cmd == "status") return Status(*stub, false);
  if (cmd == "sessions") return Status(*stub, true);
  if (cmd == "health") return Health(ch);
  if (cmd == "drain") return Drain(*stub);
  if (cmd == "undrain") return Undrain(*stub);
  if (cmd == "trace") return Trace(*stub);
  std::fprintf(stderr,
               "dmuonctl: unknown command '%s' "
               "(status|health|sessions|drain|undrain|trace)\n",
               cmd.c_str());
  return 2;
}
