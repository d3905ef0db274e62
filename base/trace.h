// A step timeline recorder: events in Chrome's trace-event format (the
// JSON "traceEvents" array; opens in Perfetto and chrome://tracing).
//
//   TraceRecorder trace("dmuond");
//   trace.Start();                                   // off until started
//   const int64_t t0 = TraceNowNs();
//   ...work...
//   trace.Complete("gather", "step", t0, TraceNowNs(), {{"param", 3}});
//   std::string events = trace.TakeEventsJson(getpid(), false);  // emptied
//
// Clock: every timestamp is CLOCK_MONOTONIC in nanoseconds (TraceNowNs),
// the clock Python's time.monotonic_ns reads on Linux, so a trainer's and
// the daemon's events on one host line up when their files are merged.
// TraceClockJson records the wall-clock minus monotonic offset, from which
// files of different hosts can be aligned (to the hosts' clock sync).
//
// Cost: Record takes the calling thread's own buffer (found through a
// thread_local cache, its mutex uncontended but while a Take copies it out)
// and appends one event; nothing is formatted until a Take. Each thread
// buffers at most `max_events_per_thread` events between Takes; past it an
// event is dropped and counted (dropped(); the file says how many). When
// not enabled, Record returns after one relaxed atomic load.
//
// Thread-safe. A thread's buffer outlives the thread until its events are
// taken, then it is freed (its track's name is kept): threads that come and
// go (gRPC's) cost nothing once ended.

#ifndef DMUON_BASE_TRACE_H_
#define DMUON_BASE_TRACE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dmuon {

// CLOCK_MONOTONIC, nanoseconds: the clock of every trace event.
int64_t TraceNowNs();

// One event argument: an integer or a string.
struct TraceArg {
  TraceArg(const char* k, int64_t v) : key(k), i(v) {}
  TraceArg(const char* k, int v) : key(k), i(v) {}
  TraceArg(const char* k, std::string v)
      : key(k), s(std::move(v)), is_string(true) {}
  TraceArg(const char* k, const char* v) : key(k), s(v), is_string(true) {}
  const char* key;  // a string literal
  int64_t i = 0;
  std::string s;
  bool is_string = false;
};

struct TraceEvent {
  char phase = 'X';  // 'X': complete (ts, dur); 'i': instant (ts)
  std::string name;
  const char* category = "";  // a string literal
  int64_t ts_ns = 0;
  int64_t dur_ns = 0;
  int tid = 0;  // the recording thread's number in its recorder (from 1)
  std::vector<TraceArg> args;
};

class TraceRecorder {
 public:
  static constexpr size_t kDefaultMaxEventsPerThread = 1 << 16;

  // `process_name`: the process track's name in a viewer.
  explicit TraceRecorder(
      std::string process_name,
      size_t max_events_per_thread = kDefaultMaxEventsPerThread);
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // Recording is off until Start, and off again after Stop (what was
  // recorded stays until a Take).
  void Start() { enabled_.store(true, std::memory_order_relaxed); }
  void Stop() { enabled_.store(false, std::memory_order_relaxed); }
  // Start, unless recording already: false then (one window at a time).
  bool TryStart() {
    bool off = false;
    return enabled_.compare_exchange_strong(off, true);
  }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Appends `e` to the calling thread's buffer (its tid set here), or drops
  // and counts it when that buffer is full. Nothing when not enabled.
  void Record(TraceEvent e);
  // A complete event [start_ns, end_ns] of the calling thread.
  void Complete(std::string name, const char* category, int64_t start_ns,
                int64_t end_ns, std::initializer_list<TraceArg> args = {});
  // An instant event at now of the calling thread.
  void Instant(std::string name, const char* category,
               std::initializer_list<TraceArg> args = {});
  // The calling thread's track name (e.g. "executor 0 (cpu:0)"); kept
  // across Takes. Works whether or not recording is enabled.
  void NameThread(std::string name);

  // Buffers held: threads that recorded and have not ended, or whose
  // events were not taken yet.
  size_t buffers() const;
  // Events dropped since construction because a thread's buffer was full.
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  const std::string& process_name() const { return process_name_; }

  // Every buffered event, oldest first per thread; the buffers are emptied.
  std::vector<TraceEvent> TakeEvents();
  // TakeEvents as comma-separated JSON trace events (no brackets; empty
  // when there were none), preceded by the process and thread name metadata
  // events (MetadataJson) when `metadata`. `pid`: the process id the events
  // carry.
  std::string TakeEventsJson(int pid, bool metadata);
  // The process's and every thread's name as comma-separated metadata
  // events ("ph": "M"); nothing is taken.
  std::string MetadataJson(int pid);
  // A whole trace file: {"traceEvents": [...], "otherData": {...}} of the
  // events taken now (TakeEventsJson(pid, true)).
  std::string TakeFileJson(int pid);
  // The "otherData" object of a file: the clock (TraceClockJson), the
  // process name and dropped().
  std::string OtherDataJson() const;

 private:
  struct ThreadBuffer {
    absl::Mutex mu;
    std::vector<TraceEvent> events ABSL_GUARDED_BY(mu);
    int tid = 0;                     // fixed at creation
    std::atomic<bool> ended{false};  // its thread exited
  };
  // The calling thread's buffer in this recorder (made on first use).
  ThreadBuffer* Mine();

  const std::string process_name_;
  const size_t max_events_per_thread_;
  const uint64_t serial_;  // this recorder among all (thread caches' key)
  std::atomic<bool> enabled_{false};
  std::atomic<uint64_t> dropped_{0};
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<ThreadBuffer>> threads_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> names_ ABSL_GUARDED_BY(mu_);  // by tid, all ever
  int last_tid_ ABSL_GUARDED_BY(mu_) = 0;
};

// {"clock": "CLOCK_MONOTONIC", "wall_minus_monotonic_us": ...}'s members
// (no braces): what TakeFileJson writes in "otherData" to align files.
std::string TraceClockJson();

// JSON of one event, for `pid`. Exposed for the file writer and tests.
std::string TraceEventJson(const TraceEvent& e, int pid);

}  // namespace dmuon

#endif  // DMUON_BASE_TRACE_H_
