#include "base/trace.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dmuon {
namespace {

using nlohmann::json;

json ParseFile(TraceRecorder& r) {
  return json::parse(r.TakeFileJson(getpid()));
}

TEST(TraceTest, ClockIsMonotonicNanoseconds) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const int64_t before =
      static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  const int64_t now = TraceNowNs();
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const int64_t after =
      static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  EXPECT_LE(before, now);
  EXPECT_LE(now, after);
}

TEST(TraceTest, NothingRecordedUntilStartedOrAfterStop) {
  TraceRecorder r("p");
  r.Instant("before", "c");
  r.Start();
  r.Instant("during", "c");
  r.Stop();
  r.Complete("after", "c", 1, 2);
  std::vector<TraceEvent> events = r.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].name, "during");
  EXPECT_TRUE(r.TakeEvents().empty());  // taken: the buffers are empty
}

TEST(TraceTest, FullBufferDropsAndCounts) {
  std::mt19937 rng(std::random_device{}());
  const size_t cap = 1 + rng() % 50, extra = 1 + rng() % 50;
  TraceRecorder r("p", cap);
  r.Start();
  for (size_t i = 0; i < cap + extra; ++i)
    r.Complete("e" + std::to_string(i), "c", i, i + 1);
  EXPECT_EQ(r.dropped(), extra);
  json file = ParseFile(r);
  EXPECT_EQ(file["otherData"]["dropped_events"], extra);
  std::vector<std::string> names;
  for (const auto& e : file["traceEvents"])
    if (e["ph"] == "X") names.push_back(e["name"]);
  ASSERT_EQ(names.size(), cap);  // the first `cap`: the later ones dropped
  for (size_t i = 0; i < cap; ++i) EXPECT_EQ(names[i], "e" + std::to_string(i));
  // Taken: room again.
  r.Instant("again", "c");
  EXPECT_EQ(r.TakeEvents().size(), 1u);
  EXPECT_EQ(r.dropped(), extra);
}

// Threads record nested spans at random; the file is valid JSON whose
// events carry each thread's tid and name, in each thread's order, nested
// (a child within its parent) and in microseconds of the one clock.
TEST(TraceTest, ThreadsNestedAndOrderedInValidJson) {
  TraceRecorder r("daemon \"x\"");
  r.Start();
  const int threads = 4, spans = 200;
  const int64_t t_begin = TraceNowNs();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&r, t] {
      r.NameThread("worker " + std::to_string(t));
      for (int k = 0; k < spans; ++k) {
        const int64_t outer = TraceNowNs();
        const int64_t inner = TraceNowNs();
        r.Instant("tick", "c", {{"k", k}});
        r.Complete("inner", "c", inner, TraceNowNs(),
                   {{"thread", t}, {"name", "p\xff"}});  // bad UTF-8 is kept
        r.Complete("outer", "c", outer, TraceNowNs(), {{"k", k}});
      }
    });
  }
  for (auto& t : ts) t.join();
  const int64_t t_end = TraceNowNs();
  json file = ParseFile(r);
  EXPECT_EQ(file["otherData"]["clock"], "CLOCK_MONOTONIC");
  EXPECT_TRUE(file["otherData"]["wall_minus_monotonic_us"].is_number());
  std::map<int, std::string> names;
  std::map<int, std::vector<json>> by_tid;
  std::string process;
  for (const auto& e : file["traceEvents"]) {
    EXPECT_EQ(e["pid"], getpid());
    if (e["ph"] == "M" && e["name"] == "thread_name")
      names[e["tid"]] = e["args"]["name"];
    else if (e["ph"] == "M" && e["name"] == "process_name")
      process = e["args"]["name"];
    else
      by_tid[e["tid"]].push_back(e);
  }
  EXPECT_EQ(process, "daemon \"x\"");
  ASSERT_EQ(by_tid.size(), static_cast<size_t>(threads));
  for (auto& [tid, events] : by_tid) {
    ASSERT_EQ(events.size(), 3u * spans);
    const int t = events[1]["args"]["thread"];
    EXPECT_EQ(names[tid], "worker " + std::to_string(t));
    for (int k = 0; k < spans; ++k) {
      const json& tick = events[3 * k];
      const json& inner = events[3 * k + 1];
      const json& outer = events[3 * k + 2];
      EXPECT_EQ(tick["ph"], "i");
      EXPECT_EQ(outer["args"]["k"], k);
      const double in0 = inner["ts"], in1 = in0 + inner["dur"].get<double>();
      const double out0 = outer["ts"], out1 = out0 + outer["dur"].get<double>();
      EXPECT_LE(out0, in0);
      EXPECT_LE(in1, out1 + 1e-3);  // rounding to the nanosecond
      EXPECT_LE(in0, tick["ts"].get<double>());
      EXPECT_GE(out0, t_begin / 1000.0);
      EXPECT_LE(out1, t_end / 1000.0 + 1e-3);
      if (k > 0) {
        const json& prev = events[3 * (k - 1) + 2];
        EXPECT_LE(prev["ts"].get<double>() + prev["dur"].get<double>(),
                  out0 + 1e-3);
      }
    }
  }
}

TEST(TraceTest, TwoRecordersOnOneThreadKeepTheirOwnEvents) {
  for (int round = 0; round < 20; ++round) {  // past the thread cache's size
    TraceRecorder a("a"), b("b");
    a.Start();
    b.Start();
    a.Instant("in a", "c");
    b.Instant("in b", "c");
    b.Instant("in b", "c");
    EXPECT_EQ(a.TakeEvents().size(), 1u);
    EXPECT_EQ(b.TakeEvents().size(), 2u);
  }
}

// Threads that come and go (gRPC's): each ended thread's buffer is freed
// by the Take after its events, its track's name kept; none of its events
// is lost, whenever it ended.
TEST(TraceTest, EndedThreadsBuffersAreFreedAndNamesKept) {
  TraceRecorder r("p");
  r.Start();
  const int n = 100;
  std::vector<TraceEvent> taken;
  for (int k = 0; k < n; ++k) {
    std::thread([&r, k] {
      r.NameThread("short " + std::to_string(k));
      r.Instant("e", "c", {{"k", k}});
    }).join();
    if (k % 7 == 0) {  // Takes in between, too
      for (auto& e : r.TakeEvents()) taken.push_back(std::move(e));
    }
  }
  for (auto& e : r.TakeEvents()) taken.push_back(std::move(e));
  EXPECT_EQ(taken.size(), static_cast<size_t>(n));
  EXPECT_EQ(r.buffers(), 0u);
  json file = ParseFile(r);
  int named = 0;
  for (const auto& e : file["traceEvents"])
    named += e["ph"] == "M" && e["name"] == "thread_name";
  EXPECT_EQ(named, n);
  std::vector<int> tids;
  for (const auto& e : taken) tids.push_back(e.tid);
  std::sort(tids.begin(), tids.end());
  EXPECT_EQ(std::unique(tids.begin(), tids.end()), tids.end());  // a track each
}

TEST(TraceTest, EmptyTraceIsValidJson) {
  TraceRecorder r("p");
  json file = ParseFile(r);
  ASSERT_EQ(file["traceEvents"].size(), 1u);  // the process name
  EXPECT_EQ(file["otherData"]["dropped_events"], 0);
}

}  // namespace
}  // namespace dmuon
