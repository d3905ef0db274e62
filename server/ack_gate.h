// A step's step_complete to one rank, sent once everything it waits for has
// happened, in whatever order and on whatever threads those end. Over nccl
// (transport Region::Push) it waits for the rank's last update send to be
// posted and, on a --snapshot-every step, for that step's snapshot to be
// written: a client told a step is complete must find it in the snapshot
// after a crash, as on every other transport (param_work.cc, Deliver).
// Plain C++, tested on the CPU (ack_gate_test.cc).

#ifndef DMUON_SERVER_ACK_GATE_H_
#define DMUON_SERVER_ACK_GATE_H_

#include <atomic>
#include <functional>
#include <utility>

namespace dmuon::server {

class AckGate {
 public:
  // `send` runs once, on the thread of the `waits`-th Done (waits >= 1).
  AckGate(int waits, std::function<void()> send)
      : left_(waits), send_(std::move(send)) {}
  AckGate(const AckGate&) = delete;
  AckGate& operator=(const AckGate&) = delete;

  // One of the things waited for happened. A gate some of whose waits never
  // end (a failed transfer: the job breaks) never sends.
  void Done() {
    if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1) send_();
  }

 private:
  std::atomic<int> left_;
  const std::function<void()> send_;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_ACK_GATE_H_
