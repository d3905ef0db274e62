#include "transport/sigbus_guard.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dmuon::transport {
namespace {

constexpr size_t kBytes = 1 << 20;

// A tmpfs file (memfd: what shm segments are) of kBytes, mapped shared.
class Mapped {
 public:
  Mapped() {
    fd_ = ::memfd_create("sigbus-guard-test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(::ftruncate(fd_, kBytes), 0) << std::strerror(errno);
    void* p =
        ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED) << std::strerror(errno);
    base_ = static_cast<std::byte*>(p);
  }
  ~Mapped() {
    ::munmap(base_, kBytes);
    ::close(fd_);
  }
  // What a client does to the segment it shares: its pages past `bytes`
  // are gone, and touching them through the mapping raises SIGBUS.
  void Shrink(size_t bytes) { ASSERT_EQ(::ftruncate(fd_, bytes), 0); }
  std::byte* base() const { return base_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::byte* base_ = nullptr;
};

std::vector<char> Random(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (char& c : v) c = static_cast<char>(rng());
  return v;
}

TEST(GuardedMapping, CopiesBothWaysThroughTheFile) {
  Mapped m;
  GuardedMapping g(m.base(), kBytes);
  const std::vector<char> in = Random(kBytes / 2, 1);
  ASSERT_TRUE(g.CopyIn(kBytes / 4, in.data(), in.size()));
  // The bytes are the file's: read back through the descriptor.
  std::vector<char> file(in.size());
  ASSERT_EQ(::pread(m.fd(), file.data(), file.size(), kBytes / 4),
            static_cast<ssize_t>(file.size()));
  EXPECT_EQ(file, in);
  std::vector<char> out(in.size());
  ASSERT_TRUE(g.CopyOut(kBytes / 4, out.data(), out.size()));
  EXPECT_EQ(out, in);
  EXPECT_TRUE(g.CopyOut(kBytes, nullptr, 0));  // empty, at the end
  EXPECT_FALSE(g.broken());
}

// The doorbell's atomic stores, ors and takes (doorbell.h) land in the
// file, and on a page the client cut off they fail as a copy does, the
// process alive.
TEST(GuardedMapping, AtomicStoresThroughTheFileAndAfterAShrink) {
  Mapped m;
  GuardedMapping g(m.base(), kBytes);
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t word = rng();
  ASSERT_TRUE(g.Store64(8192, word));
  ASSERT_TRUE(g.Increment32(8200));
  ASSERT_TRUE(g.Increment32(8200));
  uint64_t file_word = 0;
  uint32_t file_counter = 0;
  ASSERT_EQ(::pread(m.fd(), &file_word, 8, 8192), 8);
  ASSERT_EQ(::pread(m.fd(), &file_counter, 4, 8200), 4);
  EXPECT_EQ(file_word, word);
  EXPECT_EQ(file_counter, 2u);
  // Or64 sets bits in the file's word; Take64s reads them and leaves 0.
  const uint64_t a = rng(), b = rng();
  ASSERT_TRUE(g.Store64(8208, a));
  ASSERT_TRUE(g.Or64(8208, b));
  ASSERT_TRUE(g.Store64(8216, b));
  uint64_t taken[2] = {0, 0};
  ASSERT_TRUE(g.Take64s(8208, taken, 2));
  EXPECT_EQ(taken[0], a | b);
  EXPECT_EQ(taken[1], b);
  uint64_t file_words[2] = {1, 1};
  ASSERT_EQ(::pread(m.fd(), file_words, 16, 8208), 16);
  EXPECT_EQ(file_words[0], 0u);
  EXPECT_EQ(file_words[1], 0u);
  // Gather64s loads the words at the indices given, in their order.
  const uint64_t c = rng();
  ASSERT_TRUE(g.Store64(8208, c));
  const int index[] = {3, 0, 2, 3};  // 8216, 8192, 8208, 8216
  uint64_t gathered[4] = {1, 1, 1, 1};
  ASSERT_TRUE(g.Gather64s(8192, index, 4, gathered));
  EXPECT_EQ(gathered[0], 0u);  // 8216: nothing stored there since the take
  EXPECT_EQ(gathered[1], word);
  EXPECT_EQ(gathered[2], c);
  EXPECT_EQ(gathered[3], 0u);
  m.Shrink(4096);
  EXPECT_FALSE(g.Store64(8192, word));
  EXPECT_TRUE(g.broken());
  EXPECT_FALSE(g.Increment32(0));  // lost: every later store fails too
  EXPECT_FALSE(g.Or64(0, 1));
  EXPECT_FALSE(g.Take64s(0, taken, 1));
  EXPECT_FALSE(g.Gather64s(0, index, 1, gathered));

  // A gather that is the first access past the new end fails by itself
  // (not only because the mapping was already lost).
  Mapped cut;
  GuardedMapping h(cut.base(), kBytes);
  cut.Shrink(4096);
  const int past[] = {0, 1030};  // 8 * 1030 = 8240: past 4096
  EXPECT_FALSE(h.Gather64s(0, past, 2, gathered));
  EXPECT_TRUE(h.broken());
}

// The client shrank the segment after it was mapped: a copy that touches
// a page past the new end fails instead of killing the process, and the
// mapping stays lost (zero pages, not the file) for every later copy.
TEST(GuardedMapping, ShrinkUnderACopyFailsIt) {
  Mapped m;
  GuardedMapping g(m.base(), kBytes);
  const std::vector<char> in = Random(kBytes, 2);
  ASSERT_TRUE(g.CopyIn(0, in.data(), kBytes));
  m.Shrink(4096);
  std::vector<char> out(kBytes);
  EXPECT_FALSE(g.CopyOut(0, out.data(), kBytes));  // faults at byte 4096
  EXPECT_TRUE(g.broken());
  EXPECT_FALSE(g.CopyOut(0, out.data(), 16));  // inside what is left: lost
  EXPECT_FALSE(g.CopyIn(kBytes / 2, in.data(), 4096));
}

TEST(GuardedMapping, WriteIntoAShrunkSegmentFails) {
  Mapped m;
  GuardedMapping g(m.base(), kBytes);
  m.Shrink(0);
  const std::vector<char> in = Random(8192, 3);
  EXPECT_FALSE(g.CopyIn(kBytes - 8192, in.data(), in.size()));
  EXPECT_TRUE(g.broken());
  struct stat st;
  ASSERT_EQ(::fstat(m.fd(), &st), 0);
  EXPECT_EQ(st.st_size, 0);  // nothing grew the file back
}

// One region's fault is that region's: another mapping copies on.
TEST(GuardedMapping, OtherMappingsAreUntouched) {
  Mapped a, b;
  GuardedMapping ga(a.base(), kBytes), gb(b.base(), kBytes);
  const std::vector<char> in = Random(kBytes, 4);
  ASSERT_TRUE(gb.CopyIn(0, in.data(), kBytes));
  a.Shrink(0);
  std::vector<char> out(kBytes);
  EXPECT_FALSE(ga.CopyOut(0, out.data(), 4096));
  EXPECT_FALSE(gb.broken());
  ASSERT_TRUE(gb.CopyOut(0, out.data(), kBytes));
  EXPECT_EQ(out, in);
}

// Executors copy from one region on several threads at once: every copy
// past the end fails, none kills the process.
TEST(GuardedMapping, ConcurrentCopiesAllFail) {
  Mapped m;
  GuardedMapping g(m.base(), kBytes);
  m.Shrink(kBytes / 2);
  std::vector<int> ok(8, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> out(kBytes / 4);
      ok[t] = g.CopyOut(kBytes / 2 + (t % 4) * (kBytes / 8) / 2, out.data(),
                        out.size());
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(ok[t], 0) << "thread " << t;
  EXPECT_TRUE(g.broken());
}

// A SIGBUS outside a guarded copy is not the guard's: the process dies of
// it as it would without the guard (whose handler is installed by then).
TEST(GuardedMappingDeathTest, FaultOutsideACopyStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Mapped m;
        GuardedMapping g(m.base(), kBytes);
        char c;
        (void)g.CopyOut(0, &c, 1);  // the handler is in place
        m.Shrink(0);
        volatile std::byte* p = m.base() + 8192;
        *p = std::byte{1};  // SIGBUS, unguarded
      },
      "");
}

}  // namespace
}  // namespace dmuon::transport
