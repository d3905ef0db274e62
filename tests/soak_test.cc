// Soak (issue "hardening"): a real dmuond serving 16 concurrent sessions —
// 12 single-rank jobs and 2 jobs of 2 ranks (row-sharded, unreduced and
// replicated parameters) — of 64 parameters each, tall, wide, square and
// tiny (tests/varied_job.h), over shm and inline (each session switches
// transport every cycle). Every session closes and reopens its job every few
// steps (a new connection, the job continuing from the daemon's retained
// momentum), and every update of every step is compared with the fp64
// reference (tests/muon_job.h) within VariedTolerance: 0 mismatches allowed.
//
// Leak check, not timing: the daemon's RSS, open fds and threads
// (/proc/<pid>) are sampled at the start, every second (every 5 s past 2
// minutes) and at the end. After a warm-up (a quarter of the run, 5 to 60
// s) no sample may exceed the warm-up's maximum by more than the slack:
// RSS + max(32 MiB, 25 %), fds + 16, threads + 8. At the end, with every
// session closed, the daemon maps no shm segment and holds at most 4 fds
// more than before the first session. The figures are printed ("soak: ...")
// and written as JSON to $DMUON_SOAK_JSON (else the test's undeclared
// outputs, soak.json).
//
// DMUON_SOAK_SECONDS: how long the sessions step (default 30: `./dmuon test`
// runs it in about 40 s); `./dmuon soak [SECONDS]` runs it for 600.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "kernels/kernels.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/muon_job.h"
#include "tests/proc_stats.h"
#include "tests/process.h"
#include "tests/varied_job.h"

namespace dmuon::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSingleJobs = 12;
constexpr int kPairJobs = 2;  // world 2: 12 + 2 * 2 = 16 sessions
constexpr int kParams = 64;
constexpr int64_t kRssSlackKb = 32 * 1024;
constexpr double kRssSlackFraction = 0.25;
constexpr int kFdSlack = 16;
constexpr int kThreadSlack = 8;
constexpr int kEndFdSlack = 4;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double EnvSeconds(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atof(v);
}

// A job's ranks agree on when to reopen and when to stop: each rank calls
// Next() between cycles (its session closed); the last to arrive draws the
// next cycle's length (0: stop), which every rank then gets.
class JobCycles {
 public:
  JobCycles(int world, uint64_t seed, const std::atomic<bool>* stop,
            const std::atomic<bool>* failed)
      : world_(world), rng_(seed), stop_(stop), failed_(failed) {}

  int Next() {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      steps_ = stop_->load() || failed_->load() ? 0 : 3 + rng_() % 8;
      cv_.notify_all();
      return steps_;
    }
    while (generation_ == gen && !failed_->load())
      cv_.wait_for(l, std::chrono::milliseconds(100));
    return generation_ == gen ? 0 : steps_;
  }

 private:
  const int world_;
  std::mt19937_64 rng_;
  const std::atomic<bool>* stop_;
  const std::atomic<bool>* failed_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  int steps_ = 0;
};

struct Totals {
  std::atomic<int64_t> steps{0};    // session steps
  std::atomic<int64_t> checked{0};  // updates compared with the reference
  std::atomic<int64_t> mismatches{0};
  std::atomic<int64_t> opens{0};  // sessions opened
  std::mutex mu;
  std::vector<std::string> errors;  // guarded by mu
  void Error(const std::string& e) {
    std::lock_guard<std::mutex> l(mu);
    if (errors.size() < 20) errors.push_back(e);
  }
};

// One trainer rank: cycles of (connect, open, steps, close) until its job
// stops, every update checked.
void RunRank(const std::string& address, const VariedJob& job, int rank,
             int index, JobCycles* cycles, Totals* totals,
             std::atomic<bool>* failed) {
  Reference ref = VariedReference(job);
  ClientOptions o;
  o.deadline = std::chrono::seconds(120);  // 2 slow shared cores
  auto fail = [&](const std::string& what) {
    totals->Error("job " + job.id + " rank " + std::to_string(rank) + ": " +
                  what);
    failed->store(true);
  };
  for (int cycle = 0;; ++cycle) {
    const int steps = cycles->Next();
    if (steps == 0) return;
    const TransportChoice transport = (index + cycle) % 2 == 0
                                          ? TransportChoice::kShm
                                          : TransportChoice::kInline;
    auto client = Client::Connect(address, o);
    if (!client.ok()) return fail(client.status().ToString());
    const SessionSpec spec = VariedSpec(job, rank, transport);
    auto session = (*client)->OpenSession(spec);
    if (!session.ok()) return fail(session.status().ToString());
    totals->opens++;
    Session& s = **session;
    if (s.step() != ref.completed() + 1) {
      return fail("reopened at step " + std::to_string(s.step()) +
                  ", expected " + std::to_string(ref.completed() + 1));
    }
    for (int i = 0; i < steps; ++i) {
      const int64_t step = s.step();
      auto r = RunVariedStep(s, job, spec, [&] { return ref.Step(step); });
      if (!r.ok()) return fail(r.status().ToString());
      totals->steps++;
      totals->checked += r->checked;
      if (r->mismatches > 0) {
        totals->mismatches += r->mismatches;
        totals->Error(r->first);
      }
    }
    if (auto st = s.Close(); !st.ok()) return fail(st.ToString());
  }
}

struct Sample {
  double t = 0;
  ProcStats stats;
  int sessions = -1;  // open, per the daemon's Status
  int64_t steps = 0;  // session steps so far (the test's count)
};

std::string SampleJson(const Sample& s) {
  std::ostringstream o;
  o << "{\"t\": " << static_cast<int64_t>(s.t)
    << ", \"rss_kb\": " << s.stats.rss_kb << ", \"fds\": " << s.stats.fds
    << ", \"threads\": " << s.stats.threads
    << ", \"shm_maps\": " << s.stats.shm_maps
    << ", \"sessions\": " << s.sessions << ", \"steps\": " << s.steps << "}";
  return o.str();
}

std::string Quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string FirstLineWith(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    std::string v = line.substr(line.find_first_of(":=") + 1);
    v.erase(0, v.find_first_not_of(" \t\""));
    while (!v.empty() && (v.back() == '"' || v.back() == ' ')) v.pop_back();
    return v;
  }
  return "";
}

TEST(Soak, SixteenSessionsEveryUpdateCheckedNoGrowth) {
  kernels::SetCpuThreads(1);  // this process's reference SVDs: one thread each
  const double seconds = EnvSeconds("DMUON_SOAK_SECONDS", 30);
  const double warmup = std::clamp(seconds / 4, 5.0, 60.0);
  Daemon d({"--cpu-executors=2", "--cpu-threads=2", "--max-sessions=64"});
  ASSERT_NE(d.port(), 0) << d.log();
  const pid_t pid = d.process().pid();
  auto channel =
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Optimizer::NewStub(channel);
  auto open_sessions = [&]() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::StatusResponse r;
    return stub->Status(&ctx, v1::StatusRequest(), &r).ok() ? r.sessions_size()
                                                            : -1;
  };

  Totals totals;
  std::atomic<bool> stop{false}, failed{false};
  const uint64_t seed = std::random_device{}();
  std::printf("soak: %g s, seed %llu, daemon pid %d\n", seconds,
              static_cast<unsigned long long>(seed), static_cast<int>(pid));
  std::vector<VariedJob> jobs;
  for (int j = 0; j < kSingleJobs; ++j)
    jobs.push_back(
        MakeVariedJob("soak-" + std::to_string(j), seed + j, kParams, 1));
  for (int j = 0; j < kPairJobs; ++j)
    jobs.push_back(MakeVariedJob("soak-pair-" + std::to_string(j),
                                 seed + 100 + j, kParams, 2));
  std::vector<std::unique_ptr<JobCycles>> cycles;
  for (const VariedJob& job : jobs)
    cycles.push_back(
        std::make_unique<JobCycles>(job.world, job.seed, &stop, &failed));

  std::vector<Sample> samples;
  auto sample = [&](double t) {
    Sample s;
    s.t = t;
    s.stats = ReadProcStats(pid);
    s.sessions = open_sessions();
    s.steps = totals.steps.load();
    samples.push_back(s);
    std::printf("soak: t=%4.0fs %s, %d sessions open, %lld session steps\n", t,
                Describe(s.stats).c_str(), s.sessions,
                static_cast<long long>(s.steps));
    std::fflush(stdout);
    return s;
  };
  const Sample start = sample(0);
  ASSERT_TRUE(start.stats.ok) << "cannot read /proc/" << pid;

  const auto t0 = Clock::now();
  std::vector<std::thread> ranks;
  int index = 0, sessions = 0;
  for (size_t j = 0; j < jobs.size(); ++j)
    for (int r = 0; r < jobs[j].world; ++r, ++sessions)
      ranks.emplace_back(RunRank, d.address(), std::cref(jobs[j]), r, index++,
                         cycles[j].get(), &totals, &failed);

  const double period = seconds > 120 ? 5 : 1;
  Sample warm;  // the warm-up's maximum of each figure
  bool warmed = false;
  std::vector<std::string> growth;
  for (double next = period; !failed.load(); next += period) {
    while (Seconds(t0) < next && !failed.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (Seconds(t0) >= seconds + period / 2) break;
    const Sample s = sample(Seconds(t0));
    if (!s.stats.ok) {
      growth.push_back("dmuond is gone");
      break;
    }
    if (s.t <= warmup) {
      warm.stats.rss_kb = std::max(warm.stats.rss_kb, s.stats.rss_kb);
      warm.stats.fds = std::max(warm.stats.fds, s.stats.fds);
      warm.stats.threads = std::max(warm.stats.threads, s.stats.threads);
      warmed = true;
      continue;
    }
    const int64_t rss_limit =
        warm.stats.rss_kb +
        std::max<int64_t>(kRssSlackKb, warm.stats.rss_kb * kRssSlackFraction);
    if (s.stats.rss_kb > rss_limit)
      growth.push_back("t=" + std::to_string(int(s.t)) + "s rss " +
                       std::to_string(s.stats.rss_kb) + " kB > " +
                       std::to_string(rss_limit));
    if (s.stats.fds > warm.stats.fds + kFdSlack)
      growth.push_back("t=" + std::to_string(int(s.t)) + "s fds " +
                       std::to_string(s.stats.fds) + " > " +
                       std::to_string(warm.stats.fds + kFdSlack));
    if (s.stats.threads > warm.stats.threads + kThreadSlack)
      growth.push_back("t=" + std::to_string(int(s.t)) + "s threads " +
                       std::to_string(s.stats.threads) + " > " +
                       std::to_string(warm.stats.threads + kThreadSlack));
  }
  stop.store(true);
  for (std::thread& t : ranks) t.join();
  const double stepped = Seconds(t0);

  // Every session closed: the daemon should hold what it held at the start,
  // plus the retained jobs' momentum.
  int open = -1;
  for (int i = 0; i < 100 && open != 0; ++i) {
    open = open_sessions();
    if (open != 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  Sample end;
  for (int i = 0; i < 50; ++i) {  // connections close a little later
    end.stats = ReadProcStats(pid);
    if (end.stats.fds <= start.stats.fds + kEndFdSlack) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  end = sample(Seconds(t0));

  const int64_t checked = totals.checked.load();
  const int64_t mismatches = totals.mismatches.load();
  std::printf(
      "soak: %d sessions (%zu jobs, %d parameters each), %lld session "
      "steps in %.0f s, %lld sessions opened, %lld updates checked, %lld "
      "mismatches\n",
      sessions, jobs.size(), kParams,
      static_cast<long long>(totals.steps.load()), stepped,
      static_cast<long long>(totals.opens.load()),
      static_cast<long long>(checked), static_cast<long long>(mismatches));
  std::printf("soak: dmuond start  %s\n", Describe(start.stats).c_str());
  std::printf(
      "soak: dmuond warm   max rss %.1f MiB, %d fds, %d threads "
      "(first %.0f s)\n",
      warm.stats.rss_kb / 1024.0, warm.stats.fds, warm.stats.threads, warmup);
  std::printf("soak: dmuond end    %s\n", Describe(end.stats).c_str());
  std::fflush(stdout);

  // JSON figures.
  std::string json_path;
  if (const char* p = std::getenv("DMUON_SOAK_JSON"); p && *p) {
    json_path = p;
  } else if (const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
    json_path = std::string(dir) + "/soak.json";
  }
  if (!json_path.empty()) {
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    const char* command = std::getenv("DMUON_SOAK_COMMAND");
    std::ofstream out(json_path);
    out << "{\n  \"benchmark\": \"soak\",\n  \"command\": "
        << Quoted(command ? command : "bazel test //tests:soak_test")
        << ",\n  \"date\": " << Quoted(date) << ",\n  \"machine\": {\"cpu\": "
        << Quoted(FirstLineWith("/proc/cpuinfo", "model name"))
        << ", \"cores\": " << std::thread::hardware_concurrency()
        << ", \"os\": "
        << Quoted(FirstLineWith("/etc/os-release", "PRETTY_NAME"))
        << "},\n  \"seed\": " << seed << ",\n  \"seconds\": " << stepped
        << ",\n  \"sessions\": " << sessions << ",\n  \"jobs\": " << jobs.size()
        << ",\n  \"multi_rank_jobs\": " << kPairJobs
        << ",\n  \"parameters_per_job\": " << kParams
        << ",\n  \"transports\": [\"shm\", \"inline\"]"
        << ",\n  \"session_opens\": " << totals.opens.load()
        << ",\n  \"session_steps\": " << totals.steps.load()
        << ",\n  \"updates_checked\": " << checked
        << ",\n  \"mismatches\": " << mismatches
        << ",\n  \"tolerance\": {\"classic\": " << jobs[0].tolerance[0]
        << ", \"polar_express_gram\": " << jobs[0].tolerance[1]
        << ", \"you\": " << jobs[0].tolerance[2]
        << ", \"custom\": " << jobs[0].tolerance[3] << "}"
        << ",\n  \"warmup_seconds\": " << warmup
        << ",\n  \"slack\": {\"rss_kb\": " << kRssSlackKb
        << ", \"rss_fraction\": " << kRssSlackFraction
        << ", \"fds\": " << kFdSlack << ", \"threads\": " << kThreadSlack
        << ", \"end_fds_over_start\": " << kEndFdSlack << "}"
        << ",\n  \"daemon\": {\"start\": " << SampleJson(start)
        << ", \"warmup_max\": {\"rss_kb\": " << warm.stats.rss_kb
        << ", \"fds\": " << warm.stats.fds
        << ", \"threads\": " << warm.stats.threads
        << "}, \"end\": " << SampleJson(end)
        << "},\n  \"growth_failures\": " << growth.size()
        << ",\n  \"samples\": [";
    for (size_t i = 0; i < samples.size(); ++i)
      out << (i ? ",\n    " : "\n    ") << SampleJson(samples[i]);
    out << "\n  ]\n}\n";
    std::printf("soak: figures in %s\n", json_path.c_str());
  }

  for (const std::string& e : totals.errors) ADD_FAILURE() << e;
  EXPECT_FALSE(failed.load()) << d.log();
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(checked, 0);
  EXPECT_TRUE(warmed) << "no sample in the warm-up";
  for (const std::string& g : growth) ADD_FAILURE() << "growth: " << g;
  EXPECT_EQ(open, 0) << "sessions left open";
  EXPECT_TRUE(end.stats.ok) << "dmuond is gone\n" << d.log();
  EXPECT_EQ(end.stats.shm_maps, 0) << "shm segments still mapped";
  EXPECT_LE(end.stats.fds, start.stats.fds + kEndFdSlack)
      << "fds at the end vs the start";
  EXPECT_LE(end.stats.threads, warm.stats.threads + kThreadSlack);
  EXPECT_EQ(d.process().Wait(0), -1) << "dmuond exited\n" << d.log();
}

}  // namespace
}  // namespace dmuon::testing
