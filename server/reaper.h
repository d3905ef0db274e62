// The idle-job reaper's thread (the rules: docs/protocol.md "Idle jobs";
// the pass itself is OptimizerService::ReapIdleJobs, reaper.cc). No thread
// polls: a job's last close stores its drop time and kicks the reaper,
// which sleeps until the earliest drop time or the next kick.

#ifndef DMUON_SERVER_REAPER_H_
#define DMUON_SERVER_REAPER_H_

#include <chrono>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dmuon::server {

class Reaper {
 public:
  // A pass: drops what is due and returns when the next pass is due
  // (max(): only when kicked).
  using Pass = std::function<std::chrono::steady_clock::time_point()>;

  Reaper() = default;
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;
  ~Reaper() { Stop(); }

  // Starts the thread: a pass at once, then one whenever the last pass's
  // time comes or Kick is called. At most once.
  void Start(Pass pass) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs a pass soon (a job's last rank closed). Cheap; callable with any
  // of the service's locks held: the reaper's lock comes after them all.
  void Kick() ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the thread, waiting for a pass in progress. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop(const Pass& pass) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_REAPER_H_
