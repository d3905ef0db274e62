// The attacker's modes (tests/attacker.h; what each does and expects is
// in tests/attacker.cc's header).

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/reflection.grpc.pb.h"
#include "tests/attacker.h"

namespace dmuon::testing {
namespace {

using Clock = std::chrono::steady_clock;
using StepStream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;

// Runs `n` workers until Stopped().
void RunWorkers(int n, const std::function<void(int)>& work) {
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back(work, i);
  for (std::thread& t : threads) t.join();
}

// Rank `rank` of `world` of job `job` over inline: --params matrices of
// --rows x --cols, SHARDING_BLOCKS (rank 0 holds every other pair of rows)
// unless `dense` (replicated).
v1::OpenSessionRequest OpenRequest(const AttackOptions& o,
                                   const std::string& job, int world,
                                   bool blocks) {
  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_1);
  req.set_protocol_minor(3);
  req.set_job_id(job);
  req.set_world_size(world);
  req.set_transport(v1::TRANSPORT_INLINE);
  for (int i = 0; i < o.params; ++i) {
    auto* p = req.add_parameters();
    p->set_name("w" + std::to_string(i));
    p->add_shape(o.rows);
    p->add_shape(o.cols);
    p->set_dtype(v1::DTYPE_F32);
    p->set_forward_order(i);
    if (!blocks) {
      p->set_sharding(v1::SHARDING_REPLICATED);
      continue;
    }
    p->set_sharding(v1::SHARDING_BLOCKS);
    for (int r = 0; r + 2 <= o.rows; r += 4) {
      auto* run = p->add_row_runs();
      run->set_begin(r);
      run->set_end(r + 2);
    }
    auto* c = p->add_col_runs();
    c->set_begin(0);
    c->set_end(o.cols);
  }
  return req;
}

grpc::Status Open(v1::Optimizer::Stub* stub, const AttackOptions& o,
                  const v1::OpenSessionRequest& req,
                  v1::OpenSessionResponse* resp) {
  auto ctx = Ctx(o, 60);
  return stub->OpenSession(ctx.get(), req, resp);
}

grpc::Status Close(v1::Optimizer::Stub* stub, const AttackOptions& o,
                   const std::string& session_id) {
  v1::CloseSessionRequest req;
  req.set_session_id(session_id);
  v1::CloseSessionResponse resp;
  auto ctx = Ctx(o, 60);
  return stub->CloseSession(ctx.get(), req, &resp);
}

}  // namespace

bool AttackReflection(const AttackOptions& o, Tally* t, Ready ready) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      OwnChannel(o.server));
  ready();
  RunWorkers(o.streams, [&](int) {
    while (!Stopped()) {
      grpc::ClientContext ctx;  // no token
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
      auto stream = stub->ServerReflectionInfo(&ctx);
      grpc::reflection::v1alpha::ServerReflectionRequest req;
      req.set_list_services("");
      (void)stream->Write(req);
      grpc::reflection::v1alpha::ServerReflectionResponse resp;
      t->Did();
      if (stream->Read(&resp)) {
        t->Violation("a token-less reflection stream was served");
        while (!Stopped() && stream->Read(&resp)) {  // held: the attack
        }
        ctx.TryCancel();
      }
      t->Got(stream->Finish().error_code());
      Pause(o.pause_ms);
    }
  });
  return true;
}

bool AttackStalledReaders(const AttackOptions& o, Tally* t, Ready ready) {
  auto stub = v1::Optimizer::NewStub(OwnChannel(o.server));
  v1::OpenSessionResponse opened;
  const grpc::Status st =
      Open(stub.get(), o, OpenRequest(o, o.job, 1, false), &opened);
  if (!st.ok()) {
    t->Violation("cannot open its own job: " + st.error_message());
    return false;
  }
  // Attached and idle: the session lives past --attach-timeout-seconds.
  auto step_ctx = Ctx(o, 24 * 3600);
  std::unique_ptr<StepStream> step = stub->Step(step_ctx.get());
  v1::StepRequest attach;
  attach.mutable_attach()->set_session_id(opened.session_id());
  if (!step->Write(attach)) {
    t->Violation("cannot attach: " + step->Finish().error_message());
    return false;
  }
  ready();
  std::mutex mu;
  std::set<grpc::ClientContext*> live;  // guarded by mu
  std::thread workers([&] {
    RunWorkers(o.streams, [&](int) {
      auto reader_stub = v1::Optimizer::NewStub(OwnChannel(o.server));
      while (true) {
        auto ctx = Ctx(o, o.hold_seconds);
        {
          std::lock_guard<std::mutex> l(mu);
          if (Stopped()) break;
          live.insert(ctx.get());
        }
        v1::GetStateRequest req;
        req.set_session_id(opened.session_id());
        auto reader = reader_stub->GetState(ctx.get(), req);
        t->Did();
        v1::StateChunk header;  // read; every chunk after it is left unread
        if (reader->Read(&header) && !header.has_header())
          t->Violation("GetState's first message is not its header");
        const grpc::Status got = reader->Finish();
        t->Got(got.error_code());
        if (got.ok()) t->Add("read_whole_state_unread", 1);
        {
          std::lock_guard<std::mutex> l(mu);
          live.erase(ctx.get());
        }
        Pause(o.pause_ms);
      }
    });
  });
  while (!Stopped()) Pause(1000);
  {
    std::lock_guard<std::mutex> l(mu);
    for (grpc::ClientContext* c : live) c->TryCancel();
  }
  workers.join();
  step->WritesDone();
  step_ctx->TryCancel();
  (void)step->Finish();
  (void)Close(stub.get(), o, opened.session_id());
  return true;
}

bool AttackForeignOpens(const AttackOptions& o, Tally* t, Ready ready) {
  auto stub = v1::Optimizer::NewStub(OwnChannel(o.server));
  if (o.foreign_jobs.empty()) {
    t->Violation("no --jobs to open");
    return false;
  }
  AttackOptions tiny = o;
  tiny.params = 1;
  tiny.rows = tiny.cols = 8;
  ready();
  for (size_t i = 0; !Stopped(); ++i) {
    const std::string& id = o.foreign_jobs[i % o.foreign_jobs.size()];
    v1::OpenSessionResponse resp;
    const grpc::Status st =
        Open(stub.get(), o, OpenRequest(tiny, id, 1, false), &resp);
    t->Did();
    t->Got(st.error_code());
    if (st.ok()) {
      t->Violation("opened another principal's job '" + id + "'");
      (void)Close(stub.get(), o, resp.session_id());
    }
    for (const std::string& s : o.secrets)
      if (st.error_message().find(s) != std::string::npos)
        t->Violation("the refusal of '" + id + "' names '" + s +
                     "': " + st.error_message());
    Pause(o.pause_ms);
  }
  return true;
}

namespace {

// What the half-close attacker knows of its job between two steps.
struct HalfCloseState {
  int64_t expect = -1;    // the next open's next_step; -1: unknown
  int64_t ok_empty = -1;  // a step whose stream ended OK without its
                          // step_complete (a violation), to tell whether
                          // the daemon took it; -1: none
};

// One half-closed step of `o.job` (world 1), checked against `*at` and
// updated into it.
void HalfClosedStep(v1::Optimizer::Stub* stub, const AttackOptions& o,
                    HalfCloseState* at, std::mt19937_64& rng, Tally* t) {
  v1::OpenSessionResponse opened;
  grpc::Status st = Open(stub, o, OpenRequest(o, o.job, 1, false), &opened);
  t->Did();
  const HalfCloseState before = *at;
  *at = HalfCloseState();
  if (!st.ok()) {
    t->Got(st.error_code());
    return;
  }
  const int64_t step = opened.next_step();
  if (before.expect >= 0 && step != before.expect)
    t->Violation(absl::StrCat("reopened at step ", step, ", expected ",
                              before.expect,
                              " from what the last stream said"));
  if (before.ok_empty >= 0)
    t->Add(step > before.ok_empty ? "ok_without_step_complete_but_taken"
                                  : "ok_without_step_complete_not_taken",
           1);
  auto ctx = Ctx(o, 120);
  auto stream = stub->Step(ctx.get());
  v1::StepRequest m;
  m.mutable_attach()->set_session_id(opened.session_id());
  bool sent = stream->Write(m);
  std::vector<float> data(static_cast<size_t>(o.rows) * o.cols);
  std::normal_distribution<float> normal;
  for (int p = 0; p < o.params && sent; ++p) {
    for (float& x : data) x = normal(rng);
    m.Clear();
    m.mutable_gradient()->set_step(step);
    m.mutable_gradient()->set_param_id(p);
    m.mutable_gradient()->set_data(data.data(), data.size() * sizeof(float));
    sent = stream->Write(m);
  }
  m.Clear();
  m.mutable_gradients_ready()->set_step(step);
  for (int p = 0; p < o.params; ++p)
    m.mutable_gradients_ready()->add_param_ids(p);
  if (sent) sent = stream->Write(m);
  // At once, or a little later: the step then sometimes completes first.
  if (rng() % 2)
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
  stream->WritesDone();
  v1::StepResponse r;
  bool completed = false;
  while (stream->Read(&r))
    completed |= r.has_step_complete() && r.step_complete().step() == step;
  st = stream->Finish();
  t->Got(st.error_code());
  if (completed) {
    t->Add("steps_completed", 1);
    at->expect = step + 1;
  } else if (st.ok()) {
    t->Violation(absl::StrCat("step ", step,
                              ": a stream half-closed after its last "
                              "gradients_ready ended OK without its "
                              "step_complete"));
    at->ok_empty = step;
  } else if (st.error_code() == grpc::StatusCode::ABORTED) {
    t->Add("steps_not_taken", 1);  // "step N was not taken"
    at->expect = step;
  }
}

}  // namespace

bool AttackHalfCloses(const AttackOptions& o, Tally* t, Ready ready) {
  auto stub = v1::Optimizer::NewStub(OwnChannel(o.server));
  std::mt19937_64 rng(std::random_device{}());
  ready();
  HalfCloseState at;
  for (; !Stopped(); Pause(o.pause_ms))
    HalfClosedStep(stub.get(), o, &at, rng, t);
  return true;
}

bool AttackReopens(const AttackOptions& o, Tally* t, Ready ready) {
  auto stub = v1::Optimizer::NewStub(OwnChannel(o.server));
  const v1::OpenSessionRequest req = OpenRequest(o, o.job, 2, !o.dense);
  std::vector<double> ms;
  auto once = [&]() {
    v1::OpenSessionResponse resp;
    const auto t0 = Clock::now();
    const grpc::Status st = Open(stub.get(), o, req, &resp);
    ms.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    t->Got(st.error_code());
    if (!st.ok()) return st;
    const grpc::Status closed = Close(stub.get(), o, resp.session_id());
    if (!closed.ok()) t->Violation("CloseSession: " + closed.error_message());
    return st;
  };
  // The first open creates the job; then it is only reopened.
  if (const grpc::Status st = once(); !st.ok()) {
    t->Violation("cannot create its own job: " + st.error_message());
    return false;
  }
  t->Stat("create_ms", ms[0]);
  ms.clear();
  ready();
  while (!Stopped()) {
    t->Did();
    (void)once();
    Pause(o.pause_ms);
  }
  if (!ms.empty()) {
    std::sort(ms.begin(), ms.end());
    t->Stat("open_ms_p50", ms[ms.size() / 2]);
    t->Stat("open_ms_p99", ms[std::min(ms.size() - 1, ms.size() * 99 / 100)]);
    t->Stat("open_ms_max", ms.back());
  }
  return true;
}

}  // namespace dmuon::testing
