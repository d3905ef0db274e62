// Fair share with a real dmuond (issue 28 part 1): two trainers, each its
// own job and principal, keep one CPU executor backlogged with steps of
// 48 matrices of distinct shapes (48 batches); their shares of the executor's
// time, read from Status (device_seconds, the scheduler's own accounting) over
// a window while both run, follow the principals' weights from the token file.
// The trainers are client threads of this process (the client library over
// shm), the daemon a process.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

// Matrices per step, each of its own shape: one batch each, so that a
// trainer's step keeps its job backlogged for 48 batches (a step of one
// batch would let a job use only what its one batch in flight asks). Each
// step costs the executor about 100 ms: the client's turn-around between
// steps (its job is then not backlogged and the other gets the executor)
// must be small beside it, also on a loaded machine (with 10 ms steps a CI
// run measured 64/36 at 1:1).
constexpr int kMatrices = 48;
constexpr int kCols = 256;

// Runs steps of job `job` as `token` until `stop`; counts them in `steps`.
void Trainer(const std::string& address, const std::string& token,
             const std::string& job, const std::atomic<bool>& stop,
             std::atomic<int>& steps, std::string& error) {
  ClientOptions o;
  o.token = token;
  auto client = Client::Connect(address, o);
  if (!client.ok()) {
    error = client.status().ToString();
    return;
  }
  SessionSpec spec;
  spec.job_id = job;
  for (int i = 0; i < kMatrices; ++i)
    spec.params.push_back({"w" + std::to_string(i), 96 + 4 * i, kCols,
                           Sharding::kReplicated, 0, 0, i, 0});
  auto s = (*client)->OpenSession(spec);
  if (!s.ok()) {
    error = s.status().ToString();
    return;
  }
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n;
  std::vector<int> ids;
  for (int i = 0; i < kMatrices; ++i) {
    for (float& x : (*s)->gradient(i)) x = n(rng);
    ids.push_back(i);
  }
  while (!stop) {
    absl::Status st = (*s)->GradientsReady(ids);
    if (st.ok()) st = (*s)->FinishStep();
    if (!st.ok()) {
      error = st.ToString();
      return;
    }
    ++steps;
  }
  (void)(*s)->Close();
}

// device_seconds by job id, as the operator sees them.
std::map<std::string, double> DeviceSeconds(v1::Optimizer::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer op-token");
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatusResponse r;
  EXPECT_TRUE(stub.Status(&ctx, v1::StatusRequest(), &r).ok());
  std::map<std::string, double> out;
  for (const auto& j : r.jobs()) out[j.job_id()] = j.device_seconds();
  return out;
}

// a's share of the executor's time over a window of both trainers' steps
// (-1: no daemon).
// `quotas`: --quotas-file's text (empty: none).
double ShareOfA(double weight_a, double weight_b,
                const std::string& quotas = "") {
  const std::string tokens = TempDir("share") + "/tokens";
  std::ofstream(tokens) << "operator op-token\n"
                        << "trainer a-token alice weight=" << weight_a << "\n"
                        << "trainer b-token bob weight=" << weight_b << "\n";
  std::vector<std::string> flags = {"--auth-token-file=" + tokens,
                                    "--cpu-executors=1", "--cpu-threads=1"};
  if (!quotas.empty()) {
    std::ofstream(tokens + ".quotas") << quotas;
    flags.push_back("--quotas-file=" + tokens + ".quotas");
  }
  Daemon d(flags);
  if (d.port() == 0) {
    ADD_FAILURE() << "dmuond did not start: " << d.log();
    return -1;
  }
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  std::atomic<bool> stop{false};
  std::atomic<int> steps_a{0}, steps_b{0};
  std::string error_a, error_b;
  std::thread a(Trainer, d.address(), "a-token", "job-a", std::cref(stop),
                std::ref(steps_a), std::ref(error_a));
  std::thread b(Trainer, d.address(), "b-token", "job-b", std::cref(stop),
                std::ref(steps_b), std::ref(error_b));
  auto both_past = [&](int n) {
    while (error_a.empty() && error_b.empty() && (steps_a < n || steps_b < n)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  both_past(2);  // both opened and running
  const auto first = DeviceSeconds(*stub);
  const int a0 = steps_a, b0 = steps_b;
  both_past(std::max(a0, b0) + 8);
  const auto last = DeviceSeconds(*stub);
  stop = true;
  a.join();
  b.join();
  EXPECT_EQ(error_a, "");
  EXPECT_EQ(error_b, "");
  const double da = last.at("job-a") - first.at("job-a");
  const double db = last.at("job-b") - first.at("job-b");
  std::printf("weights %g:%g: a %.3f s, b %.3f s of device time\n", weight_a,
              weight_b, da, db);
  return da / (da + db);
}

TEST(FairShare, EqualWeightsHalfEach) {
  const double share = ShareOfA(1, 1);
  EXPECT_GE(share, 0.45);
  EXPECT_LE(share, 0.55);
}

TEST(FairShare, WeightsThreeToOne) {
  const double share = ShareOfA(3, 1);
  EXPECT_GE(share, 0.70);
  EXPECT_LE(share, 0.80);
}

// alice's weight is 3 (75 % by weight), but the quotas file caps her
// share at 30 % while bob's job is backlogged.
TEST(FairShare, DeviceShareQuotaCapsAPrincipal) {
  const double share = ShareOfA(3, 1, "alice max_device_share=0.3\n");
  EXPECT_GE(share, 0.25);
  EXPECT_LE(share, 0.35);
}

}  // namespace
}  // namespace dmuon::testing
