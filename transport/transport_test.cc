#include "transport/transport.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dmuon::transport {
namespace {

// Whether `status`'s message contains `part` (gmock is not linked).
::testing::AssertionResult MessageHas(const absl::Status& status,
                                      const std::string& part) {
  if (std::string(status.message()).find(part) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "'" << status.message() << "' lacks '" << part << "'";
}

std::string DevShmPath(const std::string& name) {
  return "/dev/shm" + name;  // name starts with '/'
}

bool Exists(const std::string& name) {
  struct stat st;
  return ::stat(DevShmPath(name).c_str(), &st) == 0;
}

std::byte Pattern(size_t i, int seed) {
  return static_cast<std::byte>((i * 131 + seed) & 0xff);
}

// Every segment a test creates is unlinked in TearDown, even after a failed
// assertion.
class ShmTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const std::string& name : created_) {
      EXPECT_TRUE(UnlinkShm(name).ok()) << name;
      EXPECT_FALSE(Exists(name)) << name;
    }
  }

  std::unique_ptr<Region> Create(uint64_t bytes) {
    absl::StatusOr<std::unique_ptr<Region>> r = CreateShmRegion(bytes);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return nullptr;
    created_.push_back((*r)->name());
    return *std::move(r);
  }

  std::vector<std::string> created_;
};

TEST_F(ShmTest, CreateThenOpenInSameProcess) {
  constexpr uint64_t kBytes = 3 * 4096 + 17;
  auto creator = Create(kBytes);
  ASSERT_NE(creator, nullptr);
  ASSERT_EQ(creator->bytes().size(), kBytes);
  EXPECT_TRUE(creator->Check().ok());
  for (std::byte b : creator->bytes()) ASSERT_EQ(b, std::byte{0});

  auto opener = OpenShmRegion(creator->name(), kBytes);
  ASSERT_TRUE(opener.ok()) << opener.status();
  EXPECT_EQ((*opener)->name(), creator->name());
  ASSERT_EQ((*opener)->bytes().size(), kBytes);
  EXPECT_TRUE((*opener)->Check().ok());
  auto span = creator->bytes();
  for (size_t i = 0; i < span.size(); ++i) span[i] = Pattern(i, 7);
  auto seen = (*opener)->bytes();
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], Pattern(i, 7));

  // A smaller view of a larger segment is fine.
  auto part = OpenShmRegion(creator->name(), 100);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ((*part)->bytes().size(), 100u);
}

TEST_F(ShmTest, ChildProcessWritesParentReads) {
  constexpr uint64_t kBytes = 1 << 20;
  auto creator = Create(kBytes);
  ASSERT_NE(creator, nullptr);
  const std::string name = creator->name();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // Child: no gtest assertions; report through the exit code.
    auto r = OpenShmRegion(name, kBytes);
    if (!r.ok()) ::_exit(2);
    if ((*r)->bytes().size() != kBytes) ::_exit(3);
    auto span = (*r)->bytes();
    for (size_t i = 0; i < span.size(); ++i) span[i] = Pattern(i, 42);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  auto span = creator->bytes();
  for (size_t i = 0; i < span.size(); ++i) ASSERT_EQ(span[i], Pattern(i, 42));
}

TEST_F(ShmTest, ModeIs0600WhateverTheUmask) {
  for (mode_t mask : {0000, 0022, 0077}) {
    const mode_t old = ::umask(mask);
    auto r = Create(4096);
    ::umask(old);
    ASSERT_NE(r, nullptr);
    struct stat st;
    ASSERT_EQ(::stat(DevShmPath(r->name()).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << "umask " << mask;
    EXPECT_EQ(st.st_uid, ::geteuid());
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4096u);
  }
}

TEST_F(ShmTest, NamesAreUniqueAndRandomLooking) {
  const std::regex form("^/dmuon-[0-9a-f]{32}$");
  auto a = Create(64);
  auto b = Create(64);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(std::regex_match(a->name(), form)) << a->name();
  EXPECT_TRUE(std::regex_match(b->name(), form)) << b->name();
  EXPECT_NE(a->name(), b->name());
}

TEST_F(ShmTest, ShrunkSegmentIsDetected) {
  constexpr uint64_t kBytes = 1 << 20;
  auto creator = Create(kBytes);
  ASSERT_NE(creator, nullptr);
  auto opener = OpenShmRegion(creator->name(), kBytes);
  ASSERT_TRUE(opener.ok()) << opener.status();

  // A misbehaving opener shrinks the segment behind everyone's back. Nothing
  // may touch the mappings past this point (SIGBUS).
  const int fd = ::shm_open(creator->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd, 4096), 0) << std::strerror(errno);
  ::close(fd);

  for (Region* r : {creator.get(), opener->get()}) {
    absl::Status s = r->Check();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_TRUE(MessageHas(s, creator->name()));
    EXPECT_TRUE(MessageHas(s, absl::StrCat("holds 4096 bytes, ", kBytes)));
  }
  auto again = OpenShmRegion(creator->name(), kBytes);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition)
      << again.status();
  EXPECT_TRUE(
      MessageHas(again.status(),
                 absl::StrCat("shm segment '", creator->name(),
                              "' holds 4096 bytes, ", kBytes, " declared")));
  // What is left can still be opened at its real size.
  EXPECT_TRUE(OpenShmRegion(creator->name(), 4096).ok());
}

// Read and Write never touch the mapping: on a segment shrunk after it was
// mapped (even after a Check said it was whole) they fail with DATA_LOSS
// naming the segment instead of raising SIGBUS; inside what is left they
// still work.
TEST_F(ShmTest, ReadWriteOnShrunkSegmentAreDataLoss) {
  constexpr uint64_t kBytes = 1 << 20;
  auto creator = Create(kBytes);
  ASSERT_NE(creator, nullptr);
  auto opener = OpenShmRegion(creator->name(), kBytes);
  ASSERT_TRUE(opener.ok()) << opener.status();
  std::vector<char> in(kBytes, 'x'), out(kBytes, 0);
  ASSERT_TRUE(creator->Write(0, in.data(), kBytes).ok());
  ASSERT_TRUE((*opener)->Read(0, out.data(), kBytes).ok());
  EXPECT_EQ(out, in);
  EXPECT_EQ(creator->Read(kBytes - 8, out.data(), 16).code(),
            absl::StatusCode::kOutOfRange);

  const int fd = ::shm_open(creator->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd, 4096), 0) << std::strerror(errno);
  ::close(fd);

  for (Region* r : {creator.get(), opener->get()}) {
    absl::Status s = r->Read(kBytes / 2, out.data(), 4096);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_TRUE(MessageHas(s, creator->name()));
    s = r->Write(kBytes / 2, in.data(), 4096);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_TRUE(MessageHas(s, creator->name()));
    // A read that starts inside what is left and runs past it.
    s = r->Read(0, out.data(), 8192);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  }
  struct stat st;
  ASSERT_EQ(::stat(DevShmPath(creator->name()).c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 4096);  // a refused Write did not grow it back
}

TEST(HeapRegion, ReadWriteStayInside) {
  auto r = NewHeapRegion(128);
  char buf[64] = {1, 2, 3};
  EXPECT_TRUE(r->Write(64, buf, 64).ok());
  char back[64] = {0};
  EXPECT_TRUE(r->Read(64, back, 64).ok());
  EXPECT_EQ(std::memcmp(buf, back, 64), 0);
  EXPECT_EQ(r->Read(65, back, 64).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r->Write(~uint64_t{0}, buf, 2).code(),
            absl::StatusCode::kOutOfRange);
}

TEST_F(ShmTest, MissingSegmentIsNotFound) {
  const std::string name = "/dmuon-00000000000000000000000000000000";
  ASSERT_FALSE(Exists(name));
  auto r = OpenShmRegion(name, 64);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_TRUE(MessageHas(r.status(), name));
}

TEST_F(ShmTest, InvalidNamesAreRejected) {
  const std::string too_long = "/" + std::string(300, 'x');
  for (const std::string& name :
       std::vector<std::string>{"", "/", "dmuon-abc", "/a/b", too_long}) {
    EXPECT_EQ(OpenShmRegion(name, 1).status().code(),
              absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(UnlinkShm(name).code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
}

TEST_F(ShmTest, UnlinkKeepsMappingsAndIsIdempotent) {
  constexpr uint64_t kBytes = 8192;
  auto creator = Create(kBytes);
  ASSERT_NE(creator, nullptr);
  const std::string name = creator->name();
  auto opener = OpenShmRegion(name, kBytes);
  ASSERT_TRUE(opener.ok()) << opener.status();
  ASSERT_TRUE(Exists(name));

  ASSERT_TRUE(UnlinkShm(name).ok());
  EXPECT_FALSE(Exists(name));
  EXPECT_EQ(OpenShmRegion(name, kBytes).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(UnlinkShm(name).ok());  // twice: still OK

  // Both mappings still share the memory.
  EXPECT_TRUE(creator->Check().ok());
  EXPECT_TRUE((*opener)->Check().ok());
  auto span = (*opener)->bytes();
  for (size_t i = 0; i < span.size(); ++i) span[i] = Pattern(i, 3);
  auto seen = creator->bytes();
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], Pattern(i, 3));
}

TEST_F(ShmTest, DestructorDoesNotUnlink) {
  std::string name;
  {
    auto r = Create(64);
    ASSERT_NE(r, nullptr);
    name = r->name();
  }
  EXPECT_TRUE(Exists(name));
  EXPECT_TRUE(OpenShmRegion(name, 64).ok());
}

TEST_F(ShmTest, EmptyRegion) {
  auto r = Create(0);
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->bytes().empty());
  EXPECT_TRUE(r->Check().ok());
  auto o = OpenShmRegion(r->name(), 0);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE((*o)->bytes().empty());
}

TEST(HeapRegion, ZeroFilledAndWritable) {
  for (uint64_t bytes : {0ull, 1ull, 4097ull, 8ull << 20}) {
    auto r = NewHeapRegion(bytes);
    ASSERT_NE(r, nullptr);
    EXPECT_TRUE(r->name().empty());
    EXPECT_TRUE(r->Check().ok());
    auto span = r->bytes();
    ASSERT_EQ(span.size(), bytes);
    for (std::byte b : span) ASSERT_EQ(b, std::byte{0});
    if (!span.empty()) {
      span.front() = std::byte{1};
      span.back() = std::byte{2};
    }
  }
}

// ---- Layout ----------------------------------------------------------------

void CheckLayout(const std::vector<TensorView>& views, const Layout& layout) {
  ASSERT_EQ(layout.slots.size(), views.size());
  struct Interval {
    uint64_t begin, end;
  };
  std::vector<Interval> intervals;
  uint64_t end = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    const Slot& s = layout.slots[i];
    EXPECT_EQ(s.rows, views[i].rows);
    EXPECT_EQ(s.cols, views[i].cols);
    EXPECT_EQ(s.element_bytes, views[i].element_bytes);
    EXPECT_EQ(s.bytes, static_cast<uint64_t>(views[i].rows) * views[i].cols *
                           views[i].element_bytes);
    EXPECT_EQ(s.gradient_offset % kAlignment, 0u);
    EXPECT_EQ(s.update_offset % kAlignment, 0u);
    // All gradients precede all updates, each in parameter order.
    if (i > 0) {
      EXPECT_GT(s.gradient_offset, layout.slots[i - 1].gradient_offset);
      EXPECT_GT(s.update_offset, layout.slots[i - 1].update_offset);
    }
    EXPECT_LT(s.gradient_offset, layout.slots[0].update_offset);
    intervals.push_back({s.gradient_offset, s.gradient_offset + s.bytes});
    intervals.push_back({s.update_offset, s.update_offset + s.bytes});
    end = std::max(end, s.update_offset + s.bytes);
  }
  std::sort(
      intervals.begin(), intervals.end(),
      [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < intervals.size(); ++k) {
    ASSERT_LE(intervals[k - 1].end, intervals[k].begin) << "overlap at " << k;
  }
  EXPECT_EQ(layout.total_bytes,
            (end + kAlignment - 1) / kAlignment * kAlignment);
  EXPECT_EQ(layout.total_bytes % kAlignment, 0u);
}

TEST(Layout, RandomTables) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<TensorView> views(rng() % 20);
    for (TensorView& v : views) {
      v.rows = 1 + rng() % 300;
      v.cols = 1 + rng() % 300;
      v.element_bytes = (size_t[]){1, 2, 4, 8}[rng() % 4];
    }
    auto layout = ComputeLayout(views);
    ASSERT_TRUE(layout.ok()) << layout.status();
    CheckLayout(views, *layout);
  }
}

TEST(Layout, KnownExample) {
  auto layout = ComputeLayout({{3, 5, 4}, {64, 64, 2}});
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->slots.size(), 2u);
  EXPECT_EQ(layout->slots[0].bytes, 60u);
  EXPECT_EQ(layout->slots[0].gradient_offset, 0u);
  EXPECT_EQ(layout->slots[1].gradient_offset, 64u);
  EXPECT_EQ(layout->slots[0].update_offset, 64u + 8192u);
  EXPECT_EQ(layout->slots[1].update_offset, 64u + 8192u + 64u);
  EXPECT_EQ(layout->total_bytes, 64u + 8192u + 64u + 8192u);
}

TEST(Layout, EmptyTable) {
  auto layout = ComputeLayout({});
  ASSERT_TRUE(layout.ok());
  EXPECT_TRUE(layout->slots.empty());
  EXPECT_EQ(layout->total_bytes, 0u);
}

TEST(Layout, NothingHeldTakesNoBytes) {
  // A rank that holds nothing of a SHARDING_BLOCKS matrix: a 0x0 view.
  const std::vector<TensorView> views{{3, 5, 4}, {0, 0, 4}, {2, 2, 4}};
  auto layout = ComputeLayout(views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->slots[1].bytes, 0u);
  const auto& s = layout->slots;
  EXPECT_EQ(s[2].gradient_offset, s[1].gradient_offset);  // nothing between
  EXPECT_GE(s[2].gradient_offset, s[0].gradient_offset + s[0].bytes);
  EXPECT_GE(s[0].update_offset, s[2].gradient_offset + s[2].bytes);
  EXPECT_GE(s[2].update_offset, s[0].update_offset + s[0].bytes);
  auto alone = ComputeLayout({{0, 0, 4}});
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->total_bytes, 0u);
}

TEST(Layout, NonPositiveDimensionsNameTheParameter) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<TensorView> views(1 + rng() % 10, TensorView{8, 16, 4});
    const size_t bad = rng() % views.size();
    const int64_t value = -static_cast<int64_t>(rng() % 3);  // 0, -1, -2
    switch (rng() % 3) {
      case 0:
        views[bad].rows = value;
        break;
      case 1:
        views[bad].cols = value;
        break;
      default:
        views[bad].element_bytes = 0;
    }
    auto layout = ComputeLayout(views);
    ASSERT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(
        MessageHas(layout.status(), absl::StrCat("parameter ", bad, " ")));
    EXPECT_TRUE(MessageHas(
        layout.status(), absl::StrCat(views[bad].rows, "x", views[bad].cols)));
  }
}

TEST(Layout, OverflowIsAnError) {
  // One tensor's byte count overflows uint64.
  auto a = ComputeLayout({{2, 2, 4}, {1ll << 40, 1ll << 40, 4}});
  ASSERT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(a.status(), "parameter 1 "));
  EXPECT_TRUE(MessageHas(a.status(), "1099511627776x1099511627776"));
  // rows * cols fits, times element_bytes does not.
  auto b = ComputeLayout({{1ll << 31, 1ll << 31, 1ull << 3}});
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  // Each tensor fits, the region does not fit int64.
  auto c = ComputeLayout({{1ll << 30, 1ll << 30, 2},
                          {1ll << 30, 1ll << 30, 2},
                          {1ll << 30, 1ll << 30, 2}});
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(c.status(), "parameter "));
  // Just below the limit is fine.
  auto d = ComputeLayout({{1ll << 30, 1ll << 30, 2}});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->total_bytes, 1ull << 62);
}

// ---- Chunks ----------------------------------------------------------------

TEST(Chunks, CoverExactlyInOrder) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 500; ++trial) {
    const uint64_t bytes = rng() % 100000;
    const uint64_t max_chunk = 1 + rng() % (trial % 2 ? 1000 : 200000);
    const std::vector<Chunk> chunks = SplitChunks(bytes, max_chunk);
    uint64_t next = 0;
    for (const Chunk& c : chunks) {
      ASSERT_EQ(c.offset, next);
      ASSERT_GT(c.bytes, 0u);
      ASSERT_LE(c.bytes, max_chunk);
      next += c.bytes;
    }
    ASSERT_EQ(next, bytes);
    ASSERT_EQ(chunks.size(), (bytes + max_chunk - 1) / max_chunk);
  }
  EXPECT_TRUE(SplitChunks(0, 10).empty());
  EXPECT_TRUE(SplitChunks(100, 0).empty());
  const auto huge = SplitChunks(~0ull, 1ull << 62);
  ASSERT_EQ(huge.size(), 4u);
  EXPECT_EQ(huge.back().offset + huge.back().bytes, ~0ull);
}

TEST(Chunks, MaxChunkPayload) {
  EXPECT_EQ(MaxChunkPayload(4 << 20), (4u << 20) - 1024);
  EXPECT_EQ(MaxChunkPayload(1025), 1u);
  EXPECT_EQ(MaxChunkPayload(1024), 1u);
  EXPECT_EQ(MaxChunkPayload(0), 1u);
  EXPECT_LT(MaxChunkPayload(1 << 16), 1u << 16);
}

}  // namespace
}  // namespace dmuon::transport
