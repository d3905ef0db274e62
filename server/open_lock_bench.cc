// A benchmark, not a test: how much one job's heavy opens slow another job
// down (the service's lock must not be held for them: docs/design.md,
// its locks). In one process, without sockets (server/testing's harness): a
// 1-rank job steps a 64x64 matrix in a loop, measured, while a background
// client does `load`:
//   reopen  re-opens the last rank of a 3-rank SHARDING_BLOCKS job of a
//           4000x4000 matrix in a loop (each open's cover check examines
//           4000 x 4000 compressed cells);
//   big     opens and closes (then drops) a 1-rank job of `gib` GiB of fp32
//           momentum in a loop (each open allocates and zero-fills it);
//   none    nothing.
// Prints one line: the load, the measured job's steps/s and p50 / p99 step
// in ms, and how many background opens ran.
//
//   bazel run //server:open_lock_bench -- reopen 3
//   bazel run //server:open_lock_bench -- big 3 1

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

using Clock = std::chrono::steady_clock;

void AddRuns(v1::ParameterSpec* s, bool rows, int64_t n, bool strided) {
  for (int64_t i = 0; i < (strided ? n / 2 : 1); ++i) {
    auto* r = rows ? s->add_row_runs() : s->add_col_runs();
    r->set_begin(strided ? 2 * i : 0);
    r->set_end(strided ? 2 * i + 1 : n);
  }
}

// Rank `rank` of the SHARDING_BLOCKS job: 0 holds the even rows, 2 the even
// columns, 1 the whole matrix (what makes the job covered).
v1::OpenSessionRequest BlocksRank(int rank) {
  constexpr int64_t n = 4000;
  auto req = Request("blocks", rank, 3, v1::TRANSPORT_INLINE,
                     {{"m", n, n, v1::SHARDING_BLOCKS}});
  auto* s = req.mutable_parameters(0);
  AddRuns(s, /*rows=*/true, n, /*strided=*/rank == 0);
  AddRuns(s, /*rows=*/false, n, /*strided=*/rank == 2);
  return req;
}

// The background client; returns the opens it made.
int Load(OptimizerService& svc, const std::string& load, double gib,
         const std::atomic<bool>& stop) {
  int opens = 0;
  if (load == "reopen") {
    for (int r : {0, 2}) {
      if (!svc.OpenSession(BlocksRank(r)).ok()) std::abort();
    }
    while (!stop.load()) {
      auto s = svc.OpenSession(BlocksRank(1));
      if (!s.ok()) std::abort();
      ++opens;
      (void)svc.CloseSession(s->session_id());
    }
  } else if (load == "big") {
    const int64_t rows = 16384;
    const int64_t cols =
        static_cast<int64_t>(gib * (int64_t{1} << 28)) / rows;  // fp32
    while (!stop.load()) {
      auto s = svc.OpenSession(
          Request("big", 0, 1, v1::TRANSPORT_INLINE,
                  {{"m", rows, cols, v1::SHARDING_REPLICATED}}));
      if (!s.ok()) std::abort();
      ++opens;
      (void)svc.CloseSession(s->session_id());
      (void)svc.ReapIdleJobs(Clock::now());  // its momentum goes
    }
  }
  return opens;
}

int Main(int argc, char** argv) {
  const std::string load = argc > 1 ? argv[1] : "none";
  const double seconds = argc > 2 ? std::atof(argv[2]) : 3;
  const double gib = argc > 3 ? std::atof(argv[3]) : 1;
  ServiceOptions o;
  o.max_state_bytes = 0;
  o.max_job_elements = int64_t{1} << 40;
  o.job_retention_seconds = 0;
  o.attach_timeout_seconds = 0;
  auto svc = NewService(o);
  const std::vector<Param> small = {{"w", 64, 64, v1::SHARDING_REPLICATED}};
  Rank other;
  if (!other.Open(*svc, Request("other", 0, 1, v1::TRANSPORT_INLINE, small))
           .ok())
    return 1;
  std::mt19937_64 rng(1);
  const auto grads = RandomGradients(small, rng);
  std::atomic<bool> stop{false};
  int opens = 0;
  std::thread bg([&] { opens = Load(*svc, load, gib, stop); });
  std::vector<double> ms;
  const Clock::time_point start = Clock::now();
  for (int64_t step = 1;; ++step) {
    const Clock::time_point t0 = Clock::now();
    if (t0 - start > std::chrono::duration<double>(seconds)) break;
    if (!other.Send(*svc, step, grads).ok()) return 1;
    (void)other.sink->WaitStep(step);
    ms.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double took =
      std::chrono::duration<double>(Clock::now() - start).count();
  stop = true;
  bg.join();
  std::sort(ms.begin(), ms.end());
  std::printf("load=%s steps/s=%.0f p50_ms=%.2f p99_ms=%.2f opens=%d\n",
              load.c_str(), ms.size() / took, ms[ms.size() / 2],
              ms[ms.size() * 99 / 100], opens);
  return 0;
}

}  // namespace
}  // namespace dmuon::server::testing

int main(int argc, char** argv) {
  return dmuon::server::testing::Main(argc, argv);
}
