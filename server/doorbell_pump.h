// A session's declarations through its doorbell (transport/doorbell.h,
// docs/protocol.md "Doorbell"): the words the client stores in its shm
// segment instead of sending gradients_ready and rewind, turned back into
// those Step messages so that the service checks and applies them exactly
// as it does the stream's. The words are the client's and untrusted: a
// word that makes no sense becomes a message the service refuses, naming
// the field, and the stream ends with that error.

#ifndef DMUON_SERVER_DOORBELL_PUMP_H_
#define DMUON_SERVER_DOORBELL_PUMP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/dmuon.pb.h"
#include "transport/doorbell.h"

namespace dmuon::server {

// The words last seen, by parameter, and the rewind word.
struct DeclarationsSeen {
  explicit DeclarationsSeen(int num_params) : words(num_params, 0) {}
  std::vector<uint64_t> words;
  uint64_t rewind = 0;
};

// What changed in `now` (the marked parameters' words) since `seen` (which
// it updates), as Step messages
// in the order the client made them: by step, ascending, one
// gradients_ready of the parameters declared without a momentum and those
// declared absent, then one of those declared with a momentum (their
// values in `momentum`); a new rewind goes after the declarations whose
// serial precedes its own and before the others, as the stream would have
// carried them (a declaration of the next step made before the rewind is
// then what the service refuses the rewind for). Steps are as the words
// say: 0 or one the job is not at is for the service to refuse.
std::vector<v1::StepRequest> NewDeclarations(
    const transport::Doorbell::Declarations& now, DeclarationsSeen* seen);

// Reads a doorbell on a thread of its own: at each move of its declare
// counter (and every 100 ms, for a wake it missed), it takes the marked
// declarations (Doorbell::Take: the words that changed, not all n), and
// what is new goes to `post` as NewDeclarations orders it. It loads again
// only once every message of its last load was Taken: the words and their
// marks are last-value state, so
// waiting loses nothing, and what waits for the service is one load's
// messages at most, however fast a client changes its words. A load that
// fails (the client cut the doorbell off: DATA_LOSS) goes to `post` as that
// error, and the pump stops. The destructor stops the thread and joins it;
// `post` is not called after it returns.
class DoorbellPump {
 public:
  using Post = std::function<void(absl::StatusOr<v1::StepRequest>)>;
  DoorbellPump(std::shared_ptr<transport::Doorbell> bell, Post post);
  ~DoorbellPump();
  DoorbellPump(const DoorbellPump&) = delete;
  DoorbellPump& operator=(const DoorbellPump&) = delete;

  // The caller handed one posted message on (to the service).
  void Taken();
  // Stops the thread, then loads once more on the caller's thread and
  // posts what is new (a client's last declarations before it half-closed
  // its stream). Once only; the pump is stopped after it.
  void StopAndFlush();

 private:
  void Run();
  void Stop();
  // One load, its messages counted and posted; false when the load failed
  // (the error posted).
  bool LoadAndPost();

  const std::shared_ptr<transport::Doorbell> bell_;
  const Post post_;
  DeclarationsSeen seen_;                  // the thread's, then StopAndFlush's
  transport::Doorbell::Declarations now_;  // likewise
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> outstanding_{0};  // posted, not yet Taken
  std::atomic<bool> waiting_for_taken_{false};
  std::thread thread_;  // last: started once the rest is set
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_DOORBELL_PUMP_H_
