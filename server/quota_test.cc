#include "server/quota.h"

#include <gtest/gtest.h>

namespace dmuon::server {
namespace {

TEST(CheckQuota, NoQuotasAdmitsAnything) {
  EXPECT_TRUE(CheckQuota("a", Quotas{}, {1000, 1ull << 40}, 1ull << 40).ok());
}

TEST(CheckQuota, JobsAtTheQuotaAreRefusedNamingIt) {
  const Quotas q{2, 0};
  EXPECT_TRUE(CheckQuota("team-a", q, {1, 0}, 8).ok());
  const absl::Status st = CheckQuota("team-a", q, {2, 0}, 8);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(st.message())
                .rfind("principal 'team-a' is at its quota of 2 jobs "
                       "(max_jobs)",
                       0),
            0u)
      << st;
}

TEST(CheckQuota, StateBytesOverTheQuotaAreRefusedNamingIt) {
  const Quotas q{0, 1000};
  EXPECT_TRUE(CheckQuota("b", q, {3, 600}, 400).ok());  // exactly at it
  const absl::Status st = CheckQuota("b", q, {3, 600}, 404);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(st.message())
                .find("over its quota of 1000 bytes "
                      "(max_state_bytes)"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace dmuon::server
