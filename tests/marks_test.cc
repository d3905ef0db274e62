// Marks across a daemon's crash and a change of world size, with real
// processes (issue 28 part 2, docs/protocol.md "Marks"): two ranks step a
// job on a dmuond with --state-dir, mark step 3 and go on; dmuond is killed
// (SIGKILL) and started again on the directory, lists the mark (its job
// only on disk), and the job is reopened at the mark with 1 rank, then
// (the mark still held) with 4: each continuation's updates equal an fp64
// reference run that went from step 3 on (tests/muon_job.h). The ranks
// speak the generated gRPC stub over TRANSPORT_INLINE, so that Mark is
// sent as any client would send it. A daemon of the previous minor
// refuses Mark naming both minors.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/muon_job.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

// Whole matrices; every rank holds the same gradient (no unreduced
// parameter), so the reference does not depend on the world size.
const std::vector<ParamSpec> kWhole = {{"rows", 24, 40, Sharding::kRows},
                                       {"full", 40, 24, Sharding::kReplicated}};

// Rank `rank` of `world` of job `id`, driven over the gRPC stub.
class StubRank {
 public:
  StubRank(const std::string& address, const std::string& id, int rank,
           int world, int minor = static_cast<int>(kProtocolMinor))
      : stub_(v1::Optimizer::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        rank_(rank) {
    req_.set_protocol_version(v1::PROTOCOL_VERSION_1);
    req_.set_protocol_minor(static_cast<uint32_t>(minor));
    req_.set_job_id(id);
    req_.set_rank(rank);
    req_.set_world_size(world);
    req_.set_transport(v1::TRANSPORT_INLINE);
    for (const ParamSpec& p : kWhole) {
      auto* s = req_.add_parameters();
      s->set_name(p.name);
      s->add_shape(p.rows);
      s->add_shape(p.cols);
      const int64_t per = (p.rows + world - 1) / world;
      if (p.sharding == Sharding::kRows) {
        s->set_sharding(v1::SHARDING_ROWS);
        s->set_row_begin(std::min(p.rows, rank * per));
        s->set_row_end(std::min(p.rows, (rank + 1) * per));
      }
      local_.push_back(p);
      local_.back().row_begin = s->row_begin();
      local_.back().row_end = s->row_end();
    }
  }
  ~StubRank() {
    if (!stream_) return;
    stream_->WritesDone();
    (void)stream_->Finish();
  }

  // OpenSession (resume=fresh, or continue at `resume_step`), then attach.
  grpc::Status Open(int64_t resume_step) {
    req_.set_resume(resume_step > 0 ? v1::RESUME_CONTINUE : v1::RESUME_FRESH);
    req_.set_resume_step(resume_step);
    grpc::ClientContext ctx;
    grpc::Status st = stub_->OpenSession(&ctx, req_, &open_);
    if (!st.ok()) return st;
    stream_ = stub_->Step(&stream_ctx_);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open_.session_id());
    stream_->Write(m);
    return st;
  }
  int64_t next_step() const { return open_.next_step(); }

  // Sends this rank's gradients of `step`.
  void Send(uint64_t seed, int64_t step) {
    v1::StepRequest ready;
    ready.mutable_gradients_ready()->set_step(step);
    for (int p = 0; p < static_cast<int>(kWhole.size()); ++p) {
      const auto g = View(Gradient(seed, step, p, rank_, kWhole[p]), local_[p]);
      v1::StepRequest c;
      c.mutable_gradient()->set_step(step);
      c.mutable_gradient()->set_param_id(p);
      c.mutable_gradient()->set_data(g.data(), g.size() * sizeof(float));
      ASSERT_TRUE(stream_->Write(c));
      ready.mutable_gradients_ready()->add_param_ids(p);
    }
    ASSERT_TRUE(stream_->Write(ready));
  }
  // This rank's updates of the step sent, once its step_complete came.
  std::vector<std::vector<float>> Receive() {
    std::vector<std::string> bytes(kWhole.size());
    v1::StepResponse r;
    while (stream_->Read(&r) && !r.has_step_complete()) {
      if (r.has_update()) bytes[r.update().param_id()] += r.update().data();
      EXPECT_FALSE(r.has_error()) << r.error().message();
    }
    std::vector<std::vector<float>> out;
    for (const std::string& b : bytes) {
      out.emplace_back(b.size() / sizeof(float));
      std::memcpy(out.back().data(), b.data(), b.size());
    }
    return out;
  }

  absl::StatusOr<v1::MarkResponse> Mark() {
    v1::MarkRequest req;
    req.set_session_id(open_.session_id());
    v1::MarkResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Mark(&ctx, req, &resp);
    if (!st.ok())
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                          st.error_message());
    return resp;
  }
  void Close() {
    v1::CloseSessionRequest req;
    req.set_session_id(open_.session_id());
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  }
  const ParamSpec& local(int p) const { return local_[p]; }

 private:
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  const int rank_;
  v1::OpenSessionRequest req_;
  v1::OpenSessionResponse open_;
  std::vector<ParamSpec> local_;
  grpc::ClientContext stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
};

using Ranks = std::vector<std::unique_ptr<StubRank>>;

Ranks OpenRanks(const Daemon& d, int world, int64_t resume_step) {
  Ranks ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(
        std::make_unique<StubRank>(d.address(), "marked", r, world));
    const grpc::Status st = ranks.back()->Open(resume_step);
    EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << d.log();
    EXPECT_EQ(ranks.back()->next_step(), resume_step + 1);
  }
  return ranks;
}

// Steps from..to of every rank; each rank's updates are checked against
// `ref` (advanced through the same steps).
void Steps(Ranks& ranks, Reference& ref, uint64_t seed, int from, int to) {
  for (int s = from; s <= to; ++s) {
    const auto want = ref.Step(s);
    for (auto& r : ranks) r->Send(seed, s);
    for (auto& r : ranks) {
      const auto got = r->Receive();
      for (size_t p = 0; p < kWhole.size(); ++p) {
        const auto whole = std::vector<double>(want[p]);
        EXPECT_LE(RelativeError(got[p], View(whole, r->local(p))), 1e-4)
            << "step " << s << " parameter " << kWhole[p].name;
      }
    }
  }
}

TEST(Marks, SurviveADaemonKillAndResumeAtAnyWorldSize) {
  const std::string dir = TempDir("marks");
  const uint64_t seed = std::random_device{}();
  const std::vector<std::string> flags = {"--state-dir=" + dir,
                                          "--snapshot-every=1"};
  {
    Daemon d(flags);
    ASSERT_NE(d.port(), 0) << d.log();
    Reference ref(seed, 2, kWhole);
    Ranks ranks = OpenRanks(d, 2, 0);
    Steps(ranks, ref, seed, 1, 3);
    auto m = ranks[1]->Mark();
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->step(), 3);
    EXPECT_EQ(m->not_durable(), "");
    Steps(ranks, ref, seed, 4, 5);
    d.process().Signal(SIGKILL);
    d.process().Wait(30);
  }
  Daemon d(flags);
  ASSERT_NE(d.port(), 0) << d.log();
  int code = 0;
  const std::string status = Ctl(d.address(), {"status"}, &code);
  EXPECT_EQ(code, 0) << status;
  // The job only on disk, at step 5, its mark listed (the MARKS column).
  const size_t line = status.find("marked ");
  ASSERT_NE(line, std::string::npos) << status;
  const std::string row = status.substr(line, status.find('\n', line) - line);
  EXPECT_NE(row.find("on disk"), std::string::npos) << row;
  EXPECT_EQ(row.substr(row.size() - 2), " 3") << row;
  for (int world : {1, 4}) {
    Reference ref(seed, world, kWhole);
    for (int s = 1; s <= 3; ++s) ref.Advance(s);
    Ranks ranks = OpenRanks(d, world, 3);
    Steps(ranks, ref, seed, 4, 5);
    for (auto& r : ranks) r->Close();
  }
}

// A dmuond of the previous minor (before marks) refuses Mark naming the
// minor it needs and its own, and an open at a step it does not hold is
// refused as before (it knows no marks).
TEST(Marks, ADaemonOfThePreviousMinorRefusesMarkNamingBoth) {
  Daemon prev({}, "daemon/dmuond_prev");
  ASSERT_NE(prev.port(), 0) << prev.log();
  StubRank r(prev.address(), "prev", 0, 1, kProtocolMinor - 1);
  ASSERT_TRUE(r.Open(0).ok()) << prev.log();
  const uint64_t seed = std::random_device{}();
  r.Send(seed, 1);
  r.Receive();
  auto m = r.Mark();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(m.status().message().find("Mark needs protocol minor 5"),
            std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find(
                absl::StrCat("speaks protocol 1.", kProtocolMinor - 1)),
            std::string::npos)
      << m.status();
}

}  // namespace
}  // namespace dmuon::testing
