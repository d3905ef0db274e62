#include "daemon/trace_file.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "base/trace.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dmuon::server {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string TempPath(const char* name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

// Events recorded before, between and after flushes all land in the file,
// which parses as one trace with the thread names and the footer.
TEST(TraceFileTest, StreamsEventsAndEndsTheFile) {
  const std::string path = TempPath("trace.json");
  TraceRecorder trace("dmuond");
  auto file = TraceFile::Open(path, &trace, std::chrono::milliseconds(5));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(trace.enabled());
  int recorded = 0;
  std::thread worker([&] {
    trace.NameThread("executor 0");
    for (int k = 0; k < 30; ++k, ++recorded) {
      const int64_t t0 = TraceNowNs();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      trace.Complete("ns", "step", t0, TraceNowNs(), {{"k", k}});
    }
  });
  worker.join();
  // Flushed while still open: a whole trace of the events so far.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  nlohmann::json partial = nlohmann::json::parse(Read(path));
  int flushed = 0;
  for (const auto& e : partial["traceEvents"]) flushed += e["ph"] == "X";
  EXPECT_EQ(flushed, recorded);
  EXPECT_EQ(partial["otherData"]["process"], "dmuond");
  ASSERT_TRUE((*file)->Close().ok());
  EXPECT_FALSE(trace.enabled());
  EXPECT_TRUE((*file)->Close().ok());  // idempotent
  nlohmann::json j = nlohmann::json::parse(Read(path));
  int ns = 0, k_expected = 0;
  bool named = false;
  for (const auto& e : j["traceEvents"]) {
    EXPECT_EQ(e["pid"], getpid());
    if (e["ph"] == "X") {
      EXPECT_EQ(e["args"]["k"], k_expected++);  // in order, none lost
      ++ns;
    }
    if (e["ph"] == "M" && e["name"] == "thread_name" &&
        e["args"]["name"] == "executor 0")
      named = true;
  }
  EXPECT_EQ(ns, recorded);
  EXPECT_TRUE(named);
  EXPECT_EQ(j["otherData"]["process"], "dmuond");
  EXPECT_EQ(j["otherData"]["clock"], "CLOCK_MONOTONIC");
  EXPECT_EQ(j["otherData"]["dropped_events"], 0);
}

TEST(TraceFileTest, UnwritablePathNamesTheFlag) {
  TraceRecorder trace("dmuond");
  for (const std::string& path :
       {TempPath("no/such/dir/trace.json"), TempPath(""), std::string()}) {
    auto file = TraceFile::Open(path, &trace);
    ASSERT_FALSE(file.ok()) << path;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(file.status().message().find("--trace-file"), std::string::npos)
        << file.status();
    EXPECT_FALSE(trace.enabled());
  }
}

}  // namespace
}  // namespace dmuon::server
