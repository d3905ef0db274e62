#include "kernels/autotune.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/kernels.h"

namespace dmuon::kernels {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name + "." +
         std::to_string(::getpid());
}

TuneKey Key() {
  TuneKey k;
  k.device = "test";
  k.shape = {64, 256};
  k.schedule = "classic/5";
  return k;
}

TEST(Autotuner, PicksFastestAccurateAndCachesOnDisk) {
  const std::string path = TempPath("tune.json");
  std::remove(path.c_str());
  int calls = 0;
  auto fake = [&](Method m) -> absl::StatusOr<Measurement> {
    ++calls;
    return Measurement{m == Method::kGram ? 1.0 : 2.0, 1e-6};
  };
  {
    Autotuner t(path);
    EXPECT_EQ(t.load_status().code(), absl::StatusCode::kNotFound);
    auto r = t.Choose(Key(), fake, 1e-3);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->method, Method::kGram);
    EXPECT_FALSE(r->from_cache);
    EXPECT_EQ(calls, 2);
  }
  Autotuner again(path);  // a new process would see the same file
  ASSERT_TRUE(again.load_status().ok()) << again.load_status();
  auto r = again.Choose(Key(), fake, 1e-3);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->from_cache);
  EXPECT_EQ(r->method, Method::kGram);
  EXPECT_DOUBLE_EQ(r->candidates.at("direct").seconds, 2.0);
  EXPECT_EQ(calls, 2) << "cached choice must not be re-measured";
  TuneKey other = Key();
  other.batch = 4;
  EXPECT_FALSE(again.Lookup(other).has_value());
}

TEST(Autotuner, InaccurateCandidateLoses) {
  Autotuner t("");
  auto r = t.Choose(
      Key(),
      [](Method m) -> absl::StatusOr<Measurement> {
        return Measurement{m == Method::kGram ? 1.0 : 2.0,
                           m == Method::kGram ? 0.5 : 1e-6};
      },
      1e-3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->method, Method::kDirect);
}

TEST(Autotuner, FailingCandidateExcludedAllFailingIsError) {
  Autotuner t("");
  auto r = t.Choose(
      Key(),
      [](Method m) -> absl::StatusOr<Measurement> {
        if (m == Method::kDirect) return absl::InternalError("boom");
        return Measurement{1.0, 0.0};
      },
      1e-3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->method, Method::kGram);
  TuneKey k = Key();
  k.device = "other";
  auto bad = t.Choose(
      k,
      [](Method) -> absl::StatusOr<Measurement> {
        return absl::InternalError("no device");
      },
      1e-3);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
}

TEST(Autotuner, CorruptCacheIsIgnored) {
  const std::string path = TempPath("corrupt.json");
  std::ofstream(path) << "{not json";
  Autotuner t(path);
  EXPECT_EQ(t.load_status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(t.Lookup(Key()).has_value());
  std::ofstream(path) << R"({"version":1,"entries":{"k":{"method":"warp"}}})";
  Autotuner t2(path);
  EXPECT_TRUE(t2.load_status().ok());
}

TEST(Autotuner, CpuMeasureRealKernels) {
  NsOptions o;
  auto measure = CpuMeasure({32, 128}, 2, o, 1);
  for (Method m : {Method::kDirect, Method::kGram}) {
    auto got = measure(m);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_GT(got->seconds, 0);
    EXPECT_LT(got->error, 1e-4) << MethodName(m);
  }
  Autotuner t("");
  TuneKey k = Key();
  k.device = CpuDeviceName();
  auto r = t.Choose(k, measure, 1e-3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->candidates.size(), 2u);
}

// The key names the threads the kernels will run with, not the machine's
// cores: a daemon given one core must not reuse a choice timed on two.
TEST(CpuDeviceName, NamesTheBlasThreadsInUse) {
  const int before = CpuThreads();
  SetCpuThreads(1);
  EXPECT_EQ(CpuDeviceName(), "cpu:1t");
  SetCpuThreads(before);
  EXPECT_EQ(CpuDeviceName(), absl::StrCat("cpu:", before, "t"));
}

}  // namespace
}  // namespace dmuon::kernels
