// dmuon C++ client: connects a trainer rank to dmuond.
//
//   auto client = dmuon::Client::Connect("127.0.0.1:50051");
//   auto session = (*client)->OpenSession(spec);           // the parameter
//   table for each step:
//     copy param i's gradient into session->gradient(i), then
//     session->GradientReady(i);                            // as backward
//     produces it session->WaitUpdate(i);  // update(i) = lr_scale *
//     NS(momentum step) W_i <- W_i * (1 - lr * wd) - lr * update(i) // the
//     trainer applies it session->FinishStep();
//
// Transports are picked automatically: shared memory when the daemon is on
// this host (gradients and updates are written in place), inline (bytes in
// the Step stream) otherwise or when shm cannot be mapped. Every call returns
// a Status carrying the daemon's message; nothing throws across this API.
// A Session is used by one trainer thread (its stream reader is internal).

#ifndef DMUON_CLIENT_CLIENT_H_
#define DMUON_CLIENT_CLIENT_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace grpc {
class ChannelCredentials;
}  // namespace grpc

namespace dmuon {

enum class Sharding { kReplicated, kRows, kUnreduced };
enum class TransportChoice { kAuto, kShm, kInline };

struct ParamSpec {
  std::string name;
  int64_t rows = 0, cols = 0;  // the whole matrix
  Sharding sharding = Sharding::kReplicated;
  int64_t row_begin = 0, row_end = 0;  // kRows: this rank's rows
  int forward_order = 0;               // smaller: needed earlier
  int group = 0;
};

// Muon hyperparameters (torch.optim.Muon's names and defaults). lr and weight
// decay stay with the trainer.
struct GroupSpec {
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  std::string schedule = "classic";  // classic | polar_express | you | custom
  std::vector<std::array<double, 3>> coefficients;  // custom
  std::string method = "direct";                    // direct | gram | auto
  std::string adjust_lr_fn = "original";  // original | match_rms_adamw
  double eps = 1e-7;
};

struct SessionSpec {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  std::vector<ParamSpec> params;
  std::vector<GroupSpec> groups;  // empty: one group of defaults
  TransportChoice transport = TransportChoice::kAuto;
};

struct ClientOptions {
  std::chrono::milliseconds deadline{10000};  // per call, and for waits
  int retries = 3;                            // UNAVAILABLE on idempotent calls
  std::chrono::milliseconds backoff{100};     // doubled per retry
  uint64_t max_message_bytes = 64ull << 20;
  // TLS or other credentials; null: insecure (loopback, trusted networks).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

// The daemon-held state of a job: enough to restore it onto any daemon.
struct State {
  int64_t completed_steps = 0;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> momentum;  // whole matrices, fp32
};

class Session {
 public:
  virtual ~Session() = default;
  // Where this rank writes parameter `i`'s gradient (its rows for kRows),
  // fp32 row-major, before GradientReady(i).
  virtual absl::Span<float> gradient(int i) = 0;
  // Parameter i's update for the current step; valid after WaitUpdate(i).
  virtual absl::Span<const float> update(int i) = 0;
  // The step being built (1 for a fresh job; later after a resume).
  virtual int64_t step() const = 0;
  virtual std::string transport() const = 0;  // "shm" | "inline"

  // Hands gradient i of the current step to the daemon. Non-blocking.
  virtual absl::Status GradientReady(int i) = 0;
  virtual absl::Status GradientsReady(absl::Span<const int> ids) = 0;
  // Blocks until update i of the current step is back (or the deadline, or
  // the stream fails: the Status names the daemon's address). A gradient the
  // daemon skipped (non-finite) returns OK with a zero update; skipped(i) says
  // so.
  virtual absl::Status WaitUpdate(int i) = 0;
  virtual bool TryUpdate(int i) = 0;
  virtual bool skipped(int i) const = 0;
  // Waits for every update of the current step, then moves to the next.
  virtual absl::Status FinishStep() = 0;

  virtual absl::StatusOr<State> GetState() = 0;
  virtual absl::Status SetState(const State& state) = 0;
  virtual absl::Status Close() = 0;
};

class Client {
 public:
  // Fails with UNAVAILABLE naming `address` if no daemon answers in time.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, ClientOptions options = {});
  // Several daemons as one pool (e.g. one per node). Each matrix goes to one
  // daemon by a plan every process computes alike from the same table: LPT
  // over the cost model's flops, then a swap refinement (server/planner.h).
  // A pool session is used exactly like a single daemon's.
  static absl::StatusOr<std::unique_ptr<Client>> ConnectPool(
      const std::vector<std::string>& addresses, ClientOptions options = {});
  // Which daemon (index into the pool's addresses) owns each parameter.
  static std::vector<int> PlanPool(const SessionSpec& spec, int daemons);

  virtual ~Client() = default;
  virtual absl::StatusOr<std::unique_ptr<Session>> OpenSession(
      const SessionSpec& spec) = 0;
  virtual const std::string& address() const = 0;
};

}  // namespace dmuon

#endif  // DMUON_CLIENT_CLIENT_H_
