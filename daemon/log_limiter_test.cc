#include "daemon/log_limiter.h"

#include <gtest/gtest.h>

#include <string>

namespace dmuon {
namespace {

TEST(PeerHost, DropsThePortOnly) {
  EXPECT_EQ(PeerHost("ipv4:10.0.0.1:5432"), "ipv4:10.0.0.1");
  EXPECT_EQ(PeerHost("ipv6:[::1]:80"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("ipv6:[2001:db8::7]:65535"), "ipv6:[2001:db8::7]");
  // As gRPC 1.51 writes them: brackets percent-encoded.
  EXPECT_EQ(PeerHost("ipv6:%5B::1%5D:55930"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5B2001:db8::7%5D:443"), "ipv6:[2001:db8::7]");
  EXPECT_EQ(PeerHost("unix:/tmp/s.sock"), "unix:/tmp/s.sock");
  EXPECT_EQ(PeerHost("ipv4:10.0.0.1"), "ipv4:10.0.0.1");
  EXPECT_EQ(PeerHost(""), "");
}

TEST(LogLimiter, ABurstThenTheRateAndTheCountOfWhatWasDropped) {
  LogLimiter l(/*per_second=*/2, /*burst=*/5, /*max_peers=*/16);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t dropped = -1;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(l.Allow("ipv4:1.2.3.4:" + std::to_string(1000 + i), t0,
                        &dropped));  // other ports: the same peer
    EXPECT_EQ(dropped, 0);
  }
  for (int i = 0; i < 100; ++i)
    EXPECT_FALSE(l.Allow("ipv4:1.2.3.4:9", t0, &dropped));
  // Another peer is not held back by the first.
  EXPECT_TRUE(l.Allow("ipv4:5.6.7.8:1", t0, &dropped));
  // Half a second later: one line, saying what it stood for.
  ASSERT_TRUE(
      l.Allow("ipv4:1.2.3.4:9", t0 + absl::Milliseconds(500), &dropped));
  EXPECT_EQ(dropped, 100);
  EXPECT_FALSE(
      l.Allow("ipv4:1.2.3.4:9", t0 + absl::Milliseconds(500), &dropped));
  // A long pause refills the burst, never more.
  const absl::Time later = t0 + absl::Hours(1);
  for (int i = 0; i < 5; ++i)
    EXPECT_TRUE(l.Allow("ipv4:1.2.3.4:9", later, &dropped));
  EXPECT_FALSE(l.Allow("ipv4:1.2.3.4:9", later, &dropped));
}

TEST(LogLimiter, RemembersAtMostMaxPeersForgettingTheOldest) {
  LogLimiter l(1, 1, /*max_peers=*/3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t dropped;
  for (int i = 0; i < 1000; ++i) {
    l.Allow("ipv4:10.0." + std::to_string(i / 256) + "." +
                std::to_string(i % 256) + ":1",
            t0 + absl::Milliseconds(i), &dropped);
    ASSERT_LE(l.peers(), 3u);
  }
  // The most recent ones are the ones remembered: 10.0.3.231 spent its
  // line.
  EXPECT_FALSE(
      l.Allow("ipv4:10.0.3.231:2", t0 + absl::Milliseconds(999), &dropped));
}

}  // namespace
}  // namespace dmuon
