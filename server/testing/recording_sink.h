// Test-only: a StepSink that records what the service sends a session, for
// tests that drive the service without sockets.

#ifndef DMUON_SERVER_TESTING_RECORDING_SINK_H_
#define DMUON_SERVER_TESTING_RECORDING_SINK_H_

#include <gtest/gtest.h>

#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/step_sink.h"

namespace dmuon::server::testing {

// Its lock is a leaf: the service calls it with a job's lock held.
class RecordingSink : public StepSink {
 public:
  void Send(v1::StepResponse m) override {
    absl::MutexLock l(&mu_);
    msgs_.push_back(std::move(m));
  }
  void Abort(absl::Status st) override {
    absl::MutexLock l(&mu_);
    aborted_ = true;
    abort_status_ = st;
  }
  absl::Status abort_status() {
    absl::MutexLock l(&mu_);
    return abort_status_;
  }
  // Everything received up to StepComplete(step), or up to an abort.
  std::vector<v1::StepResponse> WaitStep(int64_t step) {
    absl::MutexLock l(&mu_);
    std::vector<v1::StepResponse> out;
    auto more = [this] {
      mu_.AssertHeld();
      return !msgs_.empty() || aborted_;
    };
    for (;;) {
      while (!msgs_.empty()) {
        out.push_back(msgs_.front());
        msgs_.pop_front();
        if (out.back().has_step_complete() &&
            out.back().step_complete().step() == step) {
          return out;
        }
      }
      if (aborted_) return out;
      if (!mu_.AwaitWithTimeout(absl::Condition(&more), absl::Seconds(60))) {
        ADD_FAILURE() << "timed out waiting for step " << step;
        return out;
      }
    }
  }
  // Waits (without consuming anything) for updates_ready of `param` at
  // `step`; false on timeout or when the stream ended first.
  bool WaitUpdatesReady(int64_t step, int param) {
    absl::MutexLock l(&mu_);
    auto seen = [&] {
      mu_.AssertHeld();
      if (aborted_) return true;
      for (const auto& m : msgs_) {
        if (!m.has_updates_ready() || m.updates_ready().step() != step)
          continue;
        for (int id : m.updates_ready().param_ids())
          if (id == param) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), absl::Seconds(30)) &&
           !aborted_;
  }
  // Waits for the stream to be ended; false on timeout.
  bool WaitAbort(absl::Status* st) {
    absl::MutexLock l(&mu_);
    const bool ok =
        mu_.AwaitWithTimeout(absl::Condition(&aborted_), absl::Seconds(30));
    *st = abort_status_;
    return ok;
  }

 private:
  absl::Mutex mu_;
  std::deque<v1::StepResponse> msgs_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_RECORDING_SINK_H_
