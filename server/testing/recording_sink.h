// Test-only: a StepSink that records what the service sends a session, for
// tests that drive the service without sockets.

#ifndef DMUON_SERVER_TESTING_RECORDING_SINK_H_
#define DMUON_SERVER_TESTING_RECORDING_SINK_H_

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "server/service.h"

namespace dmuon::server::testing {

class RecordingSink : public StepSink {
 public:
  void Send(v1::StepResponse m) override {
    std::lock_guard<std::mutex> l(mu_);
    msgs_.push_back(std::move(m));
    cv_.notify_all();
  }
  void Abort(absl::Status st) override {
    std::lock_guard<std::mutex> l(mu_);
    aborted_ = true;
    abort_status_ = st;
    cv_.notify_all();
  }
  absl::Status abort_status() {
    std::lock_guard<std::mutex> l(mu_);
    return abort_status_;
  }
  // Everything received up to StepComplete(step), or up to an abort.
  std::vector<v1::StepResponse> WaitStep(int64_t step) {
    std::unique_lock<std::mutex> l(mu_);
    std::vector<v1::StepResponse> out;
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
      if (!cv_.wait_for(l, std::chrono::seconds(60),
                        [&] { return !msgs_.empty() || aborted_; })) {
        ADD_FAILURE() << "timed out waiting for step " << step;
        return out;
      }
    }
  }
  // Waits for the stream to be ended; false on timeout.
  bool WaitAbort(absl::Status* st) {
    std::unique_lock<std::mutex> l(mu_);
    const bool ok =
        cv_.wait_for(l, std::chrono::seconds(30), [&] { return aborted_; });
    *st = abort_status_;
    return ok;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::StepResponse> msgs_;
  bool aborted_ = false;
  absl::Status abort_status_;
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_RECORDING_SINK_H_
