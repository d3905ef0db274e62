// A thread that runs a pass whenever the pass's own deadline comes or it is
// kicked: the service's idle-job reaper (OptimizerService::StartReaper,
// service_reap.cc) and its expiry of unattached sessions. No thread polls:
// whoever changes a deadline kicks, and the thread sleeps until the
// earliest deadline the last pass returned or the next kick. It knows
// nothing of what the pass does.

#ifndef DMUON_SERVER_DEADLINE_THREAD_H_
#define DMUON_SERVER_DEADLINE_THREAD_H_

#include <chrono>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dmuon::server {

// A steady_clock time as an absl deadline (absl::Mutex waits on absl::Time).
// min() and past times are already due; max() never is.
absl::Time DeadlineOf(std::chrono::steady_clock::time_point t);

class DeadlineThread {
 public:
  // A pass: does what is due and returns when the next pass is due (max():
  // only when kicked).
  using Pass = std::function<std::chrono::steady_clock::time_point()>;

  DeadlineThread() = default;
  DeadlineThread(const DeadlineThread&) = delete;
  DeadlineThread& operator=(const DeadlineThread&) = delete;
  ~DeadlineThread() { Stop(); }

  // Starts the thread: a pass at once, then one whenever the last pass's
  // time comes or Kick is called. At most once.
  void Start(Pass pass) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs a pass soon. Cheap; callable with any of the service's locks held:
  // this lock comes after them all.
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

#endif  // DMUON_SERVER_DEADLINE_THREAD_H_
