// OptimizerService::CaptureTrace: a window of the step timeline (the Trace
// RPC), with the stages server/step_trace.h records for every matrix.

#include <unistd.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/testing/service_harness.h"

namespace dmuon::server {
namespace {

using testing::NewService;
using testing::Param;
using testing::Rank;
using testing::Request;

const auto kNever = [] { return false; };

TEST(ServiceTraceTest, WindowOutOfRangeNamesTheField) {
  TraceRecorder trace("dmuond");
  ServiceOptions o;
  o.trace = &trace;
  auto svc = NewService(o);
  for (double s : {0.0, -1.0, 601.0, std::nan("")}) {
    auto got = svc->CaptureTrace(s, kNever);
    ASSERT_FALSE(got.ok()) << s;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find("TraceRequest.seconds"),
              std::string::npos);
  }
  EXPECT_FALSE(trace.enabled());
}

TEST(ServiceTraceTest, RefusedWhenRecordingAlreadyOrWithoutRecorder) {
  auto bare = NewService();
  EXPECT_EQ(bare->CaptureTrace(0.01, kNever).status().code(),
            absl::StatusCode::kFailedPrecondition);
  TraceRecorder trace("dmuond");
  ServiceOptions o;
  o.trace = &trace;
  auto svc = NewService(o);
  trace.Start();  // as --trace-file does
  auto got = svc->CaptureTrace(0.01, kNever);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(got.status().message().find("--trace-file"), std::string::npos);
  EXPECT_TRUE(trace.enabled());  // left as it was
  trace.Stop();
  EXPECT_TRUE(svc->CaptureTrace(0.01, kNever).ok());
  EXPECT_FALSE(trace.enabled());
  EXPECT_EQ(svc->CaptureTrace(10, [] { return true; }).status().code(),
            absl::StatusCode::kCancelled);
}

// Steps run during the window: every matrix of every step has received,
// queued, gather, ns and return, in that order, with its name and shape,
// and the executor's track is named.
TEST(ServiceTraceTest, EveryMatrixOfEveryStepInTheWindow) {
  TraceRecorder trace("dmuond");
  ServiceOptions o;
  o.trace = &trace;
  auto svc = NewService(o);
  std::mt19937 rng(std::random_device{}());
  std::vector<Param> params;
  const int n = 2 + rng() % 4;
  for (int i = 0; i < n; ++i) {
    const int64_t rows = 4 + static_cast<int64_t>(rng() % 12);
    const int64_t cols = 4 + static_cast<int64_t>(rng() % 12);
    params.push_back(
        {"w" + std::to_string(i), rows, cols, v1::SHARDING_REPLICATED});
  }
  Rank rank;
  ASSERT_TRUE(
      rank.Open(*svc, Request("job", 0, 1, v1::TRANSPORT_INLINE, params)).ok());
  absl::StatusOr<std::string> file;
  std::thread capture([&] { file = svc->CaptureTrace(2.0, kNever); });
  while (!trace.enabled()) std::this_thread::yield();
  const int64_t t0 = TraceNowNs();
  const int steps = 3;
  std::normal_distribution<float> d;
  for (int step = 1; step <= steps; ++step) {
    std::vector<std::vector<float>> grads;
    for (const Param& p : params) {
      grads.emplace_back(p.rows * p.cols);
      for (float& x : grads.back()) x = d(rng);
    }
    ASSERT_TRUE(rank.Send(*svc, step, grads).ok());
    ASSERT_TRUE(rank.sink->WaitStep(step).back().has_step_complete());
  }
  ASSERT_LT(TraceNowNs() - t0, 1'500'000'000) << "steps slower than the window";
  capture.join();
  ASSERT_TRUE(file.ok()) << file.status();
  const nlohmann::json doc = nlohmann::json::parse(*file);
  const std::vector<std::string> order = {"received", "queued", "gather", "ns",
                                          "return"};
  // (step, param) -> stage -> event
  std::map<std::pair<int, int>, std::map<std::string, nlohmann::json>> seen;
  bool executor_named = false;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], getpid());
    if (e["ph"] == "M" && e["name"] == "thread_name")
      executor_named |=
          e["args"]["name"].get<std::string>().rfind("executor ", 0) == 0;
    if (e["ph"] != "X" && e["ph"] != "i") continue;
    const auto& a = e["args"];
    EXPECT_EQ(a["job"], "job");
    const int param = a["param"];
    EXPECT_EQ(a["name"], params[param].name);
    EXPECT_EQ(a["shape"], std::to_string(params[param].rows) + "x" +
                              std::to_string(params[param].cols));
    EXPECT_EQ(e["name"],
              a["stage"].get<std::string>() + " " + params[param].name);
    auto& stages = seen[{a["step"].get<int>(), param}];
    EXPECT_EQ(stages.count(a["stage"]), 0u) << e;
    stages[a["stage"]] = e;
  }
  EXPECT_TRUE(executor_named);
  ASSERT_EQ(seen.size(), static_cast<size_t>(steps * n));
  for (auto& [key, stages] : seen) {
    ASSERT_EQ(stages.size(), order.size()) << key.first << " " << key.second;
    double last = 0;
    for (const std::string& s : order) {
      const double ts = stages[s]["ts"];
      EXPECT_LE(last, ts) << s;
      last = ts +
             (stages[s].contains("dur") ? stages[s]["dur"].get<double>() : 0.0);
    }
    EXPECT_GT(stages["ns"]["dur"].get<double>(), 0);
    EXPECT_EQ(stages["ns"]["args"]["batch_size"].get<int>() >= 1, true);
  }
  EXPECT_TRUE(svc->CloseSession(rank.open.session_id()).ok());
}

}  // namespace
}  // namespace dmuon::server
