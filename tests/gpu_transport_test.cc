// The client's GPU transports (client.h: kCudaIpc, kNccl) end to end on the
// CPU: dmuon::Client over real gRPC on loopback to an in-process daemon
// whose executors are FakeDeviceExecutors and whose GPU transports are
// FakeTransports (server/testing/fake_device.h). The "GPU memory" is a host
// buffer laid out by Client::ComputeRegionLayout: cuda_ipc exports its address,
// nccl moves its slots over a CPU double of NCCL with its blocking semantics
// (transport/testing/fake_nccl.h), the daemon's side of the transport being
// the real one and the trainer's the shipped order (client/cuda/
// nccl_order.h): with the warm-up the steps go through, without it the first
// transfer deadlocks. Every update is compared with the fp64 reference Muon of
// tests/muon_job.h (2 ranks, several steps, replicated, row-sharded and
// unreduced parameters). The end of a cuda_ipc session keeps its order: the
// exported memory is freed only after the daemon released the region
// (client/cuda/release_gate.h), even with a computation in flight.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/cuda/nccl_order.h"
#include "client/cuda/release_gate.h"
#include "daemon/grpc_service.h"
#include "proto/dmuon.grpc.pb.h"
#include "server/service.h"
#include "server/testing/fake_device.h"
#include "tests/muon_job.h"
#include "transport/testing/fake_nccl.h"

namespace dmuon {
namespace {

using server::testing::FakeDeviceExecutor;
using server::testing::FakeTransports;
using transport::testing::FakeNcclNet;

// A trainer rank's blocking communicator over the NCCL double.
class FakeGroups : public gpu::NcclGroups {
 public:
  FakeGroups(std::shared_ptr<FakeNcclNet> net, int rank)
      : net_(std::move(net)), rank_(rank) {}
  absl::Status Group(const std::vector<transport::NcclTransfer>& transfers,
                     void* stream) override {
    return net_->Group(rank_, transfers).status();
  }

 private:
  const std::shared_ptr<FakeNcclNet> net_;
  const int rank_;
};

::testing::AssertionResult Has(const std::string& text,
                               const std::string& part) {
  if (text.find(part) != std::string::npos)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "'" << text << "' does not contain '" << part << "'";
}

constexpr uint64_t kSeed = 7;
constexpr double kTolerance = 1e-4;  // fp32 NS vs the fp64 oracle

// Wraps the daemon's gRPC service (e.g. to corrupt its answers).
using Wrapper =
    std::function<std::unique_ptr<grpc::Service>(server::GrpcOptimizer* real)>;

// A daemon in this process, served over gRPC on 127.0.0.1:<free port>: fake
// GPU executors and transports (`gpu`), or a CPU daemon without GPU
// transports.
class Daemon {
 public:
  explicit Daemon(bool gpu, const Wrapper& wrap = nullptr) {
    std::vector<std::unique_ptr<server::Executor>> ex;
    for (int i = 0; i < 2; ++i) {
      if (gpu) {
        auto f = std::make_unique<FakeDeviceExecutor>(i);
        fakes.push_back(f.get());
        ex.push_back(std::move(f));
      } else {
        ex.push_back(server::NewCpuExecutor(i, 1));
      }
    }
    server::ServiceOptions o;
    if (gpu) {
      transports = std::make_shared<FakeTransports>();
      transports->nccl = true;
      o.device_transports = transports;
    }
    for (const auto& e : ex) o.devices.push_back(e->device());
    service = std::make_unique<server::OptimizerService>(
        o, std::make_unique<server::Scheduler>(std::move(ex), 4), nullptr);
    grpc_ = std::make_unique<server::GrpcOptimizer>(service.get());
    if (wrap) wrapped_ = wrap(grpc_.get());
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(wrapped_ ? wrapped_.get() : grpc_.get());
    server_ = b.BuildAndStart();
    address = absl::StrCat("127.0.0.1:", port);
  }
  ~Daemon() {
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
    server_->Wait();
  }

  std::shared_ptr<FakeTransports> transports;  // null: a CPU daemon
  std::vector<FakeDeviceExecutor*> fakes;      // gpu
  std::unique_ptr<server::OptimizerService> service;
  std::string address;

 private:
  std::unique_ptr<server::GrpcOptimizer> grpc_;
  std::unique_ptr<grpc::Service> wrapped_;
  std::unique_ptr<grpc::Server> server_;
};

ClientOptions Options() {
  ClientOptions o;
  o.deadline = std::chrono::milliseconds(20000);
  return o;
}

SessionSpec Spec(const std::string& job, int rank, int world,
                 TransportChoice t) {
  SessionSpec spec;
  spec.job_id = job;
  spec.rank = rank;
  spec.world_size = world;
  spec.params = testing::TestTable(rank, world);
  spec.transport = t;
  return spec;
}

// One trainer rank of the test job over a GPU transport; its "GPU memory" is
// `mem`, laid out by Client::ComputeRegionLayout.
struct Rank {
  SessionSpec spec;
  std::vector<float> mem;  // float: 4-byte aligned; slots are 64-byte apart
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
  // nccl: the job's communicator, this rank's groups over it in the order
  // of client/cuda/nccl_order.h, and the warm-up's memory.
  std::shared_ptr<FakeNcclNet> net;
  std::unique_ptr<FakeGroups> groups;
  std::unique_ptr<gpu::NcclOrder> order;
  std::vector<std::byte> warm_up =
      std::vector<std::byte>(gpu::kNcclTrainerWarmUpBytes);
  // cuda_ipc, when set before Open: the session is guarded by it, as
  // client/cuda/device_region.h's is (`mem` is the exported memory).
  std::shared_ptr<gpu::ReleaseGate> gate;

  std::byte* base() { return reinterpret_cast<std::byte*>(mem.data()); }
  bool nccl() const { return spec.transport == TransportChoice::kNccl; }
  // kShm (a CPU daemon's comparison run): the session's own region.
  bool shm() const { return spec.transport == TransportChoice::kShm; }
  // The parameters the daemon answered as absent in the last Step.
  std::vector<int> answered_absent;

  absl::Status Open(Daemon& d, const std::string& job, int rank, int world,
                    TransportChoice t) {
    spec = Spec(job, rank, world, t);
    auto layout = Client::ComputeRegionLayout(spec);
    if (!layout.ok()) return layout.status();
    mem.assign(layout->total_bytes / sizeof(float), 0.0f);
    if (t == TransportChoice::kCudaIpc) {
      std::byte* b = base();
      spec.cuda_ipc.mem_handle.assign(reinterpret_cast<const char*>(&b),
                                      sizeof(b));
      spec.cuda_ipc.bytes = layout->total_bytes;
    }
    auto c = Client::Connect(d.address, Options());
    if (!c.ok()) return c.status();
    client = std::move(*c);
    if (gate) gate->Exported();
    auto s = client->OpenSession(spec);
    if (!s.ok()) {
      if (gate) gate->OpenFailed(s.status());
      return s.status();
    }
    session = gate ? gpu::GuardSession(std::move(*s), gate) : std::move(*s);
    if (nccl()) {
      net = d.transports->NcclNet(session->nccl().unique_id);
      if (net == nullptr) return absl::InternalError("no such communicator");
      groups = std::make_unique<FakeGroups>(net, rank);
      order = std::make_unique<gpu::NcclOrder>(*groups,
                                               session->nccl().daemon_rank);
    }
    return absl::OkStatus();
  }

  // nccl: ncclCommInitRank (blocks until every rank of the job joined: call
  // it on every rank at once), then the warm-up, as gpu::NcclPeer::Join
  // does; without `with_warm_up` (the order before it) none.
  absl::Status Join(bool with_warm_up = true) {
    if (auto st = net->Join(spec.rank); !st.ok()) return st;
    return with_warm_up ? order->WarmUp(warm_up.data(), nullptr)
                        : absl::OkStatus();
  }

  // Hands over `ids` of `step` as the contract says: gradients written, then
  // (nccl) one group of sends in `send_order` (`ids`, unless a test breaks
  // the rule), then GradientsReady.
  absl::Status HandOver(int64_t step, const std::vector<int>& ids,
                        const std::vector<int>& send_order) {
    const RegionLayout& l = session->layout();
    for (int p : ids) {
      const auto g = testing::View(
          testing::Gradient(kSeed, step, p, spec.rank, spec.world_size),
          spec.params[p]);
      if (g.size() * sizeof(float) != l.slots[p].bytes)
        return absl::InternalError("gradient size");
      std::byte* slot =
          shm() ? reinterpret_cast<std::byte*>(session->gradient(p).data())
                : base() + l.slots[p].gradient_offset;
      std::memcpy(slot, g.data(), l.slots[p].bytes);
    }
    if (nccl() && send_order == ids)
      return order->HandOver(*session, l, base(), ids, nullptr);
    if (nccl()) {
      if (auto st = order->SendGradients(l, base(), send_order, nullptr);
          !st.ok())
        return st;
    }
    return ids.size() == 1 ? session->GradientReady(ids[0])
                           : session->GradientsReady(ids);
  }

  // One step: gradients in reverse forward order (as backward makes them),
  // in groups; then every announcement (nccl: receiving each, in order).
  // `announced` gets the NextAnnounced vectors. `absent`: parameters without
  // a gradient this step, declared (GradientsAbsent) after the present ones
  // of their group, so between the others (nccl: nothing sent for them).
  absl::Status Step(int64_t step, std::vector<std::vector<int>>* announced,
                    const std::vector<int>& absent = {}) {
    const int n = static_cast<int>(spec.params.size());
    std::vector<std::vector<int>> groups = {{4, 3}, {2}, {1, 0}};
    for (const auto& g : groups) {
      std::vector<int> present, none;
      for (int p : g) {
        (std::count(absent.begin(), absent.end(), p) ? none : present)
            .push_back(p);
      }
      if (!present.empty()) {
        if (auto st = HandOver(step, present, present); !st.ok()) return st;
      }
      if (!none.empty()) {
        if (auto st = session->GradientsAbsent(none); !st.ok()) return st;
      }
    }
    for (;;) {
      auto ids = session->NextAnnounced();
      if (!ids.ok()) return ids.status();
      if (ids->empty()) break;
      announced->push_back(*ids);
      if (!nccl()) continue;
      // One receive group per announcement, in order (what
      // NcclOrder::ReceiveAnnounced loops over).
      if (auto st =
              order->ReceiveUpdates(session->layout(), base(), *ids, nullptr);
          !st.ok())
        return st;
    }
    // cudaStreamSynchronize: the updates are in the region.
    if (nccl()) {
      if (auto st = net->Synchronize(spec.rank); !st.ok()) return st;
    }
    // Announced = ready: WaitUpdate and TryUpdate agree.
    for (int p = 0; p < n; ++p) {
      if (auto st = session->WaitUpdate(p); !st.ok()) return st;
      if (!session->TryUpdate(p)) return absl::InternalError("TryUpdate");
    }
    // Every update announced and returned: NextAnnounced stays empty.
    auto again = session->NextAnnounced();
    if (!again.ok() || !again->empty())
      return absl::InternalError("NextAnnounced after the last announcement");
    answered_absent.clear();
    for (int p = 0; p < n; ++p)
      if (session->absent(p)) answered_absent.push_back(p);
    return session->FinishStep();
  }

  std::vector<float> Update(int p) {
    if (shm()) {
      const auto u = session->update(p);
      return std::vector<float>(u.begin(), u.end());
    }
    const RegionSlot& s = session->layout().slots[p];
    const float* u = reinterpret_cast<const float*>(base() + s.update_offset);
    return std::vector<float>(u, u + s.bytes / sizeof(float));
  }
};

// nccl: every rank of a job joins at once (Rank::Join), as trainer
// processes do; their statuses by rank.
std::vector<absl::Status> JoinAll(std::vector<Rank>& ranks,
                                  bool with_warm_up = true) {
  std::vector<absl::Status> status(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] { status[r] = ranks[r].Join(with_warm_up); });
  }
  for (auto& th : threads) th.join();
  return status;
}

// `steps` steps of a `world`-rank job over `t`, every update vs the fp64
// reference, every announcement checked.
void RunJob(TransportChoice t, const std::string& job, int world, int steps) {
  Daemon d(/*gpu=*/true);
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(ranks[r].Open(d, job, r, world, t).ok());
  if (t == TransportChoice::kNccl) {
    for (const absl::Status& st : JoinAll(ranks)) ASSERT_TRUE(st.ok()) << st;
  }
  testing::Reference ref(kSeed, world);
  const int n = static_cast<int>(ranks[0].spec.params.size());
  for (int64_t step = 1; step <= steps; ++step) {
    const auto want = ref.Step(step);
    std::vector<absl::Status> status(world);
    std::vector<std::vector<std::vector<int>>> announced(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back(
          [&, r] { status[r] = ranks[r].Step(step, &announced[r]); });
    }
    for (auto& th : threads) th.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(status[r].ok())
          << "rank " << r << " step " << step << ": " << status[r];
      // Every id exactly once per step.
      std::vector<int> count(n, 0);
      for (const auto& ids : announced[r]) {
        EXPECT_FALSE(ids.empty());
        for (int p : ids) ++count[p];
      }
      for (int p = 0; p < n; ++p) EXPECT_EQ(count[p], 1) << "param " << p;
      for (int p = 0; p < n; ++p) {
        const double err = testing::RelativeError(
            ranks[r].Update(p),
            testing::View(want[p], ranks[r].spec.params[p]));
        EXPECT_LE(err, kTolerance)
            << "rank " << r << " step " << step << " param " << p;
      }
    }
  }
  for (auto& r : ranks) EXPECT_TRUE(r.session->Close().ok());
}

TEST(ComputeRegionLayout, ThisRanksViewGradientsThenUpdatesAligned) {
  SessionSpec spec = Spec("j", 1, 2, TransportChoice::kCudaIpc);
  spec.params = {{"a", 3, 5, Sharding::kReplicated},
                 {"b", 10, 7, Sharding::kRows, 4, 10},
                 {"c", 2, 2, Sharding::kUnreduced}};
  auto l = Client::ComputeRegionLayout(spec);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->slots.size(), 3u);
  EXPECT_EQ(l->slots[0].rows, 3);
  EXPECT_EQ(l->slots[1].rows, 6);  // rows [4, 10)
  EXPECT_EQ(l->slots[1].bytes, 6u * 7 * 4);
  uint64_t cursor = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (const RegionSlot& s : l->slots) {
      EXPECT_EQ(pass == 0 ? s.gradient_offset : s.update_offset, cursor);
      cursor = (cursor + s.bytes + 63) / 64 * 64;
    }
  }
  EXPECT_EQ(l->total_bytes, cursor);

  spec.params[1].row_end = 11;
  EXPECT_TRUE(
      Has(std::string(Client::ComputeRegionLayout(spec).status().message()),
          "'b'"));
  spec.params[1].row_end = 10;
  spec.params[2].cols = 0;
  EXPECT_EQ(Client::ComputeRegionLayout(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GpuTransports, CudaIpcMatchesReference) {
  RunJob(TransportChoice::kCudaIpc, "ipc", 2, 4);
}

TEST(GpuTransports, NcclMatchesReference) {
  RunJob(TransportChoice::kNccl, "nccl", 2, 4);
}

// Parameters without a gradient in a step (GradientsAbsent) over nccl,
// between present ones: nothing moves for them either way, so the others'
// sends and receives keep their order around them (the fake communicator
// fails a transfer that is not the one expected), this step and the next;
// their momentum is untouched bit for bit; every other update is bit for bit
// a CPU dmuond's over shm. SHARDING_UNREDUCED "mlp.up" absent on rank 1 only
// counts as zeros there and still comes back to rank 1 (device gather).
TEST(GpuTransports, NcclAbsentParametersMoveNothingAndKeepTheirMomentum) {
  const int world = 2;
  // absent[step - 1][rank]: "mlp.down" (rows) on both ranks and "mlp.up"
  // (unreduced) on rank 1 at step 2; "attn.qkv" (rows) at step 3.
  const std::vector<std::vector<std::vector<int>>> absent = {
      {{}, {}}, {{3}, {3, 2}}, {{1}, {1}}, {{}, {}}};
  Daemon cpu(/*gpu=*/false), dev(/*gpu=*/true);
  std::vector<Rank> shm(world), nccl(world);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(
        shm[r].Open(cpu, "absent", r, world, TransportChoice::kShm).ok());
    ASSERT_TRUE(
        nccl[r].Open(dev, "absent", r, world, TransportChoice::kNccl).ok());
  }
  for (const absl::Status& st : JoinAll(nccl)) ASSERT_TRUE(st.ok()) << st;
  const int n = static_cast<int>(nccl[0].spec.params.size());
  std::vector<std::vector<float>> last;  // the momentum after the last step
  for (int64_t step = 1; step <= static_cast<int64_t>(absent.size()); ++step) {
    const auto& none = absent[step - 1];
    auto everywhere = [&](int p) {
      for (const auto& a : none)
        if (std::count(a.begin(), a.end(), p) == 0) return false;
      return true;
    };
    for (std::vector<Rank>* job : {&shm, &nccl}) {
      std::vector<absl::Status> status(world);
      std::vector<std::vector<std::vector<int>>> announced(world);
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          status[r] = (*job)[r].Step(step, &announced[r], none[r]);
        });
      }
      for (auto& th : threads) th.join();
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(status[r].ok())
            << (*job)[r].session->transport() << " rank " << r << " step "
            << step << ": " << status[r];
        std::vector<int> count(n, 0), want_absent;
        for (const auto& ids : announced[r])
          for (int p : ids) ++count[p];
        for (int p = 0; p < n; ++p) {
          EXPECT_EQ(count[p], everywhere(p) ? 0 : 1)
              << "rank " << r << " step " << step << " param " << p;
          if (everywhere(p)) want_absent.push_back(p);
        }
        EXPECT_EQ((*job)[r].answered_absent, want_absent)
            << "rank " << r << " step " << step;
      }
    }
    for (int r = 0; r < world; ++r) {
      for (int p = 0; p < n; ++p) {
        if (everywhere(p)) continue;
        EXPECT_EQ(nccl[r].Update(p), shm[r].Update(p))
            << "rank " << r << " step " << step << " param " << p;
      }
    }
    auto want = shm[0].session->GetState();
    auto got = nccl[0].session->GetState();
    ASSERT_TRUE(want.ok() && got.ok());
    EXPECT_EQ(got->completed_steps, step);
    EXPECT_EQ(got->momentum, want->momentum) << "step " << step;
    for (int p = 0; p < n; ++p) {
      if (everywhere(p) && !last.empty()) {
        EXPECT_EQ(got->momentum[p], last[p])
            << "absent param " << p << " at step " << step
            << ": its momentum changed";
      }
    }
    last = got->momentum;
  }
  for (auto& r : shm) EXPECT_TRUE(r.session->Close().ok());
  for (auto& r : nccl) EXPECT_TRUE(r.session->Close().ok());
}

// What happened, in order, across threads.
class EventLog {
 public:
  void Add(const std::string& e) {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(e);
  }
  std::vector<std::string> events() const {
    std::lock_guard<std::mutex> l(mu_);
    return events_;
  }
  bool Has(const std::string& e) const {
    std::lock_guard<std::mutex> l(mu_);
    return std::find(events_.begin(), events_.end(), e) != events_.end();
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> events_;
};

// Frees the rank's exported "GPU memory" the way DeviceRegion's destructor
// does (FreeWhenReleased), logging it when it happens.
absl::Status FreeMemory(Rank& r, EventLog& log) {
  return gpu::FreeWhenReleased(*r.gate, [&] {
    log.Add("client freed the memory");
    r.mem = std::vector<float>();
    return absl::OkStatus();
  });
}

constexpr char kReleased[] = "daemon released the region";

TEST(GpuTransports, CudaIpcMemoryIsFreedOnlyAfterTheDaemonReleasedIt) {
  Daemon d(/*gpu=*/true);
  EventLog log;
  d.transports->on_unmap = [&](const std::string&) { log.Add(kReleased); };
  Rank r;
  r.gate = std::make_shared<gpu::ReleaseGate>();
  EXPECT_TRUE(r.gate->may_free()) << "nothing exported yet";
  ASSERT_TRUE(r.Open(d, "release", 0, 1, TransportChoice::kCudaIpc).ok());
  std::vector<std::vector<int>> announced;
  ASSERT_TRUE(r.Step(1, &announced).ok());
  // Freeing while the session is open is refused: the memory is kept.
  const absl::Status early = FreeMemory(r, log);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition) << early;
  EXPECT_TRUE(Has(std::string(early.message()), "still open")) << early;
  EXPECT_TRUE(log.events().empty());
  ASSERT_FALSE(r.mem.empty());
  // Close: the daemon releases the region before it answers; then free.
  ASSERT_TRUE(r.session->Close().ok());
  EXPECT_TRUE(r.session->region_released());
  ASSERT_TRUE(FreeMemory(r, log).ok());
  EXPECT_EQ(log.events(),
            (std::vector<std::string>{kReleased, "client freed the memory"}));
}

// A rank that closes while a computation still reads and writes its region:
// the daemon's CloseSession waits for that computation to end before it
// releases the region and answers, so the client frees only after both.
TEST(GpuTransports, CudaIpcCloseMidStepWaitsForTheComputationBeforeFreeing) {
  Daemon d(/*gpu=*/true);
  EventLog log;
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::atomic<int> held{0};
  for (FakeDeviceExecutor* f : d.fakes) {
    f->on_compute = [&] {
      if (held++ == 0) log.Add("computation in flight");
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return go; });
    };
  }
  d.transports->on_unmap = [&](const std::string&) { log.Add(kReleased); };
  Rank r;
  r.gate = std::make_shared<gpu::ReleaseGate>();
  ASSERT_TRUE(r.Open(d, "midstep", 0, 1, TransportChoice::kCudaIpc).ok());
  ASSERT_TRUE(r.HandOver(1, {4, 3, 2, 1, 0}, {4, 3, 2, 1, 0}).ok());
  for (int i = 0; i < 2000 && held == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GT(held.load(), 0) << "no computation started";
  absl::Status closed = absl::UnknownError("not yet");
  std::atomic<bool> close_returned{false};
  std::thread closer([&] {
    closed = r.session->Close();
    close_returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(close_returned) << "CloseSession answered with a computation "
                                  "still using the region";
  EXPECT_FALSE(log.Has(kReleased)) << "released under a computation";
  EXPECT_EQ(FreeMemory(r, log).code(), absl::StatusCode::kFailedPrecondition);
  log.Add("computation let go");
  {
    std::lock_guard<std::mutex> l(mu);
    go = true;
  }
  cv.notify_all();
  closer.join();
  ASSERT_TRUE(closed.ok()) << closed;
  EXPECT_TRUE(r.session->region_released());
  ASSERT_TRUE(FreeMemory(r, log).ok());
  EXPECT_EQ(log.events(), (std::vector<std::string>{
                              "computation in flight", "computation let go",
                              kReleased, "client freed the memory"}));
}

TEST(ReleaseGate, FreesOnlyWhenNoDaemonMayMapTheMemory) {
  gpu::ReleaseGate g;
  EXPECT_TRUE(g.may_free());
  g.Exported();
  EXPECT_FALSE(g.may_free());
  // The daemon answered an error: it keeps no mapping.
  g.OpenFailed(absl::InvalidArgumentError("bad export"));
  EXPECT_TRUE(g.may_free());
  g.Exported();
  g.OpenFailed(absl::UnavailableError("connection refused"));
  EXPECT_TRUE(g.may_free());
  // No answer: the daemon may have opened the session.
  for (const absl::Status& st :
       {absl::DeadlineExceededError("late"), absl::CancelledError("cancelled"),
        absl::UnknownError("?")}) {
    g.Exported();
    g.OpenFailed(st);
    EXPECT_FALSE(g.may_free()) << st;
    EXPECT_TRUE(Has(g.why_not(), "without the daemon's answer")) << st;
  }
  g.Opened();
  EXPECT_FALSE(g.may_free());
  g.Closed(false);
  EXPECT_FALSE(g.may_free());
  EXPECT_TRUE(Has(g.why_not(), "without the daemon confirming"));
  int freed = 0;
  EXPECT_EQ(gpu::FreeWhenReleased(g,
                                  [&] {
                                    ++freed;
                                    return absl::OkStatus();
                                  })
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(freed, 0);
  g.Closed(true);
  EXPECT_TRUE(gpu::FreeWhenReleased(g, [&] {
                ++freed;
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(freed, 1);
}

// A daemon that is gone when the session closes cannot confirm the release:
// the memory is kept.
TEST(GpuTransports, CudaIpcMemoryIsKeptWhenTheDaemonCannotConfirm) {
  auto d = std::make_unique<Daemon>(/*gpu=*/true);
  Rank r;
  r.gate = std::make_shared<gpu::ReleaseGate>();
  ASSERT_TRUE(r.Open(*d, "gone", 0, 1, TransportChoice::kCudaIpc).ok());
  d.reset();
  EXPECT_FALSE(r.session->Close().ok());
  EXPECT_FALSE(r.session->region_released());
  EventLog log;
  EXPECT_EQ(FreeMemory(r, log).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(r.mem.empty());
}

TEST(GpuTransports, SessionDescribesItsRegion) {
  Daemon d(/*gpu=*/true);
  Rank ipc, nccl;
  ASSERT_TRUE(ipc.Open(d, "ipc", 0, 1, TransportChoice::kCudaIpc).ok());
  ASSERT_TRUE(nccl.Open(d, "nccl", 0, 1, TransportChoice::kNccl).ok());
  auto want = Client::ComputeRegionLayout(ipc.spec);
  ASSERT_TRUE(want.ok());
  EXPECT_TRUE(ipc.session->layout() == *want);
  EXPECT_TRUE(nccl.session->layout() == *want);
  EXPECT_EQ(ipc.session->transport(), "cuda_ipc");
  EXPECT_EQ(nccl.session->transport(), "nccl");
  EXPECT_TRUE(ipc.session->gradient(0).empty());
  EXPECT_TRUE(ipc.session->update(0).empty());
  EXPECT_TRUE(nccl.session->gradient(0).empty());
  EXPECT_EQ(ipc.session->nccl().nranks, 0);
  EXPECT_EQ(nccl.session->nccl().nranks, 2);
  EXPECT_EQ(nccl.session->nccl().daemon_rank, 1);
  EXPECT_EQ(nccl.session->nccl().unique_id.size(), 128u);
}

TEST(GpuTransports, NcclSendsOutOfOrderBreakTheJob) {
  Daemon d(/*gpu=*/true);
  Rank r;
  ASSERT_TRUE(r.Open(d, "swap", 0, 1, TransportChoice::kNccl).ok());
  ASSERT_TRUE(r.Join().ok());
  // Declared [0, 1], sent [1, 0]: the daemon's receives do not match.
  ASSERT_TRUE(r.HandOver(1, {0, 1}, {1, 0}).ok());
  auto ids = r.session->NextAnnounced();
  ASSERT_FALSE(ids.ok());
  EXPECT_TRUE(Has(std::string(ids.status().message()), "out of the order"));
  EXPECT_TRUE(Has(std::string(ids.status().message()), d.address));
}

// Issue 23: NCCL connects a pair lazily in the first group end that uses
// it, which blocks until the peer uses the pair too. Without the warm-up
// (the order before it, on both sides) the trainer's first gradient group
// waits for the daemon's receive, which the daemon posts only after the
// GradientsReady that the trainer sends once that group end returns: each
// waits for the other. The double reports the group end that never returns
// after its timeout (a real trainer would hang; the daemon would give up
// only after its 120 s enqueue deadline).
TEST(GpuTransports, NcclWithoutTheWarmUpTheFirstTransferDeadlocks) {
  Daemon d(/*gpu=*/true);
  d.transports->nccl_timeout = std::chrono::milliseconds(500);
  d.transports->nccl_warm_up = false;
  Rank r;
  ASSERT_TRUE(r.Open(d, "old", 0, 1, TransportChoice::kNccl).ok());
  ASSERT_TRUE(r.Join(/*with_warm_up=*/false).ok());
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status st = r.HandOver(1, {4, 3}, {4, 3});
  EXPECT_GE(std::chrono::steady_clock::now() - t0,
            std::chrono::milliseconds(500))
      << "the group end returned early";
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_TRUE(Has(std::string(st.message()), "its send to rank 1"));
  EXPECT_TRUE(Has(std::string(st.message()), "deadlock"));
  // Meanwhile the daemon posted nothing: it waits for GradientsReady.
  EXPECT_TRUE(r.net->Posted(1).empty());
}

// The same first step with the warm-up on both sides goes through, with the
// same short timeout: no group end waits for a peer any more.
TEST(GpuTransports, NcclWithTheWarmUpTheFirstStepsGoThrough) {
  Daemon d(/*gpu=*/true);
  d.transports->nccl_timeout = std::chrono::milliseconds(2000);
  std::vector<Rank> ranks(2);
  for (int r = 0; r < 2; ++r)
    ASSERT_TRUE(ranks[r].Open(d, "new", r, 2, TransportChoice::kNccl).ok());
  for (const absl::Status& st : JoinAll(ranks)) ASSERT_TRUE(st.ok()) << st;
  // The warm-up is each side's first group, with every trainer rank.
  const auto daemon = ranks[0].net->Posted(2);
  ASSERT_FALSE(daemon.empty());
  ASSERT_EQ(daemon[0].size(), 4u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(daemon[0][2 * r].send);
    EXPECT_EQ(daemon[0][2 * r].peer, r);
    EXPECT_TRUE(daemon[0][2 * r + 1].send);
    EXPECT_EQ(daemon[0][2 * r + 1].peer, r);
    const auto mine = ranks[r].net->Posted(r);
    ASSERT_EQ(mine.size(), 1u);
    ASSERT_EQ(mine[0].size(), 2u);
    EXPECT_TRUE(mine[0][0].send);
    EXPECT_FALSE(mine[0][1].send);
    EXPECT_EQ(mine[0][0].bytes, transport::kNcclWarmUpBytes);
  }
  testing::Reference ref(kSeed, 2);
  for (int64_t step = 1; step <= 2; ++step) {
    const auto want = ref.Step(step);
    std::vector<absl::Status> status(2);
    std::vector<std::vector<std::vector<int>>> announced(2);
    std::thread t1([&] { status[1] = ranks[1].Step(step, &announced[1]); });
    status[0] = ranks[0].Step(step, &announced[0]);
    t1.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
      for (int p = 0; p < 5; ++p) {
        EXPECT_LE(testing::RelativeError(
                      ranks[r].Update(p),
                      testing::View(want[p], ranks[r].spec.params[p])),
                  kTolerance)
            << "rank " << r << " step " << step << " param " << p;
      }
    }
  }
  for (auto& r : ranks) EXPECT_TRUE(r.session->Close().ok());
}

// A trainer without the warm-up (a build before it) against a daemon with
// it: the job breaks with the reason once the daemon's warm-up gives up,
// rather than hang.
TEST(GpuTransports, NcclTrainerWithoutTheWarmUpBreaksTheJob) {
  Daemon d(/*gpu=*/true);
  d.transports->nccl_timeout = std::chrono::milliseconds(500);
  Rank r;
  ASSERT_TRUE(r.Open(d, "mixed", 0, 1, TransportChoice::kNccl).ok());
  ASSERT_TRUE(r.Join(/*with_warm_up=*/false).ok());
  std::vector<std::vector<int>> announced;
  const absl::Status st = r.Step(1, &announced);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(Has(std::string(st.message()), "NCCL")) << st;
}

TEST(GpuTransports, NextAnnouncedWorksOverShmToo) {
  Daemon d(/*gpu=*/true);
  auto c = Client::Connect(d.address, Options());
  ASSERT_TRUE(c.ok());
  // kAuto never picks a GPU transport, even on a daemon that serves them.
  auto s = (*c)->OpenSession(Spec("auto", 0, 1, TransportChoice::kAuto));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->transport(), "shm");
  EXPECT_EQ((*s)->layout().slots.size(), 5u);
  const int n = 5;
  for (int p = n - 1; p >= 0; --p) ASSERT_TRUE((*s)->GradientReady(p).ok());
  std::vector<int> count(n, 0);
  for (;;) {
    auto ids = (*s)->NextAnnounced();
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (ids->empty()) break;
    for (int p : *ids) ++count[p];
  }
  for (int p = 0; p < n; ++p) EXPECT_EQ(count[p], 1);
  ASSERT_TRUE((*s)->FinishStep().ok());
}

TEST(GpuTransports, CpuDaemonRefusesThemNamingTransportAndAddress) {
  Daemon d(/*gpu=*/false);
  auto c = Client::Connect(d.address, Options());
  ASSERT_TRUE(c.ok());
  SessionSpec spec = Spec("cpu", 0, 1, TransportChoice::kCudaIpc);
  auto layout = Client::ComputeRegionLayout(spec);
  ASSERT_TRUE(layout.ok());
  spec.cuda_ipc.mem_handle.assign(64, '\1');
  spec.cuda_ipc.bytes = layout->total_bytes;
  auto s = (*c)->OpenSession(spec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(Has(std::string(s.status().message()), "cuda_ipc"));
  EXPECT_TRUE(Has(std::string(s.status().message()), d.address));
  spec.transport = TransportChoice::kNccl;
  s = (*c)->OpenSession(spec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(Has(std::string(s.status().message()), "nccl"));
  EXPECT_EQ(d.service->open_sessions(), 0);
}

TEST(GpuTransports, BadExportIsAClearError) {
  Daemon d(/*gpu=*/true);
  auto c = Client::Connect(d.address, Options());
  ASSERT_TRUE(c.ok());
  SessionSpec spec = Spec("bad", 0, 1, TransportChoice::kCudaIpc);
  auto layout = Client::ComputeRegionLayout(spec);
  ASSERT_TRUE(layout.ok());
  std::vector<float> mem(layout->total_bytes / 4);
  // No export at all.
  auto s = (*c)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(std::string(s.status().message()), "mem_handle"));
  // Too small for the layout: refused before any call.
  float* base = mem.data();
  spec.cuda_ipc.mem_handle.assign(reinterpret_cast<const char*>(&base),
                                  sizeof(base));
  spec.cuda_ipc.bytes = layout->total_bytes - 64;
  s = (*c)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(std::string(s.status().message()),
                  absl::StrCat(layout->total_bytes)));
  // A handle the daemon cannot use: its message, with the context.
  spec.cuda_ipc.bytes = layout->total_bytes;
  spec.cuda_ipc.mem_handle = "12345";
  s = (*c)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(std::string(s.status().message()), "cuda_ipc.mem_handle"));
  EXPECT_TRUE(Has(std::string(s.status().message()), d.address));
  EXPECT_EQ(d.service->open_sessions(), 0);
}

// Forwards OpenSession (with a layout 64 bytes too large) and CloseSession.
class WrongLayout : public v1::Optimizer::Service {
 public:
  explicit WrongLayout(server::GrpcOptimizer* real) : real_(real) {}
  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override {
    grpc::Status st = real_->OpenSession(ctx, req, resp);
    resp->mutable_layout()->set_total_bytes(resp->layout().total_bytes() + 64);
    return st;
  }
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override {
    return real_->CloseSession(ctx, req, resp);
  }

 private:
  server::GrpcOptimizer* const real_;
};

TEST(GpuTransports, LayoutMismatchIsInternalNamingBothSizes) {
  Daemon d(/*gpu=*/true, [](server::GrpcOptimizer* real) {
    return std::make_unique<WrongLayout>(real);
  });
  Rank r;
  const absl::Status st = r.Open(d, "wrong", 0, 1, TransportChoice::kCudaIpc);
  ASSERT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  const uint64_t total = r.mem.size() * sizeof(float);
  EXPECT_TRUE(Has(std::string(st.message()), absl::StrCat(total)));
  EXPECT_TRUE(Has(std::string(st.message()), absl::StrCat(total + 64)));
  EXPECT_EQ(d.service->open_sessions(), 0);  // the client closed it
}

TEST(GpuTransports, PoolsOfSeveralDaemonsRefuseThem) {
  Daemon a(/*gpu=*/true), b(/*gpu=*/true);
  auto pool = Client::ConnectPool({a.address, b.address}, Options());
  ASSERT_TRUE(pool.ok());
  SessionSpec spec = Spec("pool", 0, 1, TransportChoice::kNccl);
  auto s = (*pool)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(Has(std::string(s.status().message()), "pool"));
  // A pool of one daemon is that daemon.
  Rank r;
  auto one = Client::ConnectPool({a.address}, Options());
  ASSERT_TRUE(one.ok());
  r.spec = Spec("pool1", 0, 1, TransportChoice::kCudaIpc);
  auto layout = Client::ComputeRegionLayout(r.spec);
  ASSERT_TRUE(layout.ok());
  r.mem.assign(layout->total_bytes / 4, 0.0f);
  std::byte* base = r.base();
  r.spec.cuda_ipc.mem_handle.assign(reinterpret_cast<const char*>(&base),
                                    sizeof(base));
  r.spec.cuda_ipc.bytes = layout->total_bytes;
  auto ps = (*one)->OpenSession(r.spec);
  ASSERT_TRUE(ps.ok()) << ps.status();
  r.session = std::move(*ps);
  EXPECT_TRUE(r.session->layout() == *layout);
  std::vector<std::vector<int>> announced;
  ASSERT_TRUE(r.Step(1, &announced).ok());
  testing::Reference ref(kSeed, 1);
  const auto want = ref.Step(1);
  for (int p = 0; p < 5; ++p)
    EXPECT_LE(testing::RelativeError(r.Update(p), want[p]), kTolerance);
}

}  // namespace
}  // namespace dmuon
