// Faults with real processes (issue "hardening"): 12 trainer processes
// (tests/fault_client.cc; 8 single-rank jobs and 2 jobs of 2 ranks, shm) are
// each killed with SIGKILL at a random moment, nearly always mid-step, and 2
// more are killed after OpenSession and before attaching, while 4 bystander
// ranks (shm, inline, and a job of 2 ranks) keep stepping on the same
// daemon, every update of theirs checked against the fp64 reference. With
// short timeouts (--attach-timeout-seconds=2, --job-retention-seconds=1,
// --state-dir), once they have passed:
//   - the bystanders finished with every update matching;
//   - no session and no job is left in Status (the killed ones were
//     reclaimed, the rolled-back jobs dropped and snapshotted);
//   - none of the killed sessions' shm segments (their names from the
//     clients' mappings and OpenSessionResponse.shm_name) is left in
//     /dev/shm, and the daemon maps no segment;
//   - every killed job reopens at its last complete step: a rank killed
//     mid-step rolled its job back (docs/protocol.md, "Step stream"), and the
//     snapshot written when the idle job was dropped holds that step
//     (docs/security.md, "Durable state"). The step is the one the client
//     logs say (between the last step every rank saw complete and the last
//     one every rank had begun declaring its last gradient of), GetState's
//     momentum equals the reference's after that step, and the next step's
//     updates match.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/muon_job.h"
#include "tests/proc_stats.h"
#include "tests/process.h"
#include "tests/varied_job.h"

namespace dmuon::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kVictimParams = 12;
constexpr int kBystanderParams = 24;
// fp32 state vs the fp64 reference, relative to the sum of the terms'
// magnitudes (ScaledError): a step too many or too few is off by 1 - beta
// of it (0.05 at the default beta), four orders above this.
constexpr double kMomentumTolerance = 1e-5;

// One client process and what it logged (fault_client.cc's lines).
struct Proc {
  std::string job;
  int rank = 0, world = 1;
  uint64_t seed = 0;
  std::string mode;  // victim | bystander | no_attach
  std::string progress;
  std::unique_ptr<Process> process;
  double kill_after = 0;  // seconds after its session opened
  Clock::time_point opened{};
  bool killed = false;

  std::vector<std::string> Lines() const {
    std::vector<std::string> lines;
    std::ifstream in(progress);
    std::string l;
    while (std::getline(in, l)) lines.push_back(l);
    return lines;
  }
  // The N of the last line starting with `key` (0 if none).
  int64_t Last(const std::string& key) const {
    int64_t n = 0;
    for (const std::string& l : Lines())
      if (l.rfind(key + " ", 0) == 0) n = std::stoll(l.substr(key.size() + 1));
    return n;
  }
  // The shm segment it named ("open dmuon-..." or "shm dmuon-..."), or "".
  std::string Segment() const {
    for (const std::string& l : Lines()) {
      std::istringstream in(l);
      std::string key, name;
      in >> key >> name;
      if ((key == "open" || key == "shm") && name.rfind("dmuon-", 0) == 0)
        return name;
    }
    return "";
  }
  bool Opened() const {
    for (const std::string& l : Lines())
      if (l.rfind("open ", 0) == 0 || l.rfind("shm ", 0) == 0) return true;
    return false;
  }
  // Killed between "begin N" and "done N".
  bool MidStep() const {
    const auto lines = Lines();
    return !lines.empty() && (lines.back().rfind("begin ", 0) == 0 ||
                              lines.back().rfind("last ", 0) == 0);
  }
};

std::unique_ptr<Proc> Spawn(const Daemon& d, const std::string& dir,
                            const std::string& mode, const std::string& job,
                            int rank, int world, uint64_t seed, int params,
                            const std::string& transport,
                            std::vector<std::string> extra = {}) {
  auto p = std::make_unique<Proc>();
  p->job = job;
  p->rank = rank;
  p->world = world;
  p->seed = seed;
  p->mode = mode;
  p->progress = dir + "/" + job + "." + std::to_string(rank) + ".progress";
  std::vector<std::string> argv = {Runfile("tests/fault_client"),
                                   "--server=" + d.address(),
                                   "--mode=" + mode,
                                   "--job=" + job,
                                   "--rank=" + std::to_string(rank),
                                   "--world=" + std::to_string(world),
                                   "--params=" + std::to_string(params),
                                   "--seed=" + std::to_string(seed),
                                   "--transport=" + transport,
                                   "--progress=" + p->progress};
  argv.insert(argv.end(), extra.begin(), extra.end());
  p->process = std::make_unique<Process>(
      argv, dir + "/" + job + "." + std::to_string(rank) + ".log");
  return p;
}

std::string Dump(const Proc& p) {
  std::string s = p.job + " rank " + std::to_string(p.rank) + ":";
  const auto lines = p.Lines();
  const size_t from = lines.size() > 6 ? lines.size() - 6 : 0;
  for (size_t i = from; i < lines.size(); ++i) s += " | " + lines[i];
  return s;
}

v1::StatusResponse GetStatus(v1::Optimizer::Stub& stub, bool* ok) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::StatusResponse r;
  *ok = stub.Status(&ctx, v1::StatusRequest(), &r).ok();
  return r;
}

// Jobs in the daemon's memory (Status also lists jobs that are only a
// snapshot file).
int InMemory(const v1::StatusResponse& st) {
  int n = 0;
  for (const auto& j : st.jobs()) n += !j.on_disk();
  return n;
}

bool Exists(const std::string& shm_name) {
  struct stat st;
  return stat(("/dev/shm/" + shm_name).c_str(), &st) == 0;
}

TEST(Fault, ClientsKilledMidStepLeaveNothingBehindAndTheirJobsResume) {
  const std::string dir = TempDir("fault");
  const std::string state = TempDir("fault-state");
  Daemon d({"--state-dir=" + state, "--job-retention-seconds=1",
            "--attach-timeout-seconds=2", "--cpu-executors=2",
            "--cpu-threads=2"});
  ASSERT_NE(d.port(), 0) << d.log();
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::printf("fault: seed %llu\n", static_cast<unsigned long long>(seed));

  std::vector<std::unique_ptr<Proc>> victims, bystanders, unattached;
  // Bystanders first, so they step through every kill.
  bystanders.push_back(Spawn(d, dir, "bystander", "bystander-shm", 0, 1,
                             seed + 1, kBystanderParams, "shm",
                             {"--seconds=10"}));
  bystanders.push_back(Spawn(d, dir, "bystander", "bystander-inline", 0, 1,
                             seed + 2, kBystanderParams, "inline",
                             {"--seconds=10"}));
  for (int r = 0; r < 2; ++r)
    bystanders.push_back(Spawn(d, dir, "bystander", "bystander-pair", r, 2,
                               seed + 3, kBystanderParams,
                               r == 0 ? "shm" : "inline", {"--steps=80"}));
  std::uniform_real_distribution<double> after(0.3, 3.0);
  for (int j = 0; j < 8; ++j) {
    victims.push_back(Spawn(d, dir, "victim", "victim-" + std::to_string(j), 0,
                            1, seed + 10 + j, kVictimParams, "shm"));
    victims.back()->kill_after = after(rng);
  }
  for (int j = 0; j < 2; ++j)
    for (int r = 0; r < 2; ++r) {
      victims.push_back(Spawn(d, dir, "victim",
                              "victim-pair-" + std::to_string(j), r, 2,
                              seed + 20 + j, kVictimParams, "shm"));
      victims.back()->kill_after = after(rng);
    }
  for (int j = 0; j < 2; ++j) {
    unattached.push_back(Spawn(d, dir, "no_attach",
                               "unattached-" + std::to_string(j), 0, 1, 0, 1,
                               "shm"));
    unattached.back()->kill_after = after(rng) / 6;
  }

  // Kill each one at its moment after its session opened.
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  for (bool pending = true; pending && Clock::now() < deadline;) {
    pending = false;
    for (auto* list : {&victims, &unattached}) {
      for (auto& p : *list) {
        if (p->killed) continue;
        pending = true;
        if (p->opened == Clock::time_point{}) {
          if (p->Opened()) p->opened = Clock::now();
          continue;
        }
        if (Clock::now() - p->opened >=
            std::chrono::duration<double>(p->kill_after)) {
          p->process->Signal(SIGKILL);
          p->killed = true;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  int mid_step = 0;
  for (auto* list : {&victims, &unattached}) {
    for (auto& p : *list) {
      ASSERT_TRUE(p->killed) << "never opened: " << Dump(*p) << "\n" << d.log();
      EXPECT_EQ(p->process->Wait(30), 128 + SIGKILL) << Dump(*p);
      if (p->mode == "victim") {
        mid_step += p->MidStep();
        std::printf("fault: killed %s\n", Dump(*p).c_str());
      }
    }
  }
  // Only the moment between logging "done N" and "begin N+1" is not
  // mid-step: nearly every kill lands in a step.
  EXPECT_GE(mid_step, static_cast<int>(victims.size()) / 2)
      << "too few kills landed mid-step";
  std::printf("fault: %d of %zu victims killed mid-step\n", mid_step,
              victims.size());

  // The bystanders were not disturbed.
  for (auto& p : bystanders)
    EXPECT_EQ(p->process->Wait(300), 0) << Dump(*p) << "\n" << d.log();

  // Past the timeouts: nothing left in Status.
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  v1::StatusResponse st;
  bool ok = false;
  const auto until = Clock::now() + std::chrono::seconds(60);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    st = GetStatus(*stub, &ok);
  } while ((!ok || st.sessions_size() > 0 || InMemory(st) > 0) &&
           Clock::now() < until);
  ASSERT_TRUE(ok);
  EXPECT_EQ(st.sessions_size(), 0) << st.DebugString();
  // Every job dropped from memory; those with a completed step are listed
  // from their snapshots until reopened.
  EXPECT_EQ(InMemory(st), 0) << st.DebugString();

  // No segment left: in /dev/shm, or mapped by the daemon.
  int segments = 0;
  for (auto* list : {&victims, &unattached}) {
    for (auto& p : *list) {
      const std::string name = p->Segment();
      if (name.empty()) continue;
      ++segments;
      EXPECT_FALSE(Exists(name)) << name << " left in /dev/shm by " << Dump(*p);
    }
  }
  EXPECT_GE(segments, static_cast<int>(unattached.size()));
  const ProcStats daemon = ReadProcStats(d.process().pid());
  EXPECT_TRUE(daemon.ok) << d.log();
  EXPECT_EQ(daemon.shm_maps, 0) << Describe(daemon);
  std::printf("fault: %d segments checked gone; dmuond %s\n", segments,
              Describe(daemon).c_str());

  // Each killed job reopens at its last complete step.
  ClientOptions o;
  o.deadline = std::chrono::seconds(120);
  for (size_t i = 0; i < victims.size();) {
    const Proc& first = *victims[i];
    const VariedJob job =
        MakeVariedJob(first.job, first.seed, kVictimParams, first.world);
    int64_t lo = 0, hi = INT64_MAX;
    for (int r = 0; r < job.world; ++r) {
      lo = std::max(lo, victims[i + r]->Last("done"));
      hi = std::min(hi, victims[i + r]->Last("last"));
    }
    std::vector<std::unique_ptr<Client>> clients;
    std::vector<std::unique_ptr<Session>> sessions;
    std::vector<SessionSpec> specs;
    for (int r = 0; r < job.world; ++r) {
      auto c = Client::Connect(d.address(), o);
      ASSERT_TRUE(c.ok()) << c.status();
      specs.push_back(VariedSpec(job, r, TransportChoice::kShm));
      auto s = (*c)->OpenSession(specs.back());
      ASSERT_TRUE(s.ok()) << job.id << ": " << s.status() << "\n" << d.log();
      clients.push_back(*std::move(c));
      sessions.push_back(*std::move(s));
    }
    const int64_t completed = sessions[0]->step() - 1;
    std::string logs;
    for (int r = 0; r < job.world; ++r) logs += Dump(*victims[i + r]) + "\n";
    EXPECT_GE(completed, lo) << job.id << " lost a completed step\n" << logs;
    EXPECT_LE(completed, hi) << job.id << " kept a step never declared\n"
                             << logs;
    for (auto& s : sessions) EXPECT_EQ(s->step(), completed + 1) << job.id;
    std::printf("fault: %s reopened at step %lld (complete %lld..%lld)\n",
                job.id.c_str(), static_cast<long long>(completed + 1),
                static_cast<long long>(lo), static_cast<long long>(hi));
    // Its momentum is the reference's after that step.
    Reference ref = VariedReference(job);
    for (int64_t k = 1; k <= completed; ++k) ref.Advance(k);
    auto got = sessions[0]->GetState();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->completed_steps, completed) << job.id;
    ASSERT_EQ(got->momentum.size(), job.table.size()) << job.id;
    for (size_t p = 0; p < job.table.size(); ++p) {
      const auto& m = got->momentum[p];
      if (completed == 0) {
        EXPECT_TRUE(
            std::all_of(m.begin(), m.end(), [](float x) { return x == 0; }))
            << job.id << " parameter " << p;
      } else {
        EXPECT_LE(ScaledError(m, ref.momentum()[p], ref.momentum_scale()[p]),
                  kMomentumTolerance)
            << job.id << " parameter " << p << " after step " << completed;
      }
    }
    // And it continues: the next step's updates match the reference.
    const auto want = ref.Step(completed + 1);
    auto expected = [&] { return want; };
    std::vector<std::thread> ranks;
    std::vector<absl::StatusOr<StepCheck>> checks(job.world,
                                                  absl::UnknownError("no"));
    for (int r = 0; r < job.world; ++r)
      ranks.emplace_back([&, r] {
        checks[r] = RunVariedStep(*sessions[r], job, specs[r], expected);
      });
    for (auto& t : ranks) t.join();
    for (int r = 0; r < job.world; ++r) {
      ASSERT_TRUE(checks[r].ok()) << job.id << ": " << checks[r].status();
      EXPECT_EQ(checks[r]->mismatches, 0) << checks[r]->first;
    }
    for (auto& s : sessions) EXPECT_TRUE(s->Close().ok()) << job.id;
    i += job.world;
  }
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
  EXPECT_EQ(d.process().Wait(0), -1) << "dmuond exited\n" << d.log();
}

}  // namespace
}  // namespace dmuon::testing
