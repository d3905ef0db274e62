// The update doorbell (doorbell.h): its words' encoding on fresh random
// values, its place in a shm segment, an announcement seen by another
// process that waits on the futex (with the update's bytes written before
// it), and the errors: no doorbell, a parameter outside it, a segment the
// client shrank (DATA_LOSS, never SIGBUS).

#include "transport/doorbell.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "transport/transport.h"

namespace dmuon::transport {
namespace {

TEST(DoorbellWord, RoundTripsFreshRandomFields) {
  std::mt19937_64 rng(std::random_device{}());
  for (int k = 0; k < 10000; ++k) {
    DoorbellWord w;
    w.serial = static_cast<uint32_t>(rng()) &
               ((uint32_t{1} << kDoorbellSerialBits) - 1);
    w.step = 1 + static_cast<int64_t>(rng() % kMaxDoorbellStep);
    w.skipped = rng() & 1;
    w.absent = rng() & 1;
    const DoorbellWord back = DecodeWord(EncodeWord(w));
    ASSERT_EQ(back.serial, w.serial);
    ASSERT_EQ(back.step, w.step);
    ASSERT_EQ(back.skipped, w.skipped);
    ASSERT_EQ(back.absent, w.absent);
  }
  // The serial wraps; the step's bits never reach the serial's.
  DoorbellWord w;
  w.serial = uint32_t{1} << kDoorbellSerialBits;
  w.step = kMaxDoorbellStep;
  EXPECT_EQ(DecodeWord(EncodeWord(w)).serial, 0u);
  EXPECT_EQ(DecodeWord(EncodeWord(w)).step, kMaxDoorbellStep);
  EXPECT_FALSE(DoorbellStepFits(0));
  EXPECT_TRUE(DoorbellStepFits(kMaxDoorbellStep));
  EXPECT_FALSE(DoorbellStepFits(kMaxDoorbellStep + 1));
}

TEST(DoorbellBytes, AlignedAndHoldsEveryWord) {
  for (int n : {0, 1, 7, 8, 9, 1000}) {
    const uint64_t b = DoorbellBytes(n);
    EXPECT_EQ(b % kAlignment, 0u) << n;
    EXPECT_GE(b, DoorbellWordOffset(n)) << n;
    EXPECT_LT(b, DoorbellWordOffset(n) + kAlignment) << n;
  }
}

TEST(ShmDoorbell, AfterTheTensorsAndOnlyWhereAsked) {
  auto r = CreateShmRegion(4096, 5);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->doorbell_offset(), 4096);
  EXPECT_EQ((*r)->bytes().size(), 4096 + DoorbellBytes(5));
  EXPECT_EQ((*r)->Announce(5, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*r)->Announce(-1, 1).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(UnlinkShm((*r)->name()).ok());

  auto plain = CreateShmRegion(4096);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->doorbell_offset(), -1);
  EXPECT_EQ((*plain)->bytes().size(), 4096u);
  EXPECT_EQ((*plain)->Announce(0, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(UnlinkShm((*plain)->name()).ok());
  EXPECT_EQ(NewHeapRegion(64)->Announce(0, 1).code(),
            absl::StatusCode::kFailedPrecondition);

  auto odd = CreateShmRegion(100, 1);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
}

// Another process maps the segment, waits on the counter until parameter
// 2's word names step 7, then checks the bytes written before it.
TEST(ShmDoorbell, AnotherProcessWakesToTheWordAndTheBytesBeforeIt) {
  constexpr int kParams = 4;
  constexpr uint64_t kTensors = 64 * 1024;
  auto r = CreateShmRegion(kTensors, kParams);
  ASSERT_TRUE(r.ok()) << r.status();
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint64_t> payload(kTensors / 8);
  for (auto& x : payload) x = rng();
  DoorbellWord want;
  want.serial = 3;
  want.step = 7;
  const std::string name = (*r)->name();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = OpenShmRegion(name, kTensors + DoorbellBytes(kParams));
    if (!mine.ok()) ::_exit(2);
    DoorbellView v((*mine)->bytes().data() + kTensors, kParams);
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (DecodeWord(v.word(2)).step != 7) {
      if (std::chrono::steady_clock::now() > until) ::_exit(3);
      v.Wait(v.counter(), std::chrono::milliseconds(100));
    }
    const bool same =
        std::memcmp((*mine)->bytes().data(), payload.data(), kTensors) == 0;
    ::_exit(same && v.word(2) == EncodeWord(want) && v.counter() == 1 ? 0 : 4);
  }
  // Give the child time to be waiting (the test holds either way).
  ::usleep(100 * 1000);
  ASSERT_TRUE((*r)->Write(0, payload.data(), kTensors).ok());
  ASSERT_TRUE((*r)->Announce(2, EncodeWord(want)).ok());
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  ASSERT_TRUE(UnlinkShm(name).ok());
}

TEST(ShmDoorbell, ShrunkSegmentIsDataLossNotSigbus) {
  auto r = CreateShmRegion(4096, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  const int fd = ::shm_open((*r)->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ::close(fd);
  DoorbellWord w;
  w.step = 1;
  EXPECT_EQ((*r)->Announce(1, EncodeWord(w)).code(),
            absl::StatusCode::kDataLoss);
  ASSERT_TRUE(UnlinkShm((*r)->name()).ok());
}

}  // namespace
}  // namespace dmuon::transport
