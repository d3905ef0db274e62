#include "tests/soak_attack.h"

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tests/soak_report.h"

namespace dmuon::testing {
namespace {

// One attacker: its flags besides --server, --mode, --report (and
// --token_file when `token`), the codes its defense answers, and the one
// it must get at least once ("" for none: half_close's streams end OK or
// ABORTED as the race between the half-close and the step goes).
struct Mode {
  const char* name;
  bool token;
  std::vector<std::string> flags;
  std::set<std::string> expected;
  std::string refusal;
};

std::vector<Mode> Modes(const std::vector<std::string>& foreign_jobs) {
  return {
      {"reflection",
       false,
       {"--streams=4", "--pause_ms=50"},
       {"UNIMPLEMENTED"},
       "UNIMPLEMENTED"},
      // 12 readers of 2 MiB matrices: each holds a lease of 4 MiB (the
      // chunk twice), so 4 fill --max-state-read-bytes (16 MiB) and the
      // others are refused after the daemon's 10 s wait.
      {"stalled_reader",
       true,
       {"--job=soak-attacker-stalled", "--params=8", "--rows=512",
        "--cols=1024", "--streams=12", "--hold_seconds=12", "--pause_ms=100"},
       {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED"},
       "RESOURCE_EXHAUSTED"},
      // A refusal names the job id only: not its owner, table or state.
      {"foreign_open",
       true,
       {"--jobs=" + absl::StrJoin(foreign_jobs, ","),
        "--secrets=soak-trainer,world_size,parameter,momentum,step",
        "--pause_ms=20"},
       {"PERMISSION_DENIED"},
       "PERMISSION_DENIED"},
      {"half_close",
       true,
       {"--job=soak-attacker-half", "--params=2", "--rows=32", "--cols=32",
        "--pause_ms=50"},
       {"OK", "ABORTED"},
       ""},
      {"reopen",
       true,
       {"--job=soak-attacker-reopen", "--params=2048", "--rows=32", "--cols=32",
        "--pause_ms=20"},
       {"OK"},
       "OK"},
  };
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string RandomToken() {
  std::random_device rd;
  std::string t = "soak-";
  for (int i = 0; i < 32; ++i) t += "0123456789abcdef"[rd() % 16];
  return t;
}

AttackerResult ParseReport(const std::string& mode, const std::string& text) {
  AttackerResult r;
  r.mode = mode;
  std::istringstream in(text);
  std::string key;
  while (in >> key) {
    std::string name, rest;
    if (key == "did") {
      in >> r.did;
    } else if (key == "violations") {
      in >> r.violations;
    } else if (key == "code" && in >> name) {
      in >> r.codes[name];
    } else if (key == "count" && in >> name) {
      in >> r.counts[name];
    } else if (key == "stat" && in >> name) {
      in >> r.stats[name];
    } else if (key == "violation") {
      std::getline(in, rest);
      r.violation_lines.push_back(rest);
    } else {
      std::getline(in, rest);  // "mode ...", "ready"
    }
  }
  return r;
}

template <typename Map>
std::string JsonObject(const Map& m) {
  std::ostringstream o;
  o << "{";
  for (auto it = m.begin(); it != m.end(); ++it)
    o << (it == m.begin() ? "" : ", ") << JsonQuoted(it->first) << ": "
      << it->second;
  return o.str() + "}";
}

}  // namespace

SoakPrincipals MakePrincipals(const std::string& dir) {
  SoakPrincipals p;
  p.trainer = RandomToken();
  p.attacker = RandomToken();
  p.operator_token = RandomToken();
  p.token_file = dir + "/tokens";
  std::ofstream(p.token_file)
      << "trainer " << p.trainer << " soak-trainer\n"
      << "trainer " << p.attacker << " soak-attacker\n"
      << "operator " << p.operator_token << " soak-operator\n";
  p.attacker_token_file = dir + "/attacker-token";
  std::ofstream(p.attacker_token_file) << p.attacker << "\n";
  return p;
}

std::vector<std::string> SoakDaemonFlags(const SoakPrincipals& p,
                                         const std::string& state_dir) {
  return {"--auth-token-file=" + p.token_file, "--state-dir=" + state_dir,
          "--snapshot-every=5", "--job-retention-seconds=2",
          "--max-state-read-bytes=" + std::to_string(16 << 20)};
}

Attackers::Attackers(std::string address, SoakPrincipals principals,
                     std::vector<std::string> foreign_jobs, std::string dir)
    : address_(std::move(address)),
      principals_(std::move(principals)),
      foreign_jobs_(std::move(foreign_jobs)),
      dir_(std::move(dir)) {}

Attackers::~Attackers() = default;  // Process SIGKILLs what still runs

std::string Attackers::Start() {
  for (const Mode& m : Modes(foreign_jobs_)) {
    const std::string base = dir_ + "/attacker-" + m.name;
    std::vector<std::string> argv = {
        Runfile("tests/attacker"), "--server=" + address_,
        std::string("--mode=") + m.name, "--report=" + base + ".report"};
    if (m.token)
      argv.push_back("--token_file=" + principals_.attacker_token_file);
    argv.insert(argv.end(), m.flags.begin(), m.flags.end());
    processes_.push_back(std::make_unique<Process>(argv, base + ".log"));
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(120);
  const std::vector<Mode> modes = Modes(foreign_jobs_);
  for (size_t i = 0; i < modes.size(); ++i) {
    const std::string base = dir_ + "/attacker-" + modes[i].name;
    while (ReadFile(base + ".report").find("ready") == std::string::npos) {
      if (processes_[i]->Wait(0) != -1 ||
          std::chrono::steady_clock::now() > deadline) {
        return absl::StrCat(
            "attacker ", modes[i].name,
            " did not set itself up: ", ReadFile(base + ".report"),
            ReadFile(base + ".log"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return "";
}

void Attackers::Stop() {
  for (auto& p : processes_) p->Signal(SIGTERM);
  const std::vector<Mode> modes = Modes(foreign_jobs_);
  results_.clear();
  for (size_t i = 0; i < processes_.size(); ++i) {
    const int code = processes_[i]->Wait(60);
    const std::string base = dir_ + "/attacker-" + modes[i].name;
    results_.push_back(ParseReport(modes[i].name, ReadFile(base + ".report")));
    results_.back().exit_code = code;
  }
}

std::vector<std::string> Attackers::Failures() const {
  std::vector<std::string> out;
  const std::vector<Mode> modes = Modes(foreign_jobs_);
  if (results_.size() != modes.size()) return {"the attackers were not run"};
  for (size_t i = 0; i < modes.size(); ++i) {
    const Mode& m = modes[i];
    const AttackerResult& r = results_[i];
    const std::string who = std::string("attacker ") + m.name + ": ";
    const std::string log = ReadFile(dir_ + "/attacker-" + m.name + ".log");
    if (r.exit_code != 0)
      out.push_back(who + "exit code " + std::to_string(r.exit_code) + "\n" +
                    log);
    if (r.did <= 0) out.push_back(who + "did nothing\n" + log);
    for (const auto& [code, n] : r.codes)
      if (m.expected.count(code) == 0)
        out.push_back(absl::StrCat(who, n, " x ", code,
                                   ", which its defense "
                                   "never answers"));
    if (!m.refusal.empty() && r.codes.count(m.refusal) == 0)
      out.push_back(who + "never got " + m.refusal);
    if (r.violations != 0)
      out.push_back(absl::StrCat(who, r.violations, " violations, e.g.",
                                 absl::StrJoin(r.violation_lines, "\n  ")));
  }
  return out;
}

void Attackers::Print() const {
  for (const AttackerResult& r : results_) {
    std::string codes, extra;
    for (const auto& [c, n] : r.codes) absl::StrAppend(&codes, ", ", c, " ", n);
    for (const auto& [c, n] : r.counts)
      absl::StrAppend(&extra, ", ", c, " ", n);
    for (const auto& [c, x] : r.stats)
      absl::StrAppend(&extra, ", ", c, " ", absl::StrFormat("%.1f", x));
    std::printf("soak: attacker %-14s %lld done%s, %lld violations%s\n",
                r.mode.c_str(), static_cast<long long>(r.did), codes.c_str(),
                static_cast<long long>(r.violations), extra.c_str());
  }
  std::fflush(stdout);
}

std::string Attackers::Json() const {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < results_.size(); ++i) {
    const AttackerResult& r = results_[i];
    std::vector<std::string> lines;
    for (const std::string& v : r.violation_lines)
      lines.push_back(JsonQuoted(v));
    o << (i ? ",\n    " : "\n    ") << "{\"mode\": " << JsonQuoted(r.mode)
      << ", \"exit_code\": " << r.exit_code << ", \"did\": " << r.did
      << ", \"violations\": " << r.violations
      << ", \"codes\": " << JsonObject(r.codes)
      << ", \"counts\": " << JsonObject(r.counts)
      << ", \"stats\": " << JsonObject(r.stats) << ", \"violation_examples\": ["
      << absl::StrJoin(lines, ", ") << "]}";
  }
  return o.str() + "\n  ]";
}

}  // namespace dmuon::testing
