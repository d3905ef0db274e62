// Version skew with real processes (docs/protocol.md "Versions"): a rolling
// upgrade from dmuond_minor0 (this tree built to speak protocol 1.0, as a
// release before minor versions) to dmuond on the same --state-dir and
// port, the job continued with resume=continue bit for bit like an
// uninterrupted run; a client claiming a newer minor than the daemon's is
// refused naming both versions; this client asking an older daemon for what
// its minor lacks is refused naming both versions: this client by
// dmuond_prev (the previous minor) at OpenSession, and client-side a
// SHARDING_BLOCKS parameter (minor 3), a per-step momentum (minor 2), a
// resume mode, an absent parameter or a Rewind (minor 1), and a Mark (minor
// 5) sent to dmuond_minor0 (a 1.0 daemon, which refuses nobody).

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "client/client.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/muon_job.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

constexpr int kWorld = 1;
const std::vector<ParamSpec> kTable = TestTable(0, kWorld);
using Updates = std::vector<std::vector<float>>;

std::unique_ptr<Client> Connect(const Daemon& d) {
  ClientOptions o;
  o.deadline = std::chrono::seconds(30);
  auto c = Client::Connect(d.address(), o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

absl::StatusOr<std::unique_ptr<Session>> Open(Client& c, const std::string& job,
                                              Resume resume) {
  SessionSpec spec;
  spec.job_id = job;
  spec.world_size = kWorld;
  spec.params = kTable;
  spec.transport = TransportChoice::kShm;
  spec.resume = resume;
  return c.OpenSession(spec);
}

// Runs the session's current step; its updates.
Updates Step(Session& s, uint64_t seed) {
  for (int p = static_cast<int>(kTable.size()) - 1; p >= 0; --p) {
    auto g = View(Gradient(seed, s.step(), p, 0, kWorld), kTable[p]);
    auto dst = s.gradient(p);
    std::copy(g.begin(), g.end(), dst.begin());
    EXPECT_TRUE(s.GradientReady(p).ok());
  }
  Updates out;
  for (int p = 0; p < static_cast<int>(kTable.size()); ++p) {
    const absl::Status st = s.WaitUpdate(p);
    EXPECT_TRUE(st.ok()) << st;
    auto u = s.update(p);
    out.emplace_back(u.begin(), u.end());
  }
  const absl::Status st = s.FinishStep();
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

void ExpectHas(const absl::Status& st, absl::StatusCode code,
               const std::vector<std::string>& parts) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << p << ": " << st;
}

TEST(VersionSkew, RollingUpgradeContinuesTheJobBitForBit) {
  const std::string dir = TempDir("rolling");
  const uint64_t seed = std::random_device{}();
  constexpr int kBefore = 3, kAfter = 3;
  // The older daemon: a 1.0 one (dmuond_minor0). dmuond_prev (the minor
  // before this tree's, 1 or newer) refuses this client, whose minor is
  // newer (Versions); a trainer that upgrades along with it reconnects to
  // the new daemon with the same client, as below.
  std::unique_ptr<Daemon> prev = std::make_unique<Daemon>(
      std::vector<std::string>{"--state-dir=" + dir}, "daemon/dmuond_minor0");
  ASSERT_NE(prev->port(), 0) << prev->log();
  EXPECT_NE(prev->log().find("(protocol 1.0)"), std::string::npos)
      << prev->log();
  const int port = prev->port();
  auto client = Connect(*prev);
  ASSERT_TRUE(client);
  {
    // The old daemon: no resume mode (Resume::kAuto), as a 1.0 trainer.
    auto s = Open(*client, "upgrade", Resume::kAuto);
    ASSERT_TRUE(s.ok()) << s.status();
    for (int k = 1; k <= kBefore; ++k) Step(**s, seed);
    ASSERT_EQ((*s)->step(), kBefore + 1);
    // The upgrade: SIGTERM (a final snapshot), the session still open.
    prev->process().Signal(SIGTERM);
    EXPECT_EQ(prev->process().Wait(30), 0) << prev->log();
  }
  Daemon cur({"--state-dir=" + dir, absl::StrCat("--listen=127.0.0.1:", port)});
  ASSERT_EQ(cur.port(), port) << cur.log();
  EXPECT_NE(cur.log().find(absl::StrCat("(protocol 1.", kProtocolMinor, ")")),
            std::string::npos)
      << cur.log();
  // The trainer reconnects (a new channel: the old one backs off after the
  // refused connects of the restart). A fresh start is refused: the old
  // daemon's snapshot holds the job's momentum.
  client = Connect(cur);
  ASSERT_TRUE(client);
  ExpectHas(Open(*client, "upgrade", Resume::kFresh).status(),
            absl::StatusCode::kAlreadyExists,
            {"job 'upgrade'", absl::StrCat("completed step ", kBefore),
             "resume=continue", "resume=replace"});
  auto s = Open(*client, "upgrade", Resume::kContinue);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ((*s)->step(), kBefore + 1);
  std::vector<Updates> resumed;
  for (int k = 1; k <= kAfter; ++k) resumed.push_back(Step(**s, seed));

  // Uninterrupted, on the new daemon alone.
  auto t = Open(*client, "straight", Resume::kFresh);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<Updates> straight;
  for (int k = 1; k <= kBefore + kAfter; ++k)
    straight.push_back(Step(**t, seed));
  for (int k = 0; k < kAfter; ++k) {
    ASSERT_EQ(resumed[k].size(), kTable.size());
    for (size_t p = 0; p < kTable.size(); ++p) {
      EXPECT_EQ(resumed[k][p], straight[kBefore + k][p])  // bit for bit
          << "step " << kBefore + 1 + k << " parameter " << p;
    }
  }
}

TEST(VersionSkew, AClientOfANewerMinorIsRefusedNamingBothVersions) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_1);
  req.set_protocol_minor(kProtocolMinor + 1);
  req.set_client_version("99.0.0");
  req.set_job_id("newer");
  req.set_world_size(1);
  req.set_transport(v1::TRANSPORT_INLINE);
  auto* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(8);
  p->add_shape(8);
  p->set_dtype(v1::DTYPE_F32);
  p->set_sharding(v1::SHARDING_REPLICATED);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::OpenSessionResponse resp;
  const grpc::Status st = stub->OpenSession(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  for (const std::string& part : std::vector<std::string>{
           absl::StrCat("client speaks protocol 1.", kProtocolMinor + 1),
           "client 99.0.0",
           absl::StrCat("dmuond speaks protocol 1.", kProtocolMinor),
           absl::StrCat("dmuond ", kDmuonVersion), "upgrade dmuond"}) {
    EXPECT_NE(st.error_message().find(part), std::string::npos)
        << part << ": " << st.error_message();
  }
  // This client's own minor is served, and the daemon says its minor.
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto s = Open(*c, "current", Resume::kFresh);
  EXPECT_TRUE(s.ok()) << s.status();
}

TEST(VersionSkew, AResumeModeAgainstAMinor0DaemonIsRefusedClientSide) {
  const std::string dir = TempDir("old-resume");
  Daemon prev({"--state-dir=" + dir}, "daemon/dmuond_minor0");
  ASSERT_NE(prev.port(), 0) << prev.log();
  auto c = Connect(prev);
  ASSERT_TRUE(c);
  {
    auto s = Open(*c, "held", Resume::kAuto);
    ASSERT_TRUE(s.ok()) << s.status();
    Step(**s, 7);
    ASSERT_TRUE((*s)->Close().ok());
  }
  for (Resume r : {Resume::kFresh, Resume::kContinue, Resume::kReplace}) {
    ExpectHas(Open(*c, "held", r).status(),
              absl::StatusCode::kFailedPrecondition,
              {"dmuond at " + prev.address(), "speaks protocol 1.0",
               absl::StrCat("this client (version ", kDmuonVersion,
                            ", protocol 1.", kProtocolMinor, ")"),
               "needs protocol 1.1", "upgrade dmuond", "Resume::kAuto"});
  }
  // Nothing was replaced or restarted: the job continues at step 2, and the
  // sessions the refusals opened were closed (one open now, this one).
  auto s = Open(*c, "held", Resume::kAuto);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->step(), 2);
}

// A SHARDING_BLOCKS parameter (minor 3) sent to a daemon of an older minor
// (a 1.0 one, which refuses no client) is refused by the daemon as an
// unknown sharding; the client's error says what to do (a daemon that
// served it regardless would be refused client-side, CheckDaemonMinor).
TEST(VersionSkew, BlocksAgainstAMinor0DaemonAreRefusedSayingWhatToDo) {
  Daemon old({}, "daemon/dmuond_minor0");
  ASSERT_NE(old.port(), 0) << old.log();
  auto c = Connect(old);
  ASSERT_TRUE(c);
  SessionSpec spec;
  spec.job_id = "minor0-blocks";
  spec.world_size = 1;
  spec.transport = TransportChoice::kShm;
  ParamSpec p{"dtensor.w", 6, 4, Sharding::kBlocks};
  p.row_runs = {{3, 6}, {0, 3}};
  p.col_runs = {{0, 4}};
  spec.params = {p};
  ExpectHas(
      c->OpenSession(spec).status(), absl::StatusCode::kInvalidArgument,
      {"'dtensor.w' sharding 4 is unknown", "'dtensor.w' as SHARDING_BLOCKS",
       "needs protocol 1.3", "upgrade dmuond"});
  // The same table replicated is served.
  spec.params[0].sharding = Sharding::kReplicated;
  EXPECT_TRUE(c->OpenSession(spec).ok());
}

// The other minor-1 messages, and a Mark (minor 5), are refused by this
// client before they reach a minor-0 daemon, which would ignore them: an
// absent parameter would be waited for forever, a rewind read as an unknown
// message, a Mark answered UNIMPLEMENTED without naming versions.
TEST(VersionSkew, AbsentRewindAndMarkAgainstAMinor0DaemonAreRefusedClientSide) {
  Daemon prev({}, "daemon/dmuond_minor0");
  ASSERT_NE(prev.port(), 0) << prev.log();
  auto c = Connect(prev);
  ASSERT_TRUE(c);
  auto s = Open(*c, "minor0", Resume::kAuto);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->daemon_protocol_minor(), 0u);
  Step(**s, 11);
  ExpectHas((*s)->Mark(0).status(), absl::StatusCode::kFailedPrecondition,
            {"Mark (of the step the job is at)", "needs protocol 1.5",
             prev.address(), "speaks protocol 1.0",
             absl::StrCat("protocol 1.", kProtocolMinor), "upgrade dmuond"});
  ExpectHas((*s)->Mark(-1).status(), absl::StatusCode::kInvalidArgument,
            {"step must be", "got -1"});
  ExpectHas((*s)->Rewind(), absl::StatusCode::kFailedPrecondition,
            {"Rewind needs protocol minor 1", prev.address(), "upgrade it"});
  const int last = static_cast<int>(kTable.size()) - 1;
  ExpectHas(
      (*s)->GradientsAbsent({last}), absl::StatusCode::kFailedPrecondition,
      {"needs protocol minor 1", prev.address(), "speaks minor 0",
       absl::StrCat("this client ", kProtocolMinor), "upgrade the daemon"});
  // Nothing was sent: the step still runs with every gradient.
  Step(**s, 12);
  EXPECT_EQ((*s)->step(), 3);
}

// A resume step (minor 4) would be ignored by an older daemon, which would
// continue from whatever step the job is at: refused, naming both versions.
TEST(VersionSkew, AResumeStepAgainstAnOlderDaemonIsRefused) {
  Daemon old({}, "daemon/dmuond_minor0");
  ASSERT_NE(old.port(), 0) << old.log();
  auto c = Connect(old);
  ASSERT_TRUE(c);
  auto s = Open(*c, "minor0-step", Resume::kAuto);
  ASSERT_TRUE(s.ok()) << s.status();
  Step(**s, 31);
  ASSERT_TRUE((*s)->Close().ok());
  SessionSpec spec;
  spec.job_id = "minor0-step";
  spec.world_size = kWorld;
  spec.params = kTable;
  spec.transport = TransportChoice::kShm;
  spec.resume_step = 1;
  ExpectHas(c->OpenSession(spec).status(),
            absl::StatusCode::kFailedPrecondition,
            {"asked to resume at step 1", "needs protocol 1.4",
             "speaks protocol 1.0", "upgrade dmuond"});
}

// A per-step momentum (minor 2, GradientsReady.momentum) is refused by this
// client before it reaches a daemon that would ignore it and use each
// group's momentum: the error names both versions, nothing is sent.
// dmuond_prev (the previous minor) refuses this client at OpenSession
// already, naming both versions (a client of a newer minor); a minor-0 one
// serves it.
TEST(VersionSkew, APerStepMomentumAgainstAnOlderDaemonIsRefused) {
  static_assert(kProtocolMinor >= 2, "the minor-0 daemon must lack momentum");
  {
    Daemon prev({}, "daemon/dmuond_prev");
    ASSERT_NE(prev.port(), 0) << prev.log();
    auto c = Connect(prev);
    ASSERT_TRUE(c);
    ExpectHas(Open(*c, "minor1", Resume::kAuto).status(),
              absl::StatusCode::kFailedPrecondition,
              {absl::StrCat("client speaks protocol 1.", kProtocolMinor),
               absl::StrCat("dmuond speaks protocol 1.", kProtocolMinor - 1),
               "upgrade dmuond"});
  }
  Daemon old({}, "daemon/dmuond_minor0");
  ASSERT_NE(old.port(), 0) << old.log();
  auto c = Connect(old);
  ASSERT_TRUE(c);
  auto s = Open(*c, "minor0-momentum", Resume::kAuto);
  ASSERT_TRUE(s.ok()) << s.status();
  Step(**s, 21);
  const std::vector<double> beta = {0.9};
  ExpectHas(
      (*s)->GradientsReadyWithMomentum({0}, beta),
      absl::StatusCode::kFailedPrecondition,
      {"per-step momentum", "needs protocol minor 2", old.address(),
       "speaks protocol 1.0", absl::StrCat("this client 1.", kProtocolMinor),
       "upgrade the daemon"});
  // Without one (each group's momentum) the step runs as before.
  Step(**s, 22);
  EXPECT_EQ((*s)->step(), 3);
}

}  // namespace
}  // namespace dmuon::testing
