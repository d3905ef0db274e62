// The GPU check's optimizer-step tool: starts dmuond_cuda on one GPU and
// runs steps of a parameter table through it as a trainer rank on the same
// GPU over TRANSPORT_CUDA_IPC (and, when checking, as a one-rank NCCL job
// and over shared memory: the executor's host path), every session through
// the C++ client (client/client.h) with the GPU memory and the NCCL
// communicator of client/cuda/.
//
//   smoke:  gpu_step --dmuond=bin/dmuond_cuda --shapes=256x512,512x256*2
//           every update and the final momentum compared with the CPU fp32
//           path (bf16 tolerance), over cuda_ipc, nccl and shm;
//   bench:  gpu_step --dmuond=bin/dmuond_cuda --table=llama3-8b.json
//           --check=false --methods=auto,direct
//           each method a job of its own on the same daemon, each step
//           timed against its physical floor (step_floor.h): the GEMM flops
//           the NS plans execute (method "auto": the cost model's choice per
//           shape, as dmuond_cuda resolves it without --autotune-cache) at
//           the bf16 GEMM rate, plus the bytes the memory-bound passes move
//           at the device-to-device copy rate, both rates measured in the
//           same run on random operands.
// The daemon gets --max-state-bytes=--max_state_bytes (64 GiB: Llama-3-8B's
// fp32 momentum is 27.9 GB, and the daemon's default, a quarter of the
// host's memory, depends on the machine).
// Gradients: random values uploaded once to the GPU and tiled into the
// region on the device each step (the bench); the smoke's come from the
// host, as the CPU reference needs them there. The --out JSON is rewritten
// after every step and every pass, failed ones included ("error"), so a
// crash or a timeout keeps what was measured; "done" is true once the run
// ended; "transports" says of each transport asked for whether it "passed",
// "failed" or was "skipped: <why>". stdout is line-buffered.
//
// Exit: 0 every check passed on every transport asked for; 1 a check or a
// pass failed; 2 bad flags; 4 every check that ran passed but a transport
// asked for was skipped (nccl on a machine with one GPU: NCCL refuses two
// ranks of a communicator on one GPU), which run.sh reports as a partial
// step, never as a pass. Without a GPU it prints SKIP and exits 0 (run.sh's
// probe decides whether that may happen).

#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/gpu/gpu_tool.h"
#include "benchmarks/gpu/step_floor.h"
#include "client/client.h"
#include "client/cuda/device_region.h"
#include "client/cuda/nccl_peer.h"
#include "kernels/cost_model.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"
#include "proto/dmuon.grpc.pb.h"

ABSL_FLAG(std::string, dmuond, "bin/dmuond_cuda", "the daemon binary");
ABSL_FLAG(std::string, devices, "cuda:0", "the daemon's --devices");
ABSL_FLAG(int, max_batch, 8, "the daemon's --max-batch");
ABSL_FLAG(std::string, shapes, "", "RxC[*count],... (instead of --table)");
ABSL_FLAG(std::string, table, "",
          "JSON with muon_matrices[].shape, or a model_shapes.json (--model)");
ABSL_FLAG(std::string, model, "llama-3-8b", "the model of a model_shapes.json");
ABSL_FLAG(int, steps, 5,
          "timed steps per pass (odd: the median is then one of them)");
ABSL_FLAG(int, warmup, 1, "untimed steps before them (the first allocates)");
ABSL_FLAG(std::string, methods, "direct",
          "comma-separated NS methods (direct|gram|auto), one cuda_ipc pass "
          "each");
ABSL_FLAG(bool, check, true, "compare with the CPU fp32 path");
ABSL_FLAG(bool, shm, true, "also run the shm transport (with --check)");
ABSL_FLAG(bool, nccl, true, "also run a one-rank NCCL job (with --check)");
ABSL_FLAG(int64_t, max_state_bytes, int64_t{64} << 30,
          "the daemon's --max-state-bytes (fp32 momentum of all jobs)");
ABSL_FLAG(std::string, out, "", "JSON results path (empty: none)");

namespace dmuon::bench {
namespace {

namespace cu = kernels::cuda;
using Clock = std::chrono::steady_clock;

struct Matrix {
  std::string name;
  kernels::Shape shape;
};

absl::StatusOr<std::vector<Matrix>> Table() {
  std::vector<Matrix> t;
  if (!absl::GetFlag(FLAGS_table).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_table));
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (!j.is_discarded() && j.contains("models")) {  // model_shapes.json
      for (const auto& m : j["models"])
        if (m.value("model", "") == absl::GetFlag(FLAGS_model)) j = m;
    }
    if (j.is_discarded() || !j.contains("muon_matrices")) {
      return absl::InvalidArgumentError(
          "--table: no muon_matrices (or no --model of that name)");
    }
    for (const auto& m : j["muon_matrices"])
      t.push_back({m["name"], {m["shape"][0], m["shape"][1]}});
    return t;
  }
  for (const std::string& item : std::vector<std::string>(absl::StrSplit(
           absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty()))) {
    std::vector<std::string> s = absl::StrSplit(item, '*');
    long rows = 0, cols = 0;
    int count = s.size() > 1 ? std::atoi(s[1].c_str()) : 1;
    if (std::sscanf(s[0].c_str(), "%ldx%ld", &rows, &cols) != 2 || count < 1)
      return absl::InvalidArgumentError(absl::StrCat("bad shape '", item, "'"));
    for (int k = 0; k < count; ++k)
      t.push_back({absl::StrCat("m", t.size()), {rows, cols}});
  }
  if (t.empty()) return absl::InvalidArgumentError("no --shapes or --table");
  return t;
}

// One rank of world 1, replicated matrices in table order, default Muon but
// for the NS method.
SessionSpec Spec(const std::vector<Matrix>& t, const std::string& job_id,
                 const std::string& method) {
  SessionSpec spec;
  spec.job_id = job_id;
  spec.groups.emplace_back();
  spec.groups[0].method = method;
  for (size_t i = 0; i < t.size(); ++i) {
    ParamSpec p;
    p.name = t[i].name;
    p.rows = t[i].shape.rows;
    p.cols = t[i].shape.cols;
    p.forward_order = static_cast<int>(i);
    spec.params.push_back(p);
  }
  return spec;
}

// A trainer rank over TRANSPORT_CUDA_IPC or TRANSPORT_NCCL: a dmuon::Client
// session whose region is this process's GPU memory (client/cuda/), on the
// current CUDA device; gradients are written and updates read on the legacy
// default stream.
class GpuRank {
 public:
  static absl::StatusOr<std::unique_ptr<GpuRank>> Open(
      const std::string& address, const SessionSpec& spec, bool nccl) {
    ClientOptions o;
    o.deadline = std::chrono::seconds(300);  // the first steps allocate
    auto client = Client::Connect(address, o);
    if (!client.ok()) return client.status();
    auto r = std::unique_ptr<GpuRank>(new GpuRank(std::move(*client)));
    if (nccl) {
      auto s = gpu::OpenNcclSession(*r->client_, spec);
      if (!s.ok()) return s.status();
      r->region_ = std::move(s->region);
      r->peer_ = std::move(s->peer);
      r->session_ = std::move(s->session);
    } else {
      auto s = gpu::OpenCudaIpcSession(*r->client_, spec);
      if (!s.ok()) return s.status();
      r->region_ = std::move(s->region);
      r->session_ = std::move(s->session);
    }
    return r;
  }
  ~GpuRank() {
    session_.reset();  // closes before the communicator and the memory go
    peer_.reset();
  }

  float* gradient(int i) const { return region_->gradient(i); }
  float* update(int i) const { return region_->update(i); }
  int64_t elements(int i) const { return region_->elements(i); }
  Session& session() { return *session_; }

  // Hands over the gradients of `ids` (written on the legacy default
  // stream) — cuda_ipc: records the exported event; nccl: sends them — and
  // waits until every update is back (nccl: received as announced) and the
  // step complete. Returns the seconds from handing over to then; a
  // parameter the daemon skipped is an error here.
  absl::StatusOr<double> Step(const std::vector<int>& ids) {
    const auto t0 = Clock::now();
    if (peer_ != nullptr) {
      if (auto st = peer_->HandOver(*session_, *region_, ids); !st.ok())
        return st;
      if (auto st = peer_->ReceiveAnnounced(*session_, *region_); !st.ok())
        return st;
    } else {
      if (auto st = region_->GradientsWritten(); !st.ok()) return st;
      if (auto st = session_->GradientsReady(ids); !st.ok()) return st;
      for (;;) {
        auto announced = session_->NextAnnounced();
        if (!announced.ok()) return announced.status();
        if (announced->empty()) break;
      }
    }
    for (int i : ids) {
      if (session_->skipped(i)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", i, ": the daemon skipped it (non-finite gradient)"));
      }
    }
    if (auto st = session_->FinishStep(); !st.ok()) return st;
    if (const cudaError_t e = cudaStreamSynchronize(0); e != cudaSuccess)
      return absl::InternalError(cudaGetErrorString(e));
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

 private:
  explicit GpuRank(std::unique_ptr<Client> client)
      : client_(std::move(client)) {}
  std::unique_ptr<Client> client_;
  std::unique_ptr<gpu::DeviceRegion> region_;
  std::unique_ptr<gpu::NcclPeer> peer_;  // nccl
  std::unique_ptr<Session> session_;
};

// The daemon's Status (executors), over a plain stub.
absl::StatusOr<v1::StatusResponse> DaemonStatus(const std::string& address) {
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::StatusResponse resp;
  if (grpc::Status st = stub->Status(&ctx, v1::StatusRequest(), &resp);
      !st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        "Status: " + st.error_message());
  }
  return resp;
}

double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
}

// The CPU fp32 path (kernels.h) for one matrix: the reference.
std::vector<float> Reference(const Matrix& m, const std::vector<float>& g,
                             std::vector<float>& mom) {
  std::vector<float> u(g.size());
  (void)kernels::MomentumUpdate(g, absl::MakeSpan(mom), absl::MakeSpan(u), 0.95,
                                true);
  (void)kernels::Orthogonalize({m.shape, u}, {m.shape, absl::MakeSpan(u)});
  const float s = static_cast<float>(
      kernels::LrScale(kernels::LrAdjust::kOriginal, m.shape));
  for (float& x : u) x *= s;
  return u;
}

// The --out JSON, rewritten whole (through a temporary and a rename, so a
// reader never sees half a file) every time a figure is added.
class Results {
 public:
  explicit Results(std::string path) : path_(std::move(path)) {}
  nlohmann::json& operator*() { return j_; }
  nlohmann::json* operator->() { return &j_; }
  void Save() const {
    if (path_.empty()) return;
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream f(tmp);
      f << j_.dump(1) << "\n";
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", tmp.c_str());
        return;
      }
    }
    if (std::rename(tmp.c_str(), path_.c_str()) != 0)
      std::fprintf(stderr, "cannot write %s\n", path_.c_str());
  }

 private:
  std::string path_;
  nlohmann::json j_;
};

// The method the daemon runs for `m` under `method` ("auto": the cost
// model's choice, as OptimizerService::TuneTable resolves it without an
// autotuner).
kernels::Method Resolved(const std::string& method, const Matrix& m) {
  auto parsed = kernels::ParseMethod(method);
  const kernels::NsOptions ns;
  if (!parsed.ok() || *parsed == kernels::Method::kAuto)
    return kernels::CheapestMethod(m.shape, ns);
  return *parsed;
}

// The NS flops of `table` under `method` with ideal triangle-only
// symmetric products (half of each): the old floor's count, reported.
double IdealNsFlops(const std::vector<Matrix>& table,
                    const std::string& method) {
  double flops = 0;
  for (const Matrix& m : table)
    flops += kernels::EstimateCost(Resolved(method, m), m.shape, {}, 0.5).flops;
  return flops;
}

// What one step of `table` under `method` executes and moves (step_floor.h).
StepWork Work(const std::vector<Matrix>& table, const std::string& method) {
  StepWork w;
  for (const Matrix& m : table) {
    w +=
        MatrixStepWork(m.shape, Resolved(method, m), {},
                       kernels::LrScale(kernels::LrAdjust::kOriginal, m.shape));
  }
  return w;
}

// Random gradients on the device: 64 MiB of random values uploaded once,
// copied into every gradient slot (tiled, at an offset that changes with
// the step and the matrix) on the legacy default stream. Filling 28 GB from
// pageable host memory every step would cost seconds; this, milliseconds.
class DeviceGradients {
 public:
  ~DeviceGradients() {
    if (chunk_ != nullptr) cudaFree(chunk_);
  }
  absl::Status Init() {
    std::vector<float> host(kChunk);
    FillRandom(11, absl::MakeSpan(host));
    for (float& x : host) x *= 1.7320508f;  // unit variance, as randn's
    if (const cudaError_t e =
            cudaMalloc(reinterpret_cast<void**>(&chunk_), kChunk * 4);
        e != cudaSuccess)
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMalloc: ", cudaGetErrorString(e)));
    if (const cudaError_t e =
            cudaMemcpy(chunk_, host.data(), kChunk * 4, cudaMemcpyHostToDevice);
        e != cudaSuccess)
      return absl::InternalError(
          absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
    return absl::OkStatus();
  }
  // Gradient `i` of `n` elements at `dst` for step `step`.
  absl::Status Fill(float* dst, int64_t n, int step, size_t i) const {
    const int64_t half = kChunk / 2;
    const int64_t off = (step * 7919 + static_cast<int64_t>(i) * 104729) % half;
    for (int64_t k = 0; k < n; k += half) {
      if (const cudaError_t e =
              cudaMemcpyAsync(dst + k, chunk_ + off, std::min(n - k, half) * 4,
                              cudaMemcpyDeviceToDevice, /*stream=*/0);
          e != cudaSuccess)
        return absl::InternalError(
            absl::StrCat("cudaMemcpyAsync: ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

 private:
  static constexpr int64_t kChunk = int64_t{1} << 24;  // floats
  float* chunk_ = nullptr;
};

// Warm-up and timed steps of `table` as one rank, one job, NS method
// `method`, over cuda_ipc (or nccl): gradients written on the GPU and
// updates read back from it; with --check every update and the final
// momentum against the CPU fp32 path. Its figures go into `pass` (saved
// through `results` after every step); returns whether the checks passed.
absl::StatusOr<bool> GpuPass(const std::string& address,
                             const std::vector<Matrix>& table, bool nccl,
                             const std::string& method, double floor_s,
                             nlohmann::json& pass, const Results& results) {
  const std::string name = nccl ? "nccl" : "cuda_ipc";
  const bool check = absl::GetFlag(FLAGS_check);
  const int warmup = absl::GetFlag(FLAGS_warmup),
            steps = absl::GetFlag(FLAGS_steps);
  auto rank = GpuRank::Open(
      address,
      Spec(table, absl::StrCat("gpu-step-", name, "-", method), method), nccl);
  if (!rank.ok()) return rank.status();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> mom(check ? table.size() : 0);
  for (size_t i = 0; i < mom.size(); ++i)
    mom[i].assign(table[i].shape.elements(), 0.0f);
  std::vector<int> ids(table.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
  DeviceGradients device_grads;
  if (!check) {
    if (auto st = device_grads.Init(); !st.ok()) return st;
  }
  std::vector<double> warm, times;
  double worst = 0;
  for (int step = 1; step <= warmup + steps; ++step) {
    std::vector<std::vector<float>> grads(check ? table.size() : 0);
    for (size_t i = 0; i < table.size(); ++i) {
      const int64_t n = (*rank)->elements(i);
      if (!check) {
        if (auto st = device_grads.Fill((*rank)->gradient(i), n, step, i);
            !st.ok())
          return st;
        continue;
      }
      grads[i].resize(n);
      for (float& x : grads[i]) x = nd(rng);
      if (const cudaError_t e =
              cudaMemcpy((*rank)->gradient(i), grads[i].data(), n * 4,
                         cudaMemcpyHostToDevice);
          e != cudaSuccess)
        return absl::InternalError(
            absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
    }
    // The gradients are in place before the clock starts.
    if (const cudaError_t e = cudaStreamSynchronize(0); e != cudaSuccess)
      return absl::InternalError(cudaGetErrorString(e));
    auto s = (*rank)->Step(ids);
    if (!s.ok()) {
      return absl::Status(
          s.status().code(),
          absl::StrCat("step ", step, ": ", s.status().message()));
    }
    const bool timed = step > warmup;
    (timed ? times : warm).push_back(*s);
    std::printf("%s %s step %d%s: %.4f s (floor %.4f s, %.2fx)\n", name.c_str(),
                method.c_str(), step, timed ? "" : " (warm-up)", *s, floor_s,
                *s / floor_s);
    for (size_t i = 0; check && i < table.size(); ++i) {
      std::vector<float> got(grads[i].size());
      if (const cudaError_t e =
              cudaMemcpy(got.data(), (*rank)->update(i), got.size() * 4,
                         cudaMemcpyDeviceToHost);
          e != cudaSuccess)
        return absl::InternalError(
            absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
      worst =
          std::max(worst, RelErr(got, Reference(table[i], grads[i], mom[i])));
    }
    pass["warmup_seconds"] = warm;
    pass["step_seconds"] = times;
    if (!times.empty()) {
      std::vector<double> sorted = times;
      std::sort(sorted.begin(), sorted.end());
      // Odd counts: the middle sample; even: the mean of the middle two.
      const size_t h = sorted.size() / 2;
      const double median =
          sorted.size() % 2 == 1 ? sorted[h] : (sorted[h - 1] + sorted[h]) / 2;
      pass["median_seconds"] = median;
      pass["vs_floor"] = median / floor_s;
    }
    if (check) pass["max_rel_err"] = worst;
    results.Save();
  }
  bool ok = true;
  if (check) {
    auto state = (*rank)->session().GetState();
    double mom_err =
        state.ok() && state->momentum.size() == table.size() ? 0 : INFINITY;
    for (size_t i = 0; std::isfinite(mom_err) && i < table.size(); ++i)
      mom_err = std::max(mom_err, RelErr(state->momentum[i], mom[i]));
    pass["momentum_max_rel_err"] = mom_err;
    ok = worst < 3e-2 && mom_err < 1e-5;
    std::printf("%s: updates vs CPU fp32 max rel err %.2e, momentum %.2e: %s\n",
                name.c_str(), worst, mom_err, ok ? "OK" : "FAIL");
  }
  if (auto st = DaemonStatus(address); st.ok()) {
    for (const auto& e : st->executors()) {
      pass["executors"].push_back({{"device", e.device()},
                                   {"healthy", e.healthy()},
                                   {"memory_bytes", e.memory_bytes()},
                                   {"busy_seconds", e.busy_seconds()}});
      std::printf("executor %s healthy=%d memory %.2f GB busy %.2f s\n",
                  e.device().c_str(), e.healthy(), e.memory_bytes() / 1e9,
                  e.busy_seconds());
    }
  }
  if (auto st = (*rank)->session().Close(); !st.ok()) return st;
  return ok;
}

int Run() {
  Results out(absl::GetFlag(FLAGS_out));
  *out = {{"done", false}};
  auto table = Table();
  if (!table.ok())
    return std::fprintf(stderr, "%s\n", table.status().ToString().c_str()), 2;
  const std::vector<std::string> methods =
      absl::StrSplit(absl::GetFlag(FLAGS_methods), ',', absl::SkipEmpty());
  for (const std::string& m : methods) {
    if (!kernels::ParseMethod(m).ok())
      return std::fprintf(stderr, "--methods: '%s' is not direct|gram|auto\n",
                          m.c_str()),
             2;
  }
  if (methods.empty() || absl::GetFlag(FLAGS_steps) < 1 ||
      absl::GetFlag(FLAGS_warmup) < 0)
    return std::fprintf(stderr,
                        "--methods must name one, --steps >= 1, --warmup >= "
                        "0\n"),
           2;
  auto count = cu::DeviceCount();
  if (!count.ok() || *count == 0) {
    const std::string why =
        count.ok() ? "0 devices" : std::string(count.status().message());
    std::printf("SKIP gpu_step: no CUDA device (%s)\n", why.c_str());
    *out = {{"done", true}, {"skipped", why}};
    out.Save();
    return 0;
  }
  const bool check = absl::GetFlag(FLAGS_check);
  uint64_t elements = 0;
  for (const Matrix& m : *table) elements += m.shape.elements();
  (*out)["matrices"] = table->size();
  (*out)["gradient_gb"] = elements * 4 / 1e9;
  (*out)["warmup"] = absl::GetFlag(FLAGS_warmup);
  (*out)["steps"] = absl::GetFlag(FLAGS_steps);
  // What torch.optim.Muon executes: direct NS with dense products.
  double dense = 0;
  for (const Matrix& m : *table)
    dense +=
        kernels::EstimateCost(kernels::Method::kDirect, m.shape, {}, 1.0).flops;
  (*out)["dense_direct_ns_tflop"] = dense / 1e12;
  auto rate = Bf16GemmRate(0);
  if (!rate.ok()) {
    std::fprintf(stderr, "GEMM: %s\n", rate.status().ToString().c_str());
    (*out)["error"] = absl::StrCat("GEMM: ", rate.status().ToString());
    out.Save();
    return 1;
  }
  (*out)["gemm_tflops"] = *rate / 1e12;
  std::printf("bf16 GEMM 8192^3 on random operands: %.1f TFLOP/s\n",
              *rate / 1e12);
  auto copy = DeviceCopyRate(0);
  if (!copy.ok()) {
    std::fprintf(stderr, "copy: %s\n", copy.status().ToString().c_str());
    (*out)["error"] = absl::StrCat("copy: ", copy.status().ToString());
    out.Save();
    return 1;
  }
  (*out)["copy_gb_per_s"] = *copy / 1e9;
  std::printf(
      "device-to-device copy of 1 GiB: %.0f GB/s moved (read + written)\n",
      *copy / 1e9);
  out.Save();

  DaemonProcess d;
  // --job-retention-seconds=0: a pass's momentum leaves the GPU when the
  // pass closes, before the next method's job allocates its own.
  if (auto st =
          d.Start(absl::GetFlag(FLAGS_dmuond),
                  {"--log-level=warn", "--summary-every-secs=0",
                   "--job-retention-seconds=0",
                   "--devices=" + absl::GetFlag(FLAGS_devices),
                   absl::StrCat("--max-batch=", absl::GetFlag(FLAGS_max_batch)),
                   absl::StrCat("--max-state-bytes=",
                                absl::GetFlag(FLAGS_max_state_bytes))});
      !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    (*out)["error"] = st.ToString();
    out.Save();
    return 1;
  }
  int failures = 0;
  nlohmann::json& passes = (*out)["passes"];
  nlohmann::json& transports = (*out)["transports"];
  transports = nlohmann::json::object();

  // cuda_ipc, one job per method: gradients written on the GPU, updates
  // read back from it.
  for (const std::string& method : methods) {
    const std::string key = "cuda_ipc/" + method;
    const StepWork work = Work(*table, method);
    const double floor_s = FloorSeconds(work, *rate, *copy);
    passes[key] = {{"method", method},
                   {"ideal_ns_tflop", IdealNsFlops(*table, method) / 1e12},
                   {"executed_tflop", work.gemm_flops / 1e12},
                   {"moved_gb", work.bytes / 1e9},
                   {"floor_seconds", floor_s}};
    if (method == "auto") {
      nlohmann::json chosen;
      for (const Matrix& m : *table)
        chosen[absl::StrCat(m.shape.rows, "x", m.shape.cols)] =
            std::string(kernels::MethodName(Resolved(method, m)));
      passes[key]["resolved"] = chosen;
    }
    out.Save();
    auto ipc = GpuPass(d.address(), *table, /*nccl=*/false, method, floor_s,
                       passes[key], out);
    if (!ipc.ok()) {
      std::fprintf(stderr, "%s: %s\n", key.c_str(),
                   ipc.status().ToString().c_str());
      passes[key]["error"] = ipc.status().ToString();
    }
    passes[key]["ok"] = ipc.ok() && *ipc;
    failures += !ipc.ok() || !*ipc;
    if (transports.value("cuda_ipc", "passed") == "passed")
      transports["cuda_ipc"] = ipc.ok() && *ipc ? "passed" : "failed";
    if (passes[key].contains("median_seconds")) {
      const double median = passes[key]["median_seconds"];
      std::printf(
          "optimizer step, method %s (%zu matrices, %.1f GB of fp32 "
          "gradients): median of %d %.4f s; floor %.4f s (%.1f TFLOP at %.0f "
          "TFLOP/s bf16 GEMM + %.1f GB at %.0f GB/s): %.2fx the floor\n",
          method.c_str(), table->size(), elements * 4 / 1e9,
          absl::GetFlag(FLAGS_steps), median, floor_s, work.gemm_flops / 1e12,
          *rate / 1e12, work.bytes / 1e9, *copy / 1e9, median / floor_s);
    }
    out.Save();
  }
  // nccl: a job of one rank on another GPU, the daemon its second NCCL rank
  // (NCCL refuses two ranks of one communicator on one GPU).
  const std::string method0 = methods.front();
  int skipped = 0;
  if (check && absl::GetFlag(FLAGS_nccl) && *count < 2) {
    passes["nccl"] = {
        {"skipped", "one GPU (NCCL refuses two ranks on one GPU)"}};
    transports["nccl"] = "skipped: one GPU";
    ++skipped;
    std::printf(
        "SKIP nccl: one GPU here, and NCCL refuses two ranks of a "
        "communicator on one GPU ('Duplicate GPU detected')\n");
  } else if (check && absl::GetFlag(FLAGS_nccl)) {
    const std::string key = "nccl/" + method0;
    passes[key] = {{"method", method0}};
    cudaSetDevice(1);  // the trainer rank's GPU; the daemon is on cuda:0
    auto nccl = GpuPass(d.address(), *table, /*nccl=*/true, method0,
                        FloorSeconds(Work(*table, method0), *rate, *copy),
                        passes[key], out);
    cudaSetDevice(0);
    if (!nccl.ok()) {
      std::fprintf(stderr, "nccl: %s\n", nccl.status().ToString().c_str());
      passes[key]["error"] = nccl.status().ToString();
    }
    passes[key]["ok"] = nccl.ok() && *nccl;
    transports["nccl"] = nccl.ok() && *nccl ? "passed" : "failed";
    failures += !nccl.ok() || !*nccl;
  }
  out.Save();

  // shm: the CUDA executor's host path, through the C++ client.
  if (check && absl::GetFlag(FLAGS_shm)) {
    std::mt19937_64 rng(12);
    std::normal_distribution<float> nd;
    std::vector<std::vector<float>> mom(table->size());
    auto client = Client::Connect(d.address());
    SessionSpec spec;
    spec.job_id = "gpu-step-shm";
    spec.transport = TransportChoice::kShm;
    for (const Matrix& m : *table)
      spec.params.push_back({m.name, m.shape.rows, m.shape.cols});
    auto session = client.ok() ? (*client)->OpenSession(spec) : client.status();
    double err = session.ok() ? 0 : INFINITY;
    for (size_t i = 0; i < mom.size(); ++i)
      mom[i].assign((*table)[i].shape.elements(), 0.0f);
    for (int step = 1; session.ok() && step <= 2; ++step) {
      std::vector<std::vector<float>> g(table->size());
      for (size_t i = 0; i < table->size(); ++i) {
        g[i].resize((*table)[i].shape.elements());
        for (float& x : g[i]) x = nd(rng);
        auto dst = (*session)->gradient(i);
        std::copy(g[i].begin(), g[i].end(), dst.begin());
        (void)(*session)->GradientReady(i);
      }
      for (size_t i = 0; i < table->size(); ++i) {
        if (auto st = (*session)->WaitUpdate(i); !st.ok()) {
          err = INFINITY;
          break;
        }
        auto u = (*session)->update(i);
        err = std::max(err, RelErr(std::vector<float>(u.begin(), u.end()),
                                   Reference((*table)[i], g[i], mom[i])));
      }
      (void)(*session)->FinishStep();
    }
    if (!session.ok()) {
      std::fprintf(stderr, "shm: %s\n", session.status().ToString().c_str());
      passes["shm"]["error"] = session.status().ToString();
    }
    const bool ok = err < 3e-2;
    failures += !ok;
    passes["shm"]["max_rel_err"] = err;
    passes["shm"]["ok"] = ok;
    transports["shm"] = ok ? "passed" : "failed";
    std::printf("shm: updates vs CPU fp32 max rel err %.2e: %s\n", err,
                ok ? "OK" : "FAIL");
  }
  (*out)["ok"] = failures == 0;
  (*out)["done"] = true;
  out.Save();
  if (failures > 0) return 1;
  if (skipped > 0) {
    std::printf(
        "gpu_step: every check that ran passed; %d transport(s) "
        "skipped (exit 4)\n",
        skipped);
    return 4;
  }
  return 0;
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a killed run keeps its lines
  absl::ParseCommandLine(argc, argv);
  return dmuon::bench::Run();
}
