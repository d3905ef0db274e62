// ./dmuon bench daemon: one optimizer step of GPT-2-small's matrices (shapes
// divided by --scale to run in seconds on 2 cores) through a real dmuond
// over shm and over inline, against the same kernels called in-process on
// the same number of threads, measured alternately in one run; plus the shm
// transport's copy rate against a plain memcpy of the same bytes.

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "client/client.h"
#include "kernels/cost_model.h"
#include "kernels/kernels.h"
#include "proto/dmuon.grpc.pb.h"

ABSL_FLAG(std::string, dmuond, "bazel-bin/daemon/dmuond", "the daemon binary");
ABSL_FLAG(int, scale, 4, "divide GPT-2-small's dimensions by this");
ABSL_FLAG(int, layers, 12, "transformer layers (4 matrices each)");
ABSL_FLAG(int, steps, 7, "timed steps per configuration (after one warm-up)");
ABSL_FLAG(int, threads, 0, "BLAS threads on both sides (0: all cores)");
ABSL_FLAG(std::string, out, "", "JSON results path");
ABSL_FLAG(double, tenant_seconds, 4,
          "two-tenant table: seconds each configuration runs");
ABSL_FLAG(bool, tenants_only, false,
          "run the two-tenant table only (no step table, no JSON)");

extern char** environ;

namespace dmuon::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<ParamSpec> Table(int scale) {
  const int64_t h = 768 / scale, f = 3072 / scale;
  std::vector<ParamSpec> t;
  for (int l = 0; l < absl::GetFlag(FLAGS_layers); ++l) {
    const std::string p = absl::StrCat("h.", l, ".");
    t.push_back(
        {p + "attn.c_attn", 3 * h, h, Sharding::kReplicated, 0, 0, 4 * l, 0});
    t.push_back(
        {p + "attn.c_proj", h, h, Sharding::kReplicated, 0, 0, 4 * l + 1, 0});
    t.push_back(
        {p + "mlp.c_fc", f, h, Sharding::kReplicated, 0, 0, 4 * l + 2, 0});
    t.push_back(
        {p + "mlp.c_proj", h, f, Sharding::kReplicated, 0, 0, 4 * l + 3, 0});
  }
  return t;
}

// dmuond with `threads` BLAS threads and `extra` flags.
absl::Status Start(DaemonProcess& d, int threads,
                   const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"--log-level=warn", "--summary-every-secs=0",
                                   absl::StrCat("--cpu-threads=", threads)};
  args.insert(args.end(), extra.begin(), extra.end());
  return d.Start(absl::GetFlag(FLAGS_dmuond), std::move(args));
}

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

absl::Status Run(std::vector<Row>& rows) {
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0)
    threads = static_cast<int>(std::thread::hardware_concurrency());
  kernels::SetCpuThreads(threads);
  const auto table = Table(absl::GetFlag(FLAGS_scale));
  std::mt19937_64 rng(7);
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> grads, mom, upd;
  double dense = 0;
  uint64_t bytes = 0;
  for (const auto& p : table) {
    grads.emplace_back(p.rows * p.cols);
    for (float& x : grads.back()) x = d(rng);
    mom.emplace_back(p.rows * p.cols, 0.0f);
    upd.emplace_back(p.rows * p.cols);
    dense += kernels::EstimateCost(kernels::Method::kDirect, {p.rows, p.cols},
                                   {}, 1.0)
                 .dense_equivalent_flops;
    bytes += p.rows * p.cols * 4;
  }
  // In-process: what the daemon's executor does, without the daemon.
  // Buffers allocated once, as the daemon's are.
  std::vector<std::vector<float>> u(table.size());
  auto in_process = [&]() -> absl::Status {
    std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> by_shape;
    for (size_t i = 0; i < table.size(); ++i) {
      u[i].resize(grads[i].size());
      auto st = kernels::MomentumUpdate(grads[i], absl::MakeSpan(mom[i]),
                                        absl::MakeSpan(u[i]), 0.95, true);
      if (!st.ok()) return st;
      by_shape[{table[i].rows, table[i].cols}].push_back(i);
    }
    for (auto& [shape, ids] : by_shape) {
      std::vector<kernels::ConstMatrixF> in;
      std::vector<kernels::MatrixF> out;
      for (size_t i : ids) {
        in.push_back({{shape.first, shape.second}, u[i]});
        out.push_back({{shape.first, shape.second}, absl::MakeSpan(upd[i])});
      }
      if (auto st = kernels::OrthogonalizeBatch(in, out); !st.ok()) return st;
    }
    for (size_t i = 0; i < table.size(); ++i) {
      const float s = static_cast<float>(kernels::LrScale(
          kernels::LrAdjust::kOriginal, {table[i].rows, table[i].cols}));
      for (float& x : upd[i]) x *= s;
    }
    return absl::OkStatus();
  };

  DaemonProcess daemon;
  if (auto st = Start(daemon, threads); !st.ok()) return st;
  auto client = Client::Connect(daemon.address());
  if (!client.ok()) return client.status();
  std::map<std::string, std::unique_ptr<Session>> sessions;
  for (const char* t : {"shm", "inline"}) {
    SessionSpec spec;
    spec.job_id = absl::StrCat("bench-", t);
    spec.params = table;
    spec.transport = std::string(t) == "shm" ? TransportChoice::kShm
                                             : TransportChoice::kInline;
    auto s = (*client)->OpenSession(spec);
    if (!s.ok()) return s.status();
    sessions[t] = std::move(*s);
  }
  auto through = [&](Session& s) -> absl::Status {
    std::vector<int> ids;
    for (size_t i = 0; i < table.size(); ++i) {
      auto g = s.gradient(static_cast<int>(i));
      std::memcpy(g.data(), grads[i].data(), grads[i].size() * 4);
      ids.push_back(static_cast<int>(i));
    }
    if (auto st = s.GradientsReady(ids); !st.ok()) return st;
    return s.FinishStep();
  };
  std::map<std::string, std::vector<double>> times;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int rep = 0; rep <= steps;
       ++rep) {  // alternate, so drift hits all alike
    auto t0 = Clock::now();
    if (auto st = in_process(); !st.ok()) return st;
    if (rep) times["in-process"].push_back(Seconds(t0));
    for (auto& [name, s] : sessions) {
      t0 = Clock::now();
      if (auto st = through(*s); !st.ok()) return st;
      if (rep) times["dmuond-" + name].push_back(Seconds(t0));
    }
  }
  const std::string shape =
      absl::StrCat("gpt2-small/", absl::GetFlag(FLAGS_scale), " (",
                   table.size(), " matrices)");
  for (auto& [k, v] : times) std::sort(v.begin(), v.end());
  const double base = Median(times["in-process"]);
  const double base_rate = dense / base / 1e9;
  for (const char* k : {"in-process", "dmuond-shm", "dmuond-inline"}) {
    const double t = Median(times[k]);
    rows.push_back(
        {shape, 1, k, t, dense / t / 1e9, base_rate, base / t, -1, times[k]});
  }
  // Transport: copying the step's gradient bytes into the shm segment vs a
  // plain memcpy between heap buffers.
  std::vector<char> src(bytes), dst(bytes);
  std::memset(src.data(), 1, bytes);
  Session& shm = *sessions["shm"];
  auto copy_shm = [&] {
    size_t off = 0;
    for (size_t i = 0; i < table.size(); ++i) {
      auto g = shm.gradient(static_cast<int>(i));
      std::memcpy(g.data(), src.data() + off, g.size() * 4);
      off += g.size() * 4;
    }
    return absl::OkStatus();
  };
  auto copy_heap = [&] {
    std::memcpy(dst.data(), src.data(), bytes);
    return absl::OkStatus();
  };
  auto ts = Time(copy_shm, 20), th = Time(copy_heap, 20);
  const double gb = bytes / 1e9;
  rows.push_back({absl::StrCat(bytes, " bytes"), 1, "memcpy-heap GB/s",
                  Median(*th), gb / Median(*th), gb / Median(*th), 1.0, -1,
                  *th});
  rows.push_back({absl::StrCat(bytes, " bytes"), 1, "copy-into-shm GB/s",
                  Median(*ts), gb / Median(*ts), gb / Median(*th),
                  Median(*th) / Median(*ts), -1, *ts});
  for (auto& [n, s] : sessions) (void)s->Close();
  return absl::OkStatus();
}

// One tenant of the two-tenant table: a trainer thread running steps of
// `table` on its own job as `token` until `stop`, its step times kept.
struct Tenant {
  std::string job, token;
  std::vector<ParamSpec> table;
  std::vector<double> step_seconds;
  absl::Status status;
};

void RunTenant(const std::string& address, Tenant& t,
               const std::atomic<bool>& stop) {
  ClientOptions o;
  o.token = t.token;
  auto client = Client::Connect(address, o);
  if (!client.ok()) {
    t.status = client.status();
    return;
  }
  SessionSpec spec;
  spec.job_id = t.job;
  spec.params = t.table;
  auto s = (*client)->OpenSession(spec);
  if (!s.ok()) {
    t.status = s.status();
    return;
  }
  std::vector<int> ids;
  for (size_t i = 0; i < t.table.size(); ++i) {
    for (float& x : (*s)->gradient(static_cast<int>(i))) x = 0.01f * (i + 1);
    ids.push_back(static_cast<int>(i));
  }
  while (!stop && t.status.ok()) {
    const auto t0 = Clock::now();
    t.status = (*s)->GradientsReady(ids);
    if (t.status.ok()) t.status = (*s)->FinishStep();
    t.step_seconds.push_back(Seconds(t0));
  }
  (void)(*s)->Close();
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

// Two tenants (principals of weights wa:wb) on one executor for
// --tenant-seconds; prints a line per tenant: steps, p50/p99 step time and
// its share of the executor from Status. `b` empty: `a` alone.
absl::Status TwoTenants(const std::string& label, double wa, double wb,
                        Tenant a, Tenant b, int threads, int max_batch) {
  const std::string tokens = absl::StrCat("/tmp/dmuon-bench-tokens.", getpid());
  std::ofstream(tokens) << "trainer a-token alice weight=" << wa << "\n"
                        << "trainer b-token bob weight=" << wb << "\n";
  DaemonProcess daemon;
  absl::Status st = Start(daemon, threads,
                          {"--auth-token-file=" + tokens, "--cpu-executors=1",
                           absl::StrCat("--max-batch=", max_batch)});
  if (!st.ok()) return st;
  a.token = "a-token";
  b.token = "b-token";
  std::atomic<bool> stop{false};
  std::thread ta(RunTenant, daemon.address(), std::ref(a), std::cref(stop));
  std::thread tb;
  if (!b.table.empty())
    tb = std::thread(RunTenant, daemon.address(), std::ref(b), std::cref(stop));
  std::this_thread::sleep_for(
      std::chrono::duration<double>(absl::GetFlag(FLAGS_tenant_seconds)));
  // Shares: each tenant's device seconds over both, as Status tells them
  // (the operator-free way: each principal sees its own job's).
  std::map<std::string, double> seconds, batch;
  for (Tenant* t : {&a, &b}) {
    if (t->table.empty()) continue;
    auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(
        daemon.address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + t->token);
    v1::StatusResponse s;
    if (grpc::Status g = stub->Status(&ctx, v1::StatusRequest(), &s); !g.ok())
      return absl::UnavailableError("Status: " + g.error_message());
    for (const auto& j : s.jobs()) {
      if (j.job_id() != t->job) continue;
      seconds[t->job] = j.device_seconds();
      batch[t->job] = j.device_batch_max_seconds();
    }
  }
  stop = true;
  ta.join();
  if (tb.joinable()) tb.join();
  std::remove(tokens.c_str());
  double all = 0;
  for (auto& [job, s] : seconds) all += s;
  for (Tenant* t : {&a, &b}) {
    if (t->table.empty()) continue;
    if (!t->status.ok()) return t->status;
    std::printf("%-22s %-8s %6zu %10.1f %10.1f %8.1f%% %13.1f\n", label.c_str(),
                t->job.c_str(), t->step_seconds.size(),
                Quantile(t->step_seconds, 0.5) * 1e3,
                Quantile(t->step_seconds, 0.99) * 1e3,
                all > 0 ? 100 * seconds[t->job] / all : 0.0,
                batch[t->job] * 1e3);
  }
  return absl::OkStatus();
}

// tests/small_tenant_test's jobs: 4 matrices of 64x128 beside 50 of
// 256x256 (100x the elements), alone and together.
absl::Status SmallTenantRows(int threads) {
  std::vector<ParamSpec> small4, big100;
  for (int i = 0; i < 4; ++i)
    small4.push_back(
        {absl::StrCat("s", i), 64, 128, Sharding::kReplicated, 0, 0, i, 0});
  for (int i = 0; i < 50; ++i)
    big100.push_back(
        {absl::StrCat("b", i), 256, 256, Sharding::kReplicated, 0, 0, i, 0});
  absl::Status st = TwoTenants("small4 alone", 1, 1,
                               {"small4", "", small4, {}, {}}, {}, threads, 1);
  if (!st.ok()) return st;
  return TwoTenants("1:1 small4+big100x", 1, 1, {"small4", "", small4, {}, {}},
                    {"big100x", "", big100, {}, {}}, threads, 1);
}

absl::Status RunTwoTenants() {
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0)
    threads = static_cast<int>(std::thread::hardware_concurrency());
  // Twice --scale: steps short enough for several in --tenant-seconds.
  const std::vector<ParamSpec> big = Table(2 * absl::GetFlag(FLAGS_scale));
  // The small tenant: one matrix of c_proj's shape, about 1/100 of the
  // big tenant's step.
  std::vector<ParamSpec> small = {big[1]};
  small[0].name = "small.w";
  std::printf(
      "\ntwo tenants on one executor (--cpu-executors=1), closed loop, "
      "%.0f s each\n%-22s %-8s %6s %10s %10s %9s %13s\n",
      absl::GetFlag(FLAGS_tenant_seconds), "weights", "tenant", "steps",
      "p50_ms", "p99_ms", "share", "max_batch_ms");
  // Big+big with --max-batch=1: a step is 48 batches, so a tenant stays
  // backlogged through its step (with 4 batches a step, the client's
  // turn-around caps the heavier tenant's share).
  for (auto [wa, wb] : {std::pair<double, double>{1, 1}, {3, 1}}) {
    absl::Status st = TwoTenants(absl::StrCat(wa, ":", wb, " big+big mb1"), wa,
                                 wb, {"big-a", "", big, {}, {}},
                                 {"big-b", "", big, {}, {}}, threads, 1);
    if (!st.ok()) return st;
  }
  absl::Status st = TwoTenants("small alone", 1, 1,
                               {"small", "", small, {}, {}}, {}, threads, 16);
  if (!st.ok()) return st;
  st = TwoTenants("1:1 small+big", 1, 1, {"small", "", small, {}, {}},
                  {"big", "", big, {}, {}}, threads, 16);
  if (!st.ok()) return st;
  return SmallTenantRows(threads);
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_tenants_only)) {
    absl::Status st = dmuon::bench::RunTwoTenants();
    if (!st.ok())
      std::fprintf(stderr, "daemon_bench: two tenants: %s\n",
                   st.ToString().c_str());
    return st.ok() ? 0 : 1;
  }
  std::vector<dmuon::bench::Row> rows;
  if (absl::Status st = dmuon::bench::Run(rows); !st.ok()) {
    std::fprintf(stderr, "daemon_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf(
      "gflops: dense-equivalent NS flops of the step / median step time; "
      "peak_gflops and\n"
      "ratio: against the in-process run (ratio = in-process time / this "
      "time)\n");
  dmuon::bench::PrintTable(rows);
  if (absl::Status st = dmuon::bench::RunTwoTenants(); !st.ok()) {
    std::fprintf(stderr, "daemon_bench: two tenants: %s\n",
                 st.ToString().c_str());
    return 1;
  }
  const std::string cmd =
      absl::StrCat("./dmuon bench daemon --scale=", absl::GetFlag(FLAGS_scale),
                   " --steps=", absl::GetFlag(FLAGS_steps));
  auto st = dmuon::bench::WriteJson(absl::GetFlag(FLAGS_out), "daemon",
                                    dmuon::bench::CpuMachine(), cmd, rows);
  if (!st.ok()) {
    std::fprintf(stderr, "daemon_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
