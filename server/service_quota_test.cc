// Per-principal quotas (quota.h) as OpenSession applies them: a new job
// over its owner's max_jobs or max_state_bytes is RESOURCE_EXHAUSTED naming
// the quota; other principals, joins and anonymous callers are not held to
// it; an idle job still counts.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/principal.h"
#include "server/service.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

// 16 x 32 fp32: 2048 bytes of momentum per job.
const std::vector<Param> kTable = {{"w", 16, 32, v1::SHARDING_REPLICATED}};
constexpr uint64_t kJobBytes = 16 * 32 * 4;

v1::OpenSessionRequest Job(const std::string& id, int world = 1) {
  return Request(id, 0, world, v1::TRANSPORT_INLINE, kTable);
}

Principal Named(const std::string& name, Quotas q) {
  Principal p;
  p.name = name;
  p.quotas = q;
  return p;
}

TEST(Quota, MaxJobsRefusesTheNextNewJobNamingTheQuota) {
  auto svc = NewService();
  const Principal a = Named("team-a", {2, 0});
  ASSERT_TRUE(svc->OpenSession(Job("a1"), a).ok());
  auto second = svc->OpenSession(Job("a2"), a);
  ASSERT_TRUE(second.ok()) << second.status();
  const absl::Status st = svc->OpenSession(Job("a3"), a).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(std::string(st.message())
                .rfind("principal 'team-a' is at its quota of 2 jobs "
                       "(max_jobs)",
                       0),
            0u)
      << st;
  // Another principal, and an anonymous caller, are not held to it.
  EXPECT_TRUE(svc->OpenSession(Job("b1"), Named("team-b", {1, 0})).ok());
  EXPECT_TRUE(svc->OpenSession(Job("anon"), Principal{}).ok());
  // An idle job still counts (its momentum is held)...
  ASSERT_TRUE(svc->CloseSession(second->session_id()).ok());
  EXPECT_EQ(svc->OpenSession(Job("a3"), a).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(Quota, JoiningAJobIsNotCreatingOne) {
  auto svc = NewService();
  const Principal a = Named("team-a", {1, 0});
  ASSERT_TRUE(svc->OpenSession(Job("two", 2), a).ok());
  auto r1 =
      svc->OpenSession(Request("two", 1, 2, v1::TRANSPORT_INLINE, kTable), a);
  EXPECT_TRUE(r1.ok()) << r1.status();
}

TEST(Quota, MaxStateBytesCountsEveryJobOfThePrincipal) {
  auto svc = NewService();
  const Principal a = Named("team-a", {0, 2 * kJobBytes + 100});
  ASSERT_TRUE(svc->OpenSession(Job("a1"), a).ok());
  ASSERT_TRUE(svc->OpenSession(Job("a2"), a).ok());
  const absl::Status st = svc->OpenSession(Job("a3"), a).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(std::string(st.message())
                .find("principal 'team-a' would hold 6144 bytes of momentum"),
            std::string::npos)
      << st;
  EXPECT_NE(std::string(st.message()).find("(max_state_bytes)"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace dmuon::server::testing
