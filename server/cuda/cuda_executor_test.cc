// The CUDA executor against the CPU executor (its oracle): host and device
// I/O, every gather mode, device-resident momentum and its hooks, the NaN
// skip, out-of-memory health. On a machine without a GPU the device tests
// skip with the reason and the no-GPU behaviour is checked instead.

#include "server/cuda/cuda_executor.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/testing/accuracy.h"
#include "kernels/cuda/testing/gpu.h"

namespace dmuon::server {
namespace {

using kernels::cuda::accuracy::Random;
using kernels::cuda::accuracy::RelError;
using kernels::cuda::testing::HaveGpu;

// What an update of `shape` may differ from the CPU executor's: the bound of
// kernels/cuda/testing/accuracy.h for the executor's NS (ExecutorNsOptions:
// fp32 in and out, the compute dtype of `muon`'s method), which
// emulated_precision_test checks on these shapes (accuracy::
// kExecutorShapes). `input_rounding`: the dtype the device rounded the NS
// input to beyond what the CPU did (bf16 momentum).
double UpdateBound(
    kernels::Shape shape, const MuonParams& muon,
    kernels::cuda::DType input_rounding = kernels::cuda::DType::kF32) {
  return kernels::cuda::accuracy::ErrorBound(
      shape, ExecutorNsOptions(muon.ns, {}), kernels::cuda::DType::kF32,
      input_rounding);
}

// One matrix's host buffers for both executors.
struct Matrix {
  kernels::Shape shape;
  std::vector<float> grad, cpu_momentum, cpu_update, gpu_update;
};

ComputeTask HostTask(Matrix& m, const MuonParams* muon, int param, bool gpu) {
  ComputeTask t;
  t.grad = m.grad.data();
  t.momentum = gpu ? nullptr : m.cpu_momentum.data();
  t.update = gpu ? m.gpu_update.data() : m.cpu_update.data();
  t.shape = m.shape;
  t.muon = muon;
  t.lr_scale = kernels::LrScale(kernels::LrAdjust::kOriginal, m.shape);
  t.state = {7, param};
  return t;
}

TEST(CudaExecutorNoGpu, ExplainsWhyThereIsNoExecutor) {
  std::string why;
  if (HaveGpu(&why)) GTEST_SKIP() << "a GPU is present";
  auto none = NewCudaExecutors("cuda:0", {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.status().message().find("no usable CUDA device"),
            std::string::npos)
      << none.status();
  auto fallback = NewCudaExecutors("auto", {}, &why);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_TRUE(fallback->empty());
  EXPECT_FALSE(why.empty());
}

class CudaExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DMUON_SKIP_WITHOUT_GPU();
    auto e = NewCudaExecutor(0, {});
    ASSERT_TRUE(e.ok()) << e.status();
    gpu_ = *std::move(e);
    cpu_ = NewCpuExecutor(0, 0);
  }
  // One step of a fresh matrix: the CPU executor on the gathered gradient
  // `grad` (the host path; its update in `want`), and the CUDA executor on
  // the same task through device I/O `io` (its parts' updates written).
  void ComputeBoth(kernels::Shape shape, std::vector<float> grad, DeviceIo& io,
                   std::vector<float>* want) {
    Matrix m;
    m.shape = shape;
    m.grad = std::move(grad);
    m.cpu_momentum.assign(shape.elements(), 0.0f);
    m.cpu_update.resize(shape.elements());
    ComputeTask c = HostTask(m, &muon_, 0, false);
    ASSERT_TRUE(cpu_->Compute({&c, 1}).ok());
    ComputeTask t = HostTask(m, &muon_, 9, true);
    t.grad = nullptr;
    t.update = nullptr;
    t.device_io = &io;
    bool nonfinite = true;
    t.nonfinite = &nonfinite;
    ASSERT_TRUE(gpu_->Compute({&t, 1}).ok());
    EXPECT_FALSE(nonfinite);
    *want = m.cpu_update;
  }

  std::unique_ptr<Executor> gpu_, cpu_;
  MuonParams muon_;
};

TEST_F(CudaExecutorTest, HostTasksMatchTheCpuExecutorOverSteps) {
  EXPECT_TRUE(gpu_->holds_state());
  std::vector<Matrix> ms(3);
  for (auto& m : ms) {
    m.shape = {96, 64};
    m.cpu_momentum.assign(m.shape.elements(), 0.0f);
    m.cpu_update.resize(m.shape.elements());
    m.gpu_update.resize(m.shape.elements());
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<ComputeTask> cpu, gpu;
    for (size_t i = 0; i < ms.size(); ++i) {
      ms[i].grad = Random(ms[i].shape.elements(), step * 10 + i);
      cpu.push_back(HostTask(ms[i], &muon_, static_cast<int>(i), false));
      gpu.push_back(HostTask(ms[i], &muon_, static_cast<int>(i), true));
    }
    ASSERT_TRUE(cpu_->Compute(cpu).ok());
    ASSERT_TRUE(gpu_->Compute(gpu).ok());
    for (auto& m : ms) {
      EXPECT_LT(RelError(m.gpu_update, m.cpu_update),
                UpdateBound(m.shape, muon_));
    }
  }
  // The device momentum is the CPU's (fp32, same lerp).
  for (size_t i = 0; i < ms.size(); ++i) {
    std::vector<float> mom(ms[i].shape.elements(), -1.0f);
    ASSERT_TRUE(
        gpu_->ReadState({7, static_cast<int>(i)}, absl::MakeSpan(mom)).ok());
    EXPECT_LT(RelError(mom, ms[i].cpu_momentum), 1e-6);
  }
  EXPECT_GT(gpu_->memory_bytes(), 3u * 96 * 64 * 4);
  EXPECT_TRUE(gpu_->healthy());
  // Three steps on one buffer pair: run, capture, replay. A failed capture
  // would fall back to eager launches (still correct, checked above).
  EXPECT_EQ(gpu_->graph_fallbacks(), 0u)
      << "a CUDA graph failed and its plan runs eagerly (the warning is in "
         "the log above)";
}

TEST_F(CudaExecutorTest, WriteStateReplacesAndDropJobForgets) {
  Matrix m;
  m.shape = {32, 48};
  m.grad = Random(m.shape.elements(), 1);
  m.gpu_update.resize(m.shape.elements());
  ComputeTask t = HostTask(m, &muon_, 0, true);
  ASSERT_TRUE(gpu_->Compute({&t, 1}).ok());
  const std::vector<float> set = Random(m.shape.elements(), 2);
  ASSERT_TRUE(gpu_->WriteState({7, 0}, absl::MakeConstSpan(set)).ok());
  std::vector<float> got(m.shape.elements(), 0.0f);
  ASSERT_TRUE(gpu_->ReadState({7, 0}, absl::MakeSpan(got)).ok());
  EXPECT_EQ(got, set);
  const uint64_t before = gpu_->memory_bytes();
  gpu_->DropJob(7);
  // The momentum and its step-start copy, and the job's NS plan.
  EXPECT_GT(before - gpu_->memory_bytes(), 2u * 32 * 48 * 4)
      << "DropJob frees the plans no other job uses";
  std::vector<float> untouched(m.shape.elements(), 5.0f);
  ASSERT_TRUE(gpu_->ReadState({7, 0}, absl::MakeSpan(untouched)).ok());
  EXPECT_EQ(untouched[0], 5.0f) << "a dropped state is gone";
  // A new state starts from the task's host momentum.
  std::vector<float> init = Random(m.shape.elements(), 3);
  t.momentum = init.data();
  ASSERT_TRUE(gpu_->Compute({&t, 1}).ok());
  m.cpu_momentum = init;
  m.cpu_update.resize(m.shape.elements());
  ComputeTask c = HostTask(m, &muon_, 0, false);
  ASSERT_TRUE(cpu_->Compute({&c, 1}).ok());
  ASSERT_TRUE(gpu_->ReadState({7, 0}, absl::MakeSpan(got)).ok());
  EXPECT_LT(RelError(got, m.cpu_momentum), 1e-6);
}

TEST_F(CudaExecutorTest, Bf16MomentumIsCloseButRounded) {
  CudaExecutorOptions o;
  o.bf16_momentum = true;
  auto e = NewCudaExecutor(0, o);
  ASSERT_TRUE(e.ok());
  Matrix m;
  m.shape = {64, 64};
  m.cpu_momentum.assign(m.shape.elements(), 0.0f);
  m.cpu_update.resize(m.shape.elements());
  m.gpu_update.resize(m.shape.elements());
  for (int step = 1; step <= 2; ++step) {
    m.grad = Random(m.shape.elements(), 40 + step);
    ComputeTask c = HostTask(m, &muon_, 0, false),
                g = HostTask(m, &muon_, 0, true);
    ASSERT_TRUE(cpu_->Compute({&c, 1}).ok());
    ASSERT_TRUE((*e)->Compute({&g, 1}).ok());
    // The momentum rounded to bf16 perturbs the NS input by a bf16 rounding.
    EXPECT_LT(RelError(m.gpu_update, m.cpu_update),
              UpdateBound(m.shape, muon_, kernels::cuda::DType::kBF16));
  }
  std::vector<float> mom(m.shape.elements());
  ASSERT_TRUE((*e)->ReadState({7, 0}, absl::MakeSpan(mom)).ok());
  const double err = RelError(mom, m.cpu_momentum);
  EXPECT_GT(err, 0.0) << "bf16 momentum changes the numbers";
  EXPECT_LT(err, 1e-2);
}

float* DeviceFloats(int64_t n) {
  void* p = nullptr;
  return cudaMalloc(&p, n * sizeof(float)) == cudaSuccess
             ? static_cast<float*>(p)
             : nullptr;
}

// Device buffers of the parts of one matrix.
struct DeviceMatrix {
  std::vector<float*> grads, updates;
  ~DeviceMatrix() {
    for (float* p : grads) cudaFree(p);
    for (float* p : updates) cudaFree(p);
  }
};

// A part on device 0 holding `elements` floats: its update buffer, and its
// gradient `g` uploaded (none when g is null: its rank declared the
// parameter absent). The buffers are d's.
DevicePart UploadPart(DeviceMatrix& d, const std::vector<float>* g,
                      int64_t elements) {
  DevicePart part;
  part.device = 0;
  float* up = DeviceFloats(std::max<int64_t>(elements, 1));
  EXPECT_TRUE(up != nullptr);
  d.updates.push_back(up);
  part.update = up;
  if (g != nullptr) {
    float* gp = DeviceFloats(std::max<int64_t>(elements, 1));
    EXPECT_TRUE(gp != nullptr);
    d.grads.push_back(gp);
    EXPECT_EQ(cudaMemcpy(gp, g->data(), elements * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    part.grad = gp;
  }
  return part;
}

TEST_F(CudaExecutorTest, DeviceIoGathersEveryShardingMode) {
  const kernels::Shape shape{40, 56};
  const int64_t n = shape.elements(), cols = shape.cols;
  const int ranks = 2;
  for (Gather mode : {Gather::kFirst, Gather::kRows, Gather::kMean}) {
    std::vector<std::vector<float>> g(ranks);
    DeviceMatrix d;
    DeviceIo io;
    io.gather = mode;
    for (int r = 0; r < ranks; ++r) {
      const int64_t rb = mode == Gather::kRows ? r * 20 : 0;
      const int64_t re = mode == Gather::kRows ? rb + 20 : shape.rows;
      g[r] = Random((re - rb) * cols, 100 + r);
      io.parts.push_back(UploadPart(d, &g[r], g[r].size()));
      io.parts.back().row_begin = rb;
      io.parts.back().row_end = re;
    }
    // The host gather, as the service does it.
    std::vector<float> grad(n, 0.0f);
    if (mode == Gather::kFirst) grad = g[0];
    if (mode == Gather::kRows) {
      for (int r = 0; r < ranks; ++r)
        std::copy(g[r].begin(), g[r].end(), grad.begin() + r * 20 * cols);
    }
    if (mode == Gather::kMean) {
      for (int r = 0; r < ranks; ++r)
        for (int64_t i = 0; i < n; ++i) grad[i] += g[r][i];
      for (float& x : grad) x *= 1.0f / ranks;
    }
    std::vector<float> want;
    ComputeBoth(shape, grad, io, &want);
    std::vector<float> got(n);
    for (int r = 0; r < ranks; ++r) {
      const int64_t off = mode == Gather::kRows ? r * 20 * cols : 0;
      ASSERT_EQ(cudaMemcpy(got.data() + off, d.updates[r], g[r].size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (mode != Gather::kRows) {
        EXPECT_LT(RelError(got, want), UpdateBound(shape, muon_))
            << static_cast<int>(mode);
      }
    }
    if (mode == Gather::kRows) {
      EXPECT_LT(RelError(got, want), UpdateBound(shape, muon_));
    }
  }
}

// SHARDING_UNREDUCED with ranks that declared the parameter absent: their
// parts have no gradient (null) and count as zeros in the mean, which still
// divides by every part; every part gets the update.
TEST_F(CudaExecutorTest, DeviceMeanCountsAbsentPartsAsZeros) {
  const kernels::Shape shape{40, 56};
  const int64_t n = shape.elements();
  const int ranks = 3;
  const std::vector<float> g = Random(n, 300);
  DeviceMatrix d;
  DeviceIo io;
  io.gather = Gather::kMean;
  for (int r = 0; r < ranks; ++r) {
    // Ranks 0 and 2 declared it absent.
    io.parts.push_back(UploadPart(d, r == 1 ? &g : nullptr, n));
    io.parts.back().row_end = shape.rows;
  }
  std::vector<float> mean = g;
  for (float& x : mean) x *= 1.0f / ranks;
  std::vector<float> want;
  ComputeBoth(shape, mean, io, &want);
  std::vector<float> got(n);
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(
        cudaMemcpy(got.data(), d.updates[r], n * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_LT(RelError(got, want), UpdateBound(shape, muon_)) << "rank " << r;
  }
}

// SHARDING_BLOCKS: a 2x2 mesh of uneven row and column blocks plus a
// replica of rank 0 that sends wrong values (the lowest rank's copy is the
// one used) and a rank holding nothing; each part gets exactly its
// elements of the update (ShardMap's host copies are the oracle, tested
// in shard_map_test).
TEST_F(CudaExecutorTest,
       DeviceBlocksTakeTheLowestRanksCopyAndReturnEachOnesElements) {
  const kernels::Shape shape{40, 56};
  auto map = [&](std::vector<IndexRun> r, std::vector<IndexRun> c) {
    return *ShardMap::FromRuns(r, c, shape, "p");
  };
  const std::vector<ShardMap> maps = {map({{0, 23}}, {{0, 31}}),
                                      map({{0, 23}}, {{31, 56}}),
                                      map({{23, 40}}, {{31, 56}, {0, 31}}),
                                      map({{0, 23}}, {{0, 31}}), map({}, {})};
  const std::vector<float> whole = Random(shape.elements(), 400);
  DeviceMatrix d;
  DeviceIo io;
  io.gather = Gather::kBlocks;
  std::vector<std::vector<float>> local(maps.size());
  for (size_t r = 0; r < maps.size(); ++r) {
    local[r].resize(maps[r].elements());
    GatherFromMatrix(maps[r], shape, whole.data(), local[r].data());
    if (r == 3)
      for (float& x : local[r]) x += 1000.0f;  // the replica's copy: unused
    io.parts.push_back(UploadPart(d, &local[r], maps[r].elements()));
    io.parts.back().map = maps[r];
  }
  std::vector<float> want;
  ComputeBoth(shape, whole, io, &want);
  for (size_t r = 0; r < maps.size(); ++r) {
    if (maps[r].empty()) continue;
    std::vector<float> got(maps[r].elements()), mine(maps[r].elements());
    ASSERT_EQ(cudaMemcpy(got.data(), d.updates[r], got.size() * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    GatherFromMatrix(maps[r], shape, want.data(), mine.data());
    EXPECT_LT(RelError(got, mine), UpdateBound(shape, muon_)) << "rank " << r;
  }
}

TEST_F(CudaExecutorTest, NonFiniteDeviceGradientSkipsOnlyThatTask) {
  const kernels::Shape shape{24, 32};
  const int64_t n = shape.elements();
  DeviceMatrix d;
  std::vector<DeviceIo> io(2);
  std::vector<std::vector<float>> g = {Random(n, 5), Random(n, 6)};
  g[1][17] = std::numeric_limits<float>::quiet_NaN();
  for (int i = 0; i < 2; ++i) {
    float* gp = DeviceFloats(n);
    float* up = DeviceFloats(n);
    ASSERT_TRUE(gp != nullptr && up != nullptr);
    d.grads.push_back(gp);
    d.updates.push_back(up);
    ASSERT_EQ(cudaMemcpy(gp, g[i].data(), n * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(up, 0xff, n * 4), cudaSuccess);
    // cudaMemset is asynchronous on the legacy stream, which the executor's
    // non-blocking stream does not wait for.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    io[i].parts.push_back({0, gp, up, 0, shape.rows, nullptr, {}});
  }
  const std::vector<float> init = Random(n, 9);
  bool bad[2] = {true, false};
  std::vector<ComputeTask> tasks(2);
  for (int i = 0; i < 2; ++i) {
    tasks[i].momentum = const_cast<float*>(init.data());
    tasks[i].shape = shape;
    tasks[i].muon = &muon_;
    tasks[i].state = {8, i};
    tasks[i].device_io = &io[i];
    tasks[i].nonfinite = &bad[i];
  }
  ASSERT_TRUE(gpu_->Compute(tasks).ok());
  EXPECT_FALSE(bad[0]);
  EXPECT_TRUE(bad[1]);
  std::vector<float> update(n), mom(n);
  ASSERT_EQ(
      cudaMemcpy(update.data(), d.updates[1], n * 4, cudaMemcpyDeviceToHost),
      cudaSuccess);
  for (float x : update) ASSERT_EQ(x, 0.0f) << "a skipped task's update is 0";
  ASSERT_TRUE(gpu_->ReadState({8, 1}, absl::MakeSpan(mom)).ok());
  EXPECT_EQ(mom, init) << "a skipped task's momentum is untouched";
  ASSERT_TRUE(gpu_->ReadState({8, 0}, absl::MakeSpan(mom)).ok());
  EXPECT_NE(mom, init);
}

TEST_F(CudaExecutorTest, OutOfMemoryFailsTheBatchThenRecovers) {
  std::vector<float> dummy(16);
  ComputeTask huge;
  huge.grad = dummy.data();  // never read: staging fails first
  huge.update = dummy.data();
  huge.shape = {1 << 18, 1 << 18};  // 256 GiB of fp32 staging
  huge.muon = &muon_;
  huge.state = {9, 0};
  const absl::Status st = gpu_->Compute({&huge, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st;
  EXPECT_FALSE(gpu_->healthy());
  EXPECT_FALSE(gpu_->last_error().empty());
  Matrix m;
  m.shape = {16, 16};
  m.grad = Random(m.shape.elements(), 11);
  m.gpu_update.resize(m.shape.elements());
  ComputeTask ok = HostTask(m, &muon_, 0, true);
  ASSERT_TRUE(gpu_->Compute({&ok, 1}).ok());
  EXPECT_TRUE(gpu_->healthy()) << "out of memory clears with a good batch";
}

TEST_F(CudaExecutorTest, FactoryResolvesSpecs) {
  auto one = NewCudaExecutors("cuda:0", {});
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0]->device(), "cuda:0");
  auto beyond = NewCudaExecutors("cuda:999", {});
  EXPECT_EQ(beyond.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NewCudaExecutors("gpu:0", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dmuon::server
