// The order a cuda_ipc session ends in, in plain C++ (no CUDA; tested on the
// CPU): the daemon maps the GPU memory the trainer exported until it has
// released the session's region, so the trainer frees that memory only
// after the daemon confirmed the release (Session::region_released()):
//
//   close the session -> the daemon ends every computation using the region
//   and closes its IPC mapping -> CloseSession answers region_released ->
//   the trainer frees the memory.
//
// A ReleaseGate is shared by the memory's owner (DeviceRegion) and the
// session opened over it (GuardSession). Freeing goes through
// FreeWhenReleased, which keeps the memory (the driver frees it when the
// process exits) rather than free it while the daemon may still map it.

#ifndef DMUON_CLIENT_CUDA_RELEASE_GATE_H_
#define DMUON_CLIENT_CUDA_RELEASE_GATE_H_

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "client/client.h"

namespace dmuon::gpu {

// Thread-safe.
class ReleaseGate {
 public:
  // The memory is about to be exported to a daemon (OpenSession).
  void Exported();
  // That OpenSession failed with `status`: a daemon's answer means it keeps
  // no mapping (it unmaps before answering an error); DEADLINE_EXCEEDED,
  // CANCELLED or UNKNOWN leave it open whether the daemon opened the session
  // and maps the memory, so the memory stays held.
  void OpenFailed(const absl::Status& status);
  // A session over the memory opened (GuardSession calls it).
  void Opened();
  // The session opened over the memory was closed; `released`: the daemon
  // confirmed it released the region (Session::region_released()).
  void Closed(bool released);

  // Whether the memory may be freed: never exported, refused at
  // OpenSession, or closed with the daemon's confirmation.
  bool may_free() const;
  // Why not, when may_free() is false.
  std::string why_not() const;

 private:
  enum class State { kIdle, kExported, kUnknown, kOpen, kReleased, kHeld };
  mutable std::mutex mu_;
  State state_ = State::kIdle;
};

// `inner` (a session whose region is the gate's memory) whose Close() — and
// destructor — closes `inner` and then tells `gate` whether the daemon
// released the region. Call gate->Exported() before opening `inner`.
std::unique_ptr<Session> GuardSession(std::unique_ptr<Session> inner,
                                      std::shared_ptr<ReleaseGate> gate);

// Runs `free` when gate.may_free(); otherwise keeps the memory and returns
// FAILED_PRECONDITION saying why (nothing is freed under the daemon).
absl::Status FreeWhenReleased(const ReleaseGate& gate,
                              const std::function<absl::Status()>& free);

}  // namespace dmuon::gpu

#endif  // DMUON_CLIENT_CUDA_RELEASE_GATE_H_
