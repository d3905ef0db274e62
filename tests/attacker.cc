// An attacker process for the soak (tests/attacker.h): --mode picks the
// defect class, --report the file it writes "ready" to once set up and its
// Tally to when SIGTERM (or a failed setup) ends it. Exit 0 after SIGTERM,
// 2 when it could not set itself up.
//
//   reflection      token-less grpc.reflection.v1alpha.ServerReflection
//                   streams, --streams at once, each reopened when refused
//                   (with tokens dmuond serves none: UNIMPLEMENTED); one
//                   that is served is a violation, and is held open.
//   stalled_reader  GetState streams of its own job (--params matrices of
//                   --rows x --cols, its session attached and idle),
//                   --streams at once, each on its own connection: each
//                   reads the header and nothing more until --hold_seconds
//                   (DEADLINE_EXCEEDED) unless the daemon ends it first
//                   (RESOURCE_EXHAUSTED: --max-state-read-bytes).
//   foreign_open    OpenSession of other principals' job ids (--jobs, in
//                   turn): PERMISSION_DENIED naming none of --secrets; an
//                   open that succeeds is a violation (and is closed).
//   half_close      its own job: open, attach, one step's gradients
//                   (inline) and gradients_ready, then WritesDone at once
//                   (or after up to 3 ms); the stream must end with that
//                   step's step_complete or a non-OK status, and the next
//                   open's next_step must agree.
//   reopen          rank 0 of a 2-rank job of --params SHARDING_BLOCKS
//                   (--dense: replicated) matrices of --rows x --cols,
//                   opened and closed in a loop (rank 1 never comes);
//                   every open OK, its latency in the report.

#include "tests/attacker.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_split.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "");
ABSL_FLAG(std::string, mode, "",
          "reflection | stalled_reader | foreign_open | half_close | reopen");
ABSL_FLAG(std::string, token_file, "", "the token (alone); empty: none");
ABSL_FLAG(std::string, report, "", "where the report goes");
ABSL_FLAG(std::string, job, "attacker", "the attacker's own job id");
ABSL_FLAG(std::string, jobs, "", "foreign_open: job ids, comma-separated");
ABSL_FLAG(std::string, secrets, "",
          "foreign_open: words a refusal must not contain, comma-separated");
ABSL_FLAG(int, streams, 8, "concurrent streams");
ABSL_FLAG(int, pause_ms, 20, "between two attempts of one worker");
ABSL_FLAG(double, hold_seconds, 12, "stalled_reader: each stream's deadline");
ABSL_FLAG(int, params, 8, "matrices of the attacker's job");
ABSL_FLAG(int, rows, 512, "");
ABSL_FLAG(int, cols, 512, "");
ABSL_FLAG(bool, dense, false, "reopen: replicated matrices, not blocks");

namespace dmuon::testing {
namespace {

std::atomic<bool> stop{false};
std::string report_path;

void OnTerm(int) { stop.store(true); }

void WriteReady() { std::ofstream(report_path) << "ready\n"; }

}  // namespace

bool Stopped() { return stop.load(); }

void Pause(int ms) {
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!Stopped() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(ms, 20)));
}

std::unique_ptr<grpc::ClientContext> Ctx(const AttackOptions& o,
                                         double seconds) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!o.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o.token);
  ctx->set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  return ctx;
}

std::shared_ptr<grpc::Channel> OwnChannel(const std::string& server) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(),
                                   args);
}

void Tally::Got(grpc::StatusCode code) {
  std::lock_guard<std::mutex> l(mu_);
  ++codes_[absl::StatusCodeToString(static_cast<absl::StatusCode>(code))];
}

void Tally::Violation(const std::string& what) {
  std::lock_guard<std::mutex> l(mu_);
  ++counters_["violations"];
  if (violations_.size() < 5) violations_.push_back(what);
}

void Tally::Stat(const std::string& name, double value) {
  std::lock_guard<std::mutex> l(mu_);
  stats_[name] = value;
}

void Tally::Add(const std::string& counter, int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  counters_[counter] += n;
}

std::string Tally::Report() const {
  std::lock_guard<std::mutex> l(mu_);
  std::ostringstream o;
  o << "did " << (counters_.count("did") ? counters_.at("did") : 0) << "\n";
  o << "violations "
    << (counters_.count("violations") ? counters_.at("violations") : 0) << "\n";
  for (const auto& [name, n] : counters_)
    if (name != "did" && name != "violations")
      o << "count " << name << " " << n << "\n";
  for (const auto& [name, n] : codes_) o << "code " << name << " " << n << "\n";
  for (const auto& [name, x] : stats_) o << "stat " << name << " " << x << "\n";
  for (const std::string& v : violations_) {
    std::string line = v;
    for (char& c : line)
      if (c == '\n') c = ' ';
    o << "violation " << line << "\n";
  }
  return o.str();
}

}  // namespace dmuon::testing

int main(int argc, char** argv) {
  using namespace dmuon::testing;
  absl::ParseCommandLine(argc, argv);
  signal(SIGTERM, OnTerm);
  signal(SIGPIPE, SIG_IGN);
  report_path = absl::GetFlag(FLAGS_report);
  AttackOptions o;
  o.server = absl::GetFlag(FLAGS_server);
  if (const std::string f = absl::GetFlag(FLAGS_token_file); !f.empty()) {
    std::ifstream in(f);
    in >> o.token;
  }
  o.job = absl::GetFlag(FLAGS_job);
  for (absl::string_view j :
       absl::StrSplit(absl::GetFlag(FLAGS_jobs), ',', absl::SkipEmpty()))
    o.foreign_jobs.emplace_back(j);
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_secrets), ',', absl::SkipEmpty()))
    o.secrets.emplace_back(s);
  o.streams = absl::GetFlag(FLAGS_streams);
  o.pause_ms = absl::GetFlag(FLAGS_pause_ms);
  o.hold_seconds = absl::GetFlag(FLAGS_hold_seconds);
  o.params = absl::GetFlag(FLAGS_params);
  o.rows = absl::GetFlag(FLAGS_rows);
  o.cols = absl::GetFlag(FLAGS_cols);
  o.dense = absl::GetFlag(FLAGS_dense);

  const std::string mode = absl::GetFlag(FLAGS_mode);
  Tally tally;
  bool ok = false;
  if (mode == "reflection") {
    ok = AttackReflection(o, &tally, WriteReady);
  } else if (mode == "stalled_reader") {
    ok = AttackStalledReaders(o, &tally, WriteReady);
  } else if (mode == "foreign_open") {
    ok = AttackForeignOpens(o, &tally, WriteReady);
  } else if (mode == "half_close") {
    ok = AttackHalfCloses(o, &tally, WriteReady);
  } else if (mode == "reopen") {
    ok = AttackReopens(o, &tally, WriteReady);
  } else {
    tally.Violation("unknown --mode '" + mode + "'");
  }
  const std::string report = "mode " + mode + "\n" + tally.Report();
  if (!report_path.empty()) std::ofstream(report_path) << report;
  std::printf("%s", report.c_str());
  return ok ? 0 : 2;
}
