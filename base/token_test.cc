// CheckToken: the one rule for a token's bytes.

#include "base/token.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace dmuon {
namespace {

TEST(CheckToken, VisibleAsciiIsATokenAndNothingElse) {
  std::mt19937 rng(std::random_device{}());
  std::string good;
  for (int c = 0x21; c <= 0x7e; ++c) good += static_cast<char>(c);
  EXPECT_TRUE(CheckToken(good, "token").ok());
  EXPECT_TRUE(CheckToken(std::string(kMaxTokenBytes, 'a'), "token").ok());
  for (int c = 0; c < 256; ++c) {
    if (c >= 0x21 && c <= 0x7e) continue;
    std::string t = good;
    const size_t at = rng() % (t.size() + 1);
    t.insert(at, 1, static_cast<char>(c));
    const absl::Status st = CheckToken(t, "--token-file=f");
    ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c;
    const std::string msg(st.message());
    EXPECT_EQ(msg.rfind("--token-file=f has byte 0x", 0), 0u) << msg;
    EXPECT_NE(msg.find("at position " + std::to_string(at)), std::string::npos)
        << msg;
    EXPECT_EQ(msg.find(good), std::string::npos) << "the token is not shown";
  }
  EXPECT_FALSE(CheckToken("", "token").ok());
  EXPECT_FALSE(CheckToken(std::string(kMaxTokenBytes + 1, 'a'), "token").ok());
}

}  // namespace
}  // namespace dmuon
