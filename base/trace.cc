// TraceRecorder (trace.h): per-thread bounded buffers, formatted as Chrome
// trace-event JSON only when taken.

#include "base/trace.h"

#include <time.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "nlohmann/json.hpp"

namespace dmuon {
namespace {

std::atomic<uint64_t> next_serial{1};

int64_t ClockNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Strings from peers (parameter names) may hold any bytes: invalid UTF-8
// is replaced, never thrown on.
std::string Dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::json Metadata(const char* what, int pid, int tid,
                        const std::string& name) {
  return {{"ph", "M"},
          {"name", what},
          {"pid", pid},
          {"tid", tid},
          {"args", {{"name", name}}}};
}

}  // namespace

int64_t TraceNowNs() { return ClockNs(CLOCK_MONOTONIC); }

std::string TraceClockJson() {
  // Read close together; the offset is good to a few microseconds.
  const int64_t mono = ClockNs(CLOCK_MONOTONIC);
  const int64_t wall = ClockNs(CLOCK_REALTIME);
  return "\"clock\":\"CLOCK_MONOTONIC\",\"wall_minus_monotonic_us\":" +
         std::to_string((wall - mono) / 1000);
}

std::string TraceEventJson(const TraceEvent& e, int pid) {
  nlohmann::json j = {{"ph", std::string(1, e.phase)},
                      {"name", e.name},
                      {"cat", e.category},
                      {"pid", pid},
                      {"tid", e.tid},
                      {"ts", static_cast<double>(e.ts_ns) / 1000.0}};
  if (e.phase == 'X') j["dur"] = static_cast<double>(e.dur_ns) / 1000.0;
  if (e.phase == 'i') j["s"] = "t";  // scoped to its thread
  if (!e.args.empty()) {
    nlohmann::json args = nlohmann::json::object();
    for (const TraceArg& a : e.args) {
      if (a.is_string) {
        args[a.key] = a.s;
      } else {
        args[a.key] = a.i;
      }
    }
    j["args"] = std::move(args);
  }
  return Dump(j);
}

TraceRecorder::TraceRecorder(std::string process_name,
                             size_t max_events_per_thread)
    : process_name_(std::move(process_name)),
      max_events_per_thread_(max_events_per_thread),
      serial_(next_serial.fetch_add(1)) {}

TraceRecorder::ThreadBuffer* TraceRecorder::Mine() {
  // (recorder serial, this thread's buffer in it). A serial is never
  // reused, so an entry of a destroyed recorder is never looked at again;
  // the cache keeps the last few recorders this thread used. Its buffers
  // are marked ended when the thread exits (or the entry is evicted: a
  // later record there makes a new one), and freed by the next Take.
  struct Cache {
    std::vector<std::pair<uint64_t, std::shared_ptr<ThreadBuffer>>> entries;
    ~Cache() {
      for (auto& e : entries) e.second->ended = true;
    }
  };
  thread_local Cache cache;
  for (const auto& [serial, buf] : cache.entries) {
    if (serial == serial_) return buf.get();
  }
  auto buf = std::make_shared<ThreadBuffer>();
  {
    absl::MutexLock lock(&mu_);
    threads_.push_back(buf);
    buf->tid = ++last_tid_;
    names_[buf->tid] = "thread " + std::to_string(buf->tid);
  }
  if (cache.entries.size() >= 8) {
    cache.entries.front().second->ended = true;
    cache.entries.erase(cache.entries.begin());
  }
  cache.entries.emplace_back(serial_, buf);
  return buf.get();
}

size_t TraceRecorder::buffers() const {
  absl::MutexLock lock(&mu_);
  return threads_.size();
}

void TraceRecorder::Record(TraceEvent e) {
  if (!enabled()) return;
  ThreadBuffer* t = Mine();
  e.tid = t->tid;
  absl::MutexLock lock(&t->mu);
  if (t->events.size() >= max_events_per_thread_) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  t->events.push_back(std::move(e));
}

void TraceRecorder::Complete(std::string name, const char* category,
                             int64_t start_ns, int64_t end_ns,
                             std::initializer_list<TraceArg> args) {
  if (!enabled()) return;
  TraceEvent e;
  e.name = std::move(name);
  e.category = category;
  e.ts_ns = start_ns;
  e.dur_ns = std::max<int64_t>(0, end_ns - start_ns);
  e.args = args;
  Record(std::move(e));
}

void TraceRecorder::Instant(std::string name, const char* category,
                            std::initializer_list<TraceArg> args) {
  if (!enabled()) return;
  TraceEvent e;
  e.phase = 'i';
  e.name = std::move(name);
  e.category = category;
  e.ts_ns = TraceNowNs();
  e.args = args;
  Record(std::move(e));
}

void TraceRecorder::NameThread(std::string name) {
  ThreadBuffer* t = Mine();
  absl::MutexLock lock(&mu_);
  names_[t->tid] = std::move(name);
}

std::vector<TraceEvent> TraceRecorder::TakeEvents() {
  std::vector<std::shared_ptr<ThreadBuffer>> threads;
  {
    absl::MutexLock lock(&mu_);
    threads = threads_;
  }
  std::vector<TraceEvent> out;
  bool any_ended = false;
  for (auto& t : threads) {
    std::vector<TraceEvent> events;
    {
      absl::MutexLock lock(&t->mu);
      events.swap(t->events);
    }
    std::move(events.begin(), events.end(), std::back_inserter(out));
    any_ended = any_ended || t->ended;
  }
  if (any_ended) {
    // An ended thread records no more: its buffer goes once empty (one
    // that recorded after the swap above and then ended waits for the
    // next Take).
    absl::MutexLock lock(&mu_);
    threads_.erase(std::remove_if(threads_.begin(), threads_.end(),
                                  [](const std::shared_ptr<ThreadBuffer>& t) {
                                    if (!t->ended) return false;
                                    absl::MutexLock buffer_lock(&t->mu);
                                    return t->events.empty();
                                  }),
                   threads_.end());
  }
  return out;
}

std::string TraceRecorder::TakeEventsJson(int pid, bool metadata) {
  std::string out = metadata ? MetadataJson(pid) : std::string();
  for (const TraceEvent& e : TakeEvents()) {
    if (!out.empty()) out += ",\n";
    out += TraceEventJson(e, pid);
  }
  return out;
}

std::string TraceRecorder::MetadataJson(int pid) {
  std::string out = Dump(Metadata("process_name", pid, 0, process_name_));
  absl::MutexLock lock(&mu_);
  for (const auto& [tid, name] : names_)
    out += ",\n" + Dump(Metadata("thread_name", pid, tid, name));
  return out;
}

std::string TraceRecorder::TakeFileJson(int pid) {
  std::string events = TakeEventsJson(pid, /*metadata=*/true);
  return "{\"traceEvents\":[\n" + events +
         "\n],\n\"otherData\":" + OtherDataJson() + "}\n";
}

std::string TraceRecorder::OtherDataJson() const {
  return "{" + TraceClockJson() + ",\"process\":" + Dump(process_name_) +
         ",\"dropped_events\":" + std::to_string(dropped()) + "}";
}

}  // namespace dmuon
