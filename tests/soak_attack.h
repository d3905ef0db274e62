// The soak's attackers (issue 27, "Done when"; tests/soak_test.cc): the
// soak's dmuond runs with --auth-token-file and --state-dir, and beside its
// honest sessions one tests/attacker process per defect class runs for the
// whole attacked phase:
//   reflection      token-less reflection streams, reopened when refused
//   stalled_reader  GetState streams of its own job that are never read
//   foreign_open    OpenSession of the honest principal's job ids, those
//                   open and those only in a snapshot file
//   half_close      half-closes right after the last gradients_ready
//   reopen          one rank of a large SHARDING_BLOCKS job reopened in a
//                   loop (OpenSession's work under the service lock)
// Each writes what it did and the codes it got (tests/attacker.h's Tally);
// Failures() is what the soak asserts of them: each ran (did > 0), exited
// 0, got only the codes its defense answers and its refusal at least once,
// and saw no violation.

#ifndef DMUON_TESTS_SOAK_ATTACK_H_
#define DMUON_TESTS_SOAK_ATTACK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/process.h"

namespace dmuon::testing {

// The soak daemon's principals, in `dir`/tokens: "soak-trainer" (the honest
// sessions), "soak-attacker" (a trainer too, owning none of the honest
// jobs) and "soak-operator" (the soak's Status calls). Random tokens.
struct SoakPrincipals {
  std::string token_file;
  std::string trainer, attacker, operator_token;
  std::string attacker_token_file;  // the attacker's token alone
};
SoakPrincipals MakePrincipals(const std::string& dir);

// The soak's dmuond flags besides its executors: tokens, --state-dir with
// a snapshot every 5 steps, jobs dropped to their snapshot 2 s after their
// last rank closes (so that some of the honest principal's jobs exist only
// as files), and a GetState budget the stalled readers exhaust.
std::vector<std::string> SoakDaemonFlags(const SoakPrincipals& p,
                                         const std::string& state_dir);

// What one attacker reported (tests/attacker.h, Tally::Report).
struct AttackerResult {
  std::string mode;
  int exit_code = -1;  // Process::Wait's
  int64_t did = 0, violations = 0;
  std::map<std::string, int64_t> codes, counts;
  std::map<std::string, double> stats;
  std::vector<std::string> violation_lines;  // the first few
};

class Attackers {
 public:
  // `foreign_jobs`: job ids of the honest principal (foreign_open's
  // targets; each must exist before Start, or the attacker would create
  // it). `dir`: the attackers' reports and logs.
  Attackers(std::string address, SoakPrincipals principals,
            std::vector<std::string> foreign_jobs, std::string dir);
  // SIGKILLs attackers still running (a failed test).
  ~Attackers();

  // Starts one process per mode and waits until each has set itself up
  // (up to 120 s): "" or what went wrong.
  std::string Start();
  // SIGTERM to each, waits for it (up to 60 s), reads its report.
  void Stop();
  // Empty when every attacker passed (see the top of this file).
  std::vector<std::string> Failures() const;
  // One "soak: attacker ..." line each.
  void Print() const;
  // A JSON array of the results.
  std::string Json() const;

 private:
  const std::string address_;
  const SoakPrincipals principals_;
  const std::vector<std::string> foreign_jobs_;
  const std::string dir_;
  std::vector<std::unique_ptr<Process>> processes_;  // by mode
  std::vector<AttackerResult> results_;              // by mode, after Stop
};

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_SOAK_ATTACK_H_
