#include "benchmarks/scaling/cpu_pool.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "kernels/kernels.h"

extern char** environ;

namespace dmuon::scaling {
namespace {

// A reusable barrier for the rank threads (C++17 has none).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    const int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

}  // namespace

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<ParamSpec> ValidationTable(int scale, int layers) {
  const int64_t h = 768 / scale, f = 3072 / scale;
  const ShapeKey shapes[4] = {{3 * h, h}, {h, h}, {f, h}, {h, f}};
  const char* names[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc",
                          "mlp.c_proj"};
  std::vector<ParamSpec> t;
  for (int l = 0; l < layers; ++l) {
    for (int j = 0; j < 4; ++j) {
      ParamSpec p;
      p.name = absl::StrCat("h.", l, ".", names[j]);
      p.rows = shapes[j].first;
      p.cols = shapes[j].second;
      p.sharding = Sharding::kUnreduced;  // reduced into the owner
      p.forward_order = 4 * l + j;
      p.layer = l;
      t.push_back(p);
    }
  }
  return t;
}

// What the daemon's worker does for one matrix of `world` unreduced ranks:
// the rank-order mean, the finiteness scan, momentum, NS, the lr scale, and
// the copy of the update into every rank's region (server/param_work.cc,
// server/cpu_executor.cc). Each repetition first holds a block of random
// size, so the kernels' own buffers land at other addresses: on this CPU
// one matrix's time depends on them (576x192 takes 4.3 to 10 ms), and the
// daemon's 48 matrices see many placements, so the median over placements
// is what predicts a step.
absl::StatusOr<std::vector<double>> DeviceSeconds(ShapeKey shape, int world,
                                                  int reps) {
  const kernels::Shape s{shape.first, shape.second};
  const int64_t n = s.elements();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> g(world, std::vector<float>(n)),
      out(world, std::vector<float>(n));
  for (auto& v : g)
    for (float& x : v) x = d(rng);
  std::vector<float> mom(n, 0.0f);
  std::uniform_int_distribution<size_t> junk_bytes(1, size_t{1} << 20);
  const float scale =
      static_cast<float>(kernels::LrScale(kernels::LrAdjust::kOriginal, s));
  auto once = [&]() -> absl::Status {
    std::vector<char> junk(junk_bytes(rng));
    std::vector<float> work(n, 0.0f);
    for (const auto& v : g)
      for (int64_t i = 0; i < n; ++i) work[i] += v[i];
    const float inv = 1.0f / static_cast<float>(world);
    for (float& x : work) x *= inv;
    for (float x : work)
      if (!std::isfinite(x)) return absl::InternalError("non-finite");
    auto st = kernels::MomentumUpdate(work, absl::MakeSpan(mom),
                                      absl::MakeSpan(work), 0.95, true);
    if (!st.ok()) return st;
    kernels::ConstMatrixF in{s, work};
    kernels::MatrixF o{s, absl::MakeSpan(work)};
    if (st = kernels::OrthogonalizeBatch({&in, 1}, {&o, 1}); !st.ok())
      return st;
    if (scale != 1.0f)
      for (float& x : work) x *= scale;
    for (auto& v : out) std::memcpy(v.data(), work.data(), n * sizeof(float));
    return absl::OkStatus();
  };
  return bench::Time(once, reps);
}

absl::StatusOr<std::vector<std::vector<double>>> DeviceSecondsAtOnce(
    ShapeKey shape, int world, int reps, int threads) {
  std::vector<absl::StatusOr<std::vector<double>>> r(
      threads, absl::UnknownError("not run"));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { r[t] = DeviceSeconds(shape, world, reps); });
  for (auto& t : pool) t.join();
  std::vector<std::vector<double>> out;
  for (auto& x : r) {
    if (!x.ok()) return x.status();
    out.push_back(std::move(*x));
  }
  return out;
}

// Runs warm-up + steps; returns each timed step's end (seconds after its
// backward began), the latest rank's.
absl::StatusOr<std::vector<double>> RunSteps(
    const std::vector<std::string>& addresses, const std::string& job,
    const std::vector<ParamSpec>& table, int world, int steps, double bwd_layer,
    double fwd_layer) {
  const int layers = static_cast<int>(table.size() / 4);
  Barrier barrier(world);
  std::mutex mu;
  Clock::time_point t0;
  std::vector<double> ends(steps + 1, 0.0);
  std::vector<absl::Status> status(world);
  auto rank_main = [&](int rank) -> absl::Status {
    auto client = Client::ConnectPool(addresses);
    if (!client.ok()) return client.status();
    SessionSpec spec;
    spec.job_id = job;
    spec.rank = rank;
    spec.world_size = world;
    spec.params = table;
    spec.transport = TransportChoice::kShm;
    auto session = (*client)->OpenSession(spec);
    if (!session.ok()) return session.status();
    Session& s = **session;
    std::mt19937_64 rng(100 + rank);
    std::normal_distribution<float> d;
    std::vector<std::vector<float>> grads;
    for (const auto& p : table) {
      grads.emplace_back(p.rows * p.cols);
      for (float& x : grads.back()) x = d(rng);
    }
    for (int step = 0; step <= steps; ++step) {
      barrier.Wait();
      if (rank == 0) t0 = Clock::now() + std::chrono::milliseconds(5);
      barrier.Wait();
      const Clock::time_point start = t0;
      auto at = [&](double sec) {
        return start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(sec));
      };
      // Backward: layer l's gradients exist (L - l) layers in.
      for (int l = layers - 1; l >= 0; --l) {
        std::this_thread::sleep_until(at((layers - l) * bwd_layer));
        std::vector<int> ids;
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * l + j;
          auto g = s.gradient(i);
          std::memcpy(g.data(), grads[i].data(), grads[i].size() * 4);
          ids.push_back(i);
        }
        if (auto st = s.GradientsReady(ids); !st.ok()) return st;
      }
      // Forward: layer l waits for its own updates only.
      std::this_thread::sleep_until(at(layers * bwd_layer));
      for (int l = 0; l < layers; ++l) {
        for (int j = 0; j < 4; ++j)
          if (auto st = s.WaitUpdate(4 * l + j); !st.ok()) return st;
        if (fwd_layer > 0) {
          std::this_thread::sleep_for(std::chrono::duration<double>(fwd_layer));
        }
      }
      const double end = Since(start);
      {
        std::lock_guard<std::mutex> l(mu);
        ends[step] = std::max(ends[step], end);
      }
      if (auto st = s.FinishStep(); !st.ok()) return st;
    }
    return s.Close();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] { status[r] = rank_main(r); });
  for (auto& t : threads) t.join();
  for (const auto& st : status)
    if (!st.ok()) return st;
  return std::vector<double>(ends.begin() + 1, ends.end());
}

// The daemon's round trip for a tiny matrix: GradientsReady to the update.
absl::StatusOr<double> RoundTrip(const std::string& address) {
  auto client = Client::ConnectPool({address});
  if (!client.ok()) return client.status();
  SessionSpec spec;
  spec.job_id = "latency";
  spec.params = {{"tiny", 8, 8, Sharding::kUnreduced, 0, 0, 0, 0}};
  auto s = (*client)->OpenSession(spec);
  if (!s.ok()) return s.status();
  std::vector<double> t;
  for (int i = 0; i < 40; ++i) {
    auto g = (*s)->gradient(0);
    std::fill(g.begin(), g.end(), 1.0f);
    const auto t0 = Clock::now();
    if (auto st = (*s)->GradientsReady({0}); !st.ok()) return st;
    if (auto st = (*s)->WaitUpdate(0); !st.ok()) return st;
    if (i >= 5) t.push_back(Since(t0));
    if (auto st = (*s)->FinishStep(); !st.ok()) return st;
  }
  (void)(*s)->Close();
  std::sort(t.begin(), t.end());
  return bench::Median(t);
}

}  // namespace dmuon::scaling
