// Fuzzes the shm doorbell's declare side (docs/protocol.md "Doorbell") as a
// hostile client could drive it: any bytes in its doorbell area (words,
// momenta, marks, counters), well-formed declarations and rewinds among
// them, gradients of any bits, and a segment cut short, read by dmuond's
// side exactly as the daemon reads it (Doorbell::Take, NewDeclarations,
// then OptimizerService::OnStepRequest in order, the stream ending at the
// first refusal) on the real service with a FastExecutor. Any crash,
// SIGBUS, sanitizer report or leak is a bug; refusals are expected.
//
// Input: records of [op: 1 byte][length: 2 bytes LE][payload] (see Op).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "proto/dmuon.pb.h"
#include "server/doorbell_pump.h"
#include "server/fuzz/fuzz_support.h"
#include "server/service.h"
#include "server/testing/open_request.h"
#include "transport/doorbell.h"
#include "transport/transport.h"

namespace dmuon::server::fuzz {
namespace {

enum Op : uint8_t {
  kBytes = 0,     // payload[0..1] LE: an offset into the area; the rest is
                  // written there (clipped to the area)
  kDeclare = 1,   // payload: param, step delta, flags, momentum byte: a
                  // well-formed declaration (Declare, its mark) of the
                  // step StepAt(delta)
  kRewind = 2,    // payload[0]: step delta, as kDeclare
  kGradient = 3,  // payload[0..1] LE: an offset into the tensors; the rest
                  // is written there (clipped)
  kTake = 4,      // dmuond's pump: one take, its messages to the service
  kCut = 5,       // payload[0..1] LE: the segment cut to that many pages
                  // (truncated under dmuond's mapping)
  kOps = 6,
};

// Keeps the last step_complete, so that well-formed inputs go on to the
// next step as a client would: after it.
class CompletionSink final : public StepSink {
 public:
  void Send(v1::StepResponse r) override {
    if (!r.has_step_complete()) return;
    absl::MutexLock l(&mu_);
    done_ = std::max(done_, r.step_complete().step());
  }
  void Abort(absl::Status) override {
    absl::MutexLock l(&mu_);
    aborted_ = true;
  }
  // Waits (up to 2 s: the executor does no Newton–Schulz) for `step`.
  bool WaitComplete(int64_t step) {
    absl::MutexLock l(&mu_);
    auto done = [&] {
      mu_.AssertHeld();
      return done_ >= step || aborted_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(2));
    return done_ >= step;
  }

 private:
  absl::Mutex mu_;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

uint16_t Le16(const uint8_t* p, size_t n) {
  return n >= 2 ? static_cast<uint16_t>(p[0] | (p[1] << 8)) : 0;
}

// One session with a doorbell, its client mapping, and dmuond's reader.
class Fixture {
 public:
  explicit Fixture(OptimizerService& svc) : svc_(svc) {
    auto req = testing::OpenRequest("fuzz", 0, 1, v1::TRANSPORT_SHM,
                                    {{"a", 4, 3, v1::SHARDING_REPLICATED},
                                     {"b", 2, 5, v1::SHARDING_REPLICATED},
                                     {"c", 3, 3, v1::SHARDING_REPLICATED}});
    req.set_doorbell(true);
    req.set_doorbell_waiters(true);  // its count at 32 is kBytes' to write
    auto open = svc_.OpenSession(req);
    if (!open.ok() || !open->has_doorbell()) return;
    open_ = std::move(*open);
    const size_t end = open_.doorbell().offset() + open_.doorbell().bytes();
    auto client = transport::OpenShmRegion(open_.shm_name(), end);
    if (!client.ok()) return;
    client_ = std::move(*client);
    // Attach unlinks the name: the descriptor is kCut's.
    fd_ = ::shm_open(open_.shm_name().c_str(), O_RDWR, 0);
    if (fd_ < 0) return;
    if (!svc_.Attach(open_.session_id(), sink_, &bell_).ok() ||
        bell_ == nullptr) {
      return;
    }
    seen_ = std::make_unique<DeclarationsSeen>(bell_->num_params());
    live_ = true;
  }
  ~Fixture() {
    if (fd_ >= 0) ::close(fd_);
    if (open_.session_id().empty()) return;
    svc_.Detach(open_.session_id(), absl::CancelledError("fuzz: end"));
    (void)svc_.CloseSession(open_.session_id());
  }

  void Apply(uint8_t op, const uint8_t* p, size_t n) {
    if (!live_) return;
    switch (op) {
      case kBytes:
        WriteAtomically(Area(), open_.doorbell().bytes(), p, n);
        break;
      case kDeclare:
        Declare(p, n);
        break;
      case kRewind:
        Rewind(n > 0 ? p[0] : 0);
        break;
      case kGradient:
        Write(client_->bytes().data(), open_.layout().total_bytes(), p, n);
        break;
      case kTake:
        Take();
        break;
      case kCut:
        Cut(Le16(p, n));
        break;
    }
  }

 private:
  std::byte* Area() const {
    return client_->bytes().data() + open_.doorbell().offset();
  }
  transport::DoorbellView View() const {
    return transport::DoorbellView(Area(), bell_->num_params());
  }
  // The client's mapping may be cut: nothing of it is touched after kCut.
  static void Write(std::byte* to, size_t size, const uint8_t* p, size_t n) {
    if (n < 2 || size == 0) return;
    const size_t at = Le16(p, n) % size;
    std::memcpy(to + at, p + 2, std::min(n - 2, size - at));
  }
  // Write's bytes, each a relaxed atomic store: dmuond's threads in this
  // process load and store the doorbell's words atomically, and a hostile
  // client's bytes race with them as another process's would, not as a
  // data race (which a TSan build would report). Byte stores over 8-byte
  // atomics mix sizes, which the C++ memory model leaves out but x86 and
  // TSan take as what they are: what another process's writes do.
  static void WriteAtomically(std::byte* to, size_t size, const uint8_t* p,
                              size_t n) {
    if (n < 2 || size == 0) return;
    const size_t at = Le16(p, n) % size;
    const size_t m = std::min(n - 2, size - at);
    auto* bytes = reinterpret_cast<unsigned char*>(to + at);
    for (size_t k = 0; k < m; ++k)
      __atomic_store_n(&bytes[k], p[2 + k], __ATOMIC_RELAXED);
  }
  // The job's step + delta % 4 - 1 (delta 0: the step completed last).
  int64_t StepAt(uint8_t delta) const {
    return std::max<int64_t>(0, step_ + static_cast<int64_t>(delta % 4) - 1);
  }
  void Declare(const uint8_t* p, size_t n) {
    if (n < 3) return;
    const int param = p[0] % bell_->num_params();
    const bool with_momentum = p[2] & 1, absent = p[2] & 2;
    if (with_momentum) View().SetMomentum(param, n > 3 ? p[3] / 256.0 : 0.9);
    View().Declare(param, transport::EncodeWord({++serial_, StepAt(p[1]),
                                                 with_momentum, absent}));
    View().Ring();
  }
  // The step is declared again from here on (as the client knows it).
  void Rewind(uint8_t delta) {
    step_ = StepAt(delta);
    View().Rewind(transport::EncodeWord({++serial_, step_, false, false}));
    View().Ring();
  }
  // As the daemon's adapter: the first refusal ends the stream. A step
  // whose every parameter was declared is waited for.
  void Take() {
    transport::Doorbell::Declarations d;
    if (!bell_->Take(&d).ok()) return End(absl::DataLossError("cut"));
    for (const v1::StepRequest& m : NewDeclarations(d, seen_.get())) {
      absl::Status st = svc_.OnStepRequest(open_.session_id(), m);
      if (!st.ok()) return End(st);
      if (!m.has_gradients_ready()) continue;
      const auto& g = m.gradients_ready();
      std::set<int>& ids = declared_[g.step()];
      ids.insert(g.param_ids().begin(), g.param_ids().end());
      ids.insert(g.absent_param_ids().begin(), g.absent_param_ids().end());
      if (static_cast<int>(ids.size()) == bell_->num_params() &&
          sink_->WaitComplete(g.step())) {
        declared_.erase(g.step());
        step_ = g.step() + 1;
      }
    }
  }
  void Cut(uint16_t pages) {
    const off_t size = static_cast<off_t>(pages % 8) * ::sysconf(_SC_PAGESIZE);
    if (::ftruncate(fd_, size) != 0) return;
    client_.reset();  // its pages may be gone too
    Take();           // dmuond's next look
    if (live_) End(absl::DataLossError("cut"));
  }
  void End(const absl::Status& why) {
    live_ = false;
    svc_.Detach(open_.session_id(), why);
  }

  OptimizerService& svc_;
  const std::shared_ptr<CompletionSink> sink_ =
      std::make_shared<CompletionSink>();
  v1::OpenSessionResponse open_;
  std::unique_ptr<transport::Region> client_;
  std::shared_ptr<transport::Doorbell> bell_;
  std::unique_ptr<DeclarationsSeen> seen_;
  int fd_ = -1;
  bool live_ = false;
  uint32_t serial_ = 0;
  int64_t step_ = 1;  // the job's, as the client knows it
  std::map<int64_t, std::set<int>> declared_;  // by step, accepted
};

ServiceOptions Options() {
  ServiceOptions o;
  o.max_sessions = 2;
  o.max_message_bytes = 1 << 20;
  o.job_retention_seconds = 0;
  return o;
}

void Run(const uint8_t* data, size_t size) {
  auto svc = NewFastService(Options(), 1);
  {
    Fixture f(*svc);
    size_t i = 0;
    while (i + 3 <= size) {
      const uint8_t op = data[i] % kOps;
      const size_t len =
          std::min<size_t>(data[i + 1] | (data[i + 2] << 8), size - i - 3);
      f.Apply(op, data + i + 3, len);
      i += 3 + len;
    }
  }
}

}  // namespace
}  // namespace dmuon::server::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dmuon::server::fuzz::SilenceProtobufLogs();
  dmuon::server::fuzz::Run(data, size);
  return 0;
}
