// The soak's attacker processes (tests/attacker.cc; the soak starts them
// through tests/soak_attack.h): one defect class of issue 27 per mode, run
// against a real dmuond with --auth-token-file until SIGTERM. Each mode
// counts what it did and the gRPC status codes it got in a Tally, which
// the process writes to its report file at exit; a violation is an answer
// that the daemon's defenses should have made impossible (a reflection
// stream served, another principal's job opened, a half-closed step that
// ends OK with nothing, a job whose next step disagrees with what its
// stream said). The modes are in attacker_modes.cc.

#ifndef DMUON_TESTS_ATTACKER_H_
#define DMUON_TESTS_ATTACKER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proto/dmuon.grpc.pb.h"

namespace dmuon::testing {

// What an attacker did and got. Thread-safe.
class Tally {
 public:
  void Did() { Add("did", 1); }
  void Got(grpc::StatusCode code);
  void Violation(const std::string& what);
  // A figure of the mode's own ("open_ms_max"), replaced when set again.
  void Stat(const std::string& name, double value);
  void Add(const std::string& counter, int64_t n);
  // "did N", "violations N", "code NAME N", "stat NAME X" and the first 5
  // "violation TEXT" lines.
  std::string Report() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> counters_;  // guarded by mu_
  std::map<std::string, int64_t> codes_;     // guarded by mu_
  std::map<std::string, double> stats_;      // guarded by mu_
  std::vector<std::string> violations_;      // guarded by mu_
};

struct AttackOptions {
  std::string server;
  std::string token;                       // "" for none
  std::string job;                         // the attacker's own job id
  std::vector<std::string> foreign_jobs;   // foreign_open's targets
  std::vector<std::string> secrets;        // must not appear in refusals
  int streams = 8;                         // concurrent streams (workers)
  int pause_ms = 20;                       // between two attempts of a worker
  double hold_seconds = 12;                // stalled_reader's deadline
  int params = 8, rows = 512, cols = 512;  // the attacker's job's table
  bool dense = false;                      // reopen: replicated, not blocks
};

// Set by SIGTERM; every mode's loops end soon after.
bool Stopped();
// Sleeps up to `ms`, less once Stopped().
void Pause(int ms);
// A context with the token (if any) and a deadline `seconds` away.
std::unique_ptr<grpc::ClientContext> Ctx(const AttackOptions& o,
                                         double seconds);
// A channel of its own (its own connection: no subchannel shared with the
// process's other channels, so one stalled stream's flow control cannot
// hold up another's).
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& server);

// Each sets itself up, writes "ready" through `ready`, and runs until
// Stopped(); false if it could not set itself up (the reason in the tally's
// violations).
using Ready = void (*)();
bool AttackReflection(const AttackOptions& o, Tally* t, Ready ready);
bool AttackStalledReaders(const AttackOptions& o, Tally* t, Ready ready);
bool AttackForeignOpens(const AttackOptions& o, Tally* t, Ready ready);
bool AttackHalfCloses(const AttackOptions& o, Tally* t, Ready ready);
bool AttackReopens(const AttackOptions& o, Tally* t, Ready ready);

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_ATTACKER_H_
