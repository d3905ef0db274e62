#include "daemon/auth.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dmuon::server {
namespace {

TEST(ParseTokens, RolesNamesAndComments) {
  auto t = ParseTokens(
      "# comment\n\nreader r-token\n  trainer\tt-token alice \noperator o-t\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 3u);
  int readers = 0, named = 0;
  for (const auto& [digest, e] : *t) {
    EXPECT_EQ(digest.size(), 32u);  // a SHA-256, never the token
    EXPECT_EQ(digest.find("token"), std::string::npos);
    if (e.role == Role::kReader) ++readers;
    if (e.name == "alice") {
      ++named;
      EXPECT_EQ(e.role, Role::kTrainer);
    } else {
      EXPECT_EQ(e.name.rfind("token-", 0), 0u) << e.name;
      EXPECT_EQ(e.name.size(), 22u);
      // 8 bytes of a SHA-256 in lowercase hex.
      EXPECT_EQ(e.name.find_first_not_of("0123456789abcdef", 6),
                std::string::npos)
          << e.name;
    }
  }
  EXPECT_EQ(readers, 1);
  EXPECT_EQ(named, 1);
}

TEST(ParseTokens, UnnamedTokensGetDistinctStableNames) {
  auto a = ParseTokens("trainer one\ntrainer two\n");
  auto b = ParseTokens("trainer one\n");
  ASSERT_TRUE(a.ok() && b.ok());
  std::set<std::string> names;
  for (const auto& [d, e] : *a) names.insert(e.name);
  EXPECT_EQ(names.size(), 2u);
  EXPECT_TRUE(names.count(b->begin()->second.name));
}

TEST(ParseTokens, Weights) {
  auto t = ParseTokens(
      "trainer a team-a weight=3\nreader b team-a weight=3\n"
      "trainer c team-b\ntrainer d weight=0.5\n");
  ASSERT_TRUE(t.ok()) << t.status();
  std::map<std::string, double> by_name;
  for (const auto& [digest, e] : *t) by_name[e.name] = e.weight;
  ASSERT_EQ(by_name.size(), 3u);
  EXPECT_EQ(by_name["team-a"], 3);
  EXPECT_EQ(by_name["team-b"], 1);  // the default
  by_name.erase("team-a");
  by_name.erase("team-b");
  EXPECT_EQ(by_name.begin()->second, 0.5);  // unnamed: token-<hex>
  EXPECT_EQ(by_name.begin()->first.rfind("token-", 0), 0u);
}

TEST(ParseTokens, Quotas) {
  auto t = ParseTokens(
      "trainer a team-a max_state_bytes=4096 max_jobs=2 weight=2\n"
      "trainer b team-b\n");
  ASSERT_TRUE(t.ok()) << t.status();
  for (const auto& [digest, e] : *t) {
    if (e.name == "team-a") {
      EXPECT_EQ(e.quotas.max_jobs, 2);
      EXPECT_EQ(e.quotas.max_state_bytes, 4096u);
      EXPECT_EQ(e.weight, 2);
    } else {
      EXPECT_EQ(e.quotas, Quotas{});
    }
  }
}

TEST(ParseTokens, ErrorsNameTheLine) {
  for (const auto& [text, want] :
       std::vector<std::pair<std::string, std::string>>{
           {"reader a\nadmin b\n", "line 2: role 'admin'"},
           {"trainer a team weight=fast\n",
            "line 1: weight 'fast' is not a number in [0.01, 1000]"},
           {"trainer a team weight=0\n", "line 1: weight '0' is not"},
           {"trainer a team weight=1e9\n", "line 1: weight '1e9' is not"},
           {"trainer a team weight=nan\n", "line 1: weight 'nan' is not"},
           {"trainer a team weight=2 x\n", "line 1: expected"},
           {"trainer a team weight=2\nreader b team weight=3\n",
            "line 2: the weight or quotas of principal 'team' differ"},
           {"trainer a team max_jobs=2\nreader b team\n",
            "line 2: the weight or quotas of principal 'team' differ"},
           {"trainer a team max_jobs=0\n",
            "line 1: max_jobs '0' is not a positive integer"},
           {"trainer a team max_state_bytes=1G\n",
            "line 1: max_state_bytes '1G' is not a positive integer"},
           {"trainer a team color=red\n", "line 1: unknown option 'color'"},
           {"reader\n", "line 1: expected"},
           {"reader a b c\n", "line 1: expected"},
           {"reader a\ntrainer a\n", "line 2: the same token twice"},
           // What no client could send (gRPC refuses the header).
           {"reader ok\ntrainer t\xc3\xa9\n",
            "line 2: the token has byte 0xc3"},
           {"reader a\x01"
            "b\n",
            "line 1: the token has byte 0x01"},
       }) {
    auto t = ParseTokens(text);
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(std::string(t.status().message()).rfind(want, 0), 0u)
        << t.status();
  }
}

TEST(Authenticator, MissingFileNamesTheFlag) {
  auto a = Authenticator::Create("/nonexistent/tokens", false);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(std::string(a.status().message()).find("--auth-token-file"),
            std::string::npos);
}

TEST(Principal, OwnersAndOperators) {
  const Principal alice{"alice", false}, bob{"bob", false}, op{"op", true};
  EXPECT_TRUE(CheckJobOwner(alice, "alice", "j").ok());
  EXPECT_TRUE(CheckJobOwner(alice, "", "j").ok());
  EXPECT_TRUE(CheckJobOwner(op, "alice", "j").ok());
  EXPECT_TRUE(CheckJobOwner(Principal{}, "alice", "j").ok());
  const absl::Status st = CheckJobOwner(bob, "alice", "j");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(std::string(st.message()).find("alice"), std::string::npos);
}

}  // namespace
}  // namespace dmuon::server
