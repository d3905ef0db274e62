#include "server/snapshot_store.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server {
namespace {

v1::StateHeader Header(const std::string& job, int64_t steps) {
  v1::StateHeader h;
  h.set_job_id(job);
  h.set_completed_steps(steps);
  auto* p = h.add_parameters();
  p->set_name("w");
  p->add_shape(2);
  p->add_shape(3);
  return h;
}

std::string Encode(const std::string& job, int64_t steps, float fill) {
  const std::vector<float> m(6, fill);
  return EncodeSnapshot(Header(job, steps), {&m});
}

TEST(SnapshotStore, WritesAndReadsBack) {
  std::vector<double> writes;
  SnapshotStore store(testing::NewTempDir("snap"),
                      [&](double s) { writes.push_back(s); });
  ASSERT_TRUE(store.enabled());
  ASSERT_TRUE(store.Write("job a", 1, 7, Encode("job a", 7, 0.5f)).ok());
  EXPECT_EQ(writes.size(), 1u);
  EXPECT_EQ(store.PathOf("job a"), store.dir() + "/job-6a6f622061.dmst");
  auto f = SnapshotStore::Read(store.PathOf("job a"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->head.header().job_id(), "job a");
  EXPECT_EQ(f->head.header().completed_steps(), 7);
  ASSERT_EQ(f->momentum.size(), 1u);
  EXPECT_EQ(f->momentum[0], std::vector<float>(6, 0.5f));
  // No temporary file is left behind.
  EXPECT_NE(access(store.TempPathOf("job a").c_str(), F_OK), 0);
}

TEST(SnapshotStore, AnOlderSnapshotOfTheSameJobNeverReplacesANewerOne) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  ASSERT_TRUE(store.Write("j", 1, 5, Encode("j", 5, 5.0f)).ok());
  ASSERT_TRUE(store.Write("j", 1, 3, Encode("j", 3, 3.0f)).ok());  // skipped
  auto f = SnapshotStore::Read(store.PathOf("j"));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->head.header().completed_steps(), 5);
  // The same step again is written.
  ASSERT_TRUE(store.Write("j", 1, 5, Encode("j", 5, 6.0f)).ok());
  EXPECT_EQ(SnapshotStore::Read(store.PathOf("j"))->momentum[0][0], 6.0f);
}

TEST(SnapshotStore, AnExplicitRestoreRollsBackAndKeepsTheNewerFile) {
  std::vector<std::string> kinds;
  SnapshotStore store(
      testing::NewTempDir("snap"), nullptr,
      [&](const char* kind, const absl::Status&) { kinds.push_back(kind); });
  // A newer file of an earlier run, and this job's own newer file alike.
  for (uint64_t earlier : {uint64_t{1}, uint64_t{2}}) {
    ASSERT_TRUE(store.Write("j", earlier, 50, Encode("j", 50, 5.0f)).ok());
    int calls = 0;
    auto kept = store.Restore("j", 2, 10, [&]() -> absl::StatusOr<std::string> {
      ++calls;
      return Encode("j", 10, 1.0f);
    });
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_EQ(calls, 1);
    EXPECT_NE(kept->find(store.PathOf("j") + ".rolled-back-"),
              std::string::npos)
        << *kept;
    EXPECT_EQ(SnapshotStore::Read(*kept)->head.header().completed_steps(), 50);
    auto f = SnapshotStore::Read(store.PathOf("j"));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->head.header().completed_steps(), 10);
    EXPECT_EQ(f->momentum[0][0], 1.0f);
    // The automatic snapshots continue from the restored step ...
    ASSERT_TRUE(store.Write("j", 2, 11, Encode("j", 11, 2.0f)).ok());
    EXPECT_EQ(SnapshotStore::Read(store.PathOf("j"))->momentum[0][0], 2.0f);
    // ... and still never go back by themselves.
    ASSERT_TRUE(store.Write("j", 2, 10, Encode("j", 10, 3.0f)).ok());
    EXPECT_EQ(SnapshotStore::Read(store.PathOf("j"))->momentum[0][0], 2.0f);
    ASSERT_EQ(unlink(kept->c_str()), 0);
    ASSERT_EQ(unlink(store.PathOf("j").c_str()), 0);
    // (the next round's first write finds no file: a fresh start)
    ASSERT_TRUE(store.Write("j", 3, 0, Encode("j", 0, 0.0f)).ok());
    ASSERT_EQ(unlink(store.PathOf("j").c_str()), 0);
  }
  // A restore that is not older than the file writes nothing.
  ASSERT_TRUE(store.Write("k", 1, 5, Encode("k", 5, 5.0f)).ok());
  auto none = store.Restore("k", 1, 7, []() -> absl::StatusOr<std::string> {
    ADD_FAILURE() << "nothing to write";
    return std::string();
  });
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
  EXPECT_TRUE(kinds.empty());
}

TEST(SnapshotStore, AnotherRunOfTheJobNeverReplacesANewerSnapshot) {
  std::vector<std::pair<std::string, std::string>> failed;
  SnapshotStore store(testing::NewTempDir("snap"), nullptr,
                      [&](const char* kind, const absl::Status& st) {
                        failed.emplace_back(kind, std::string(st.message()));
                      });
  ASSERT_TRUE(store.Write("j", 1, 50, Encode("j", 50, 5.0f)).ok());
  // A new job of the id (another serial) that restarted at step 1.
  const absl::Status st = store.Write("j", 2, 1, Encode("j", 1, 1.0f));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find("holds step 50"), std::string::npos) << st;
  EXPECT_EQ(
      SnapshotStore::Read(store.PathOf("j"))->head.header().completed_steps(),
      50);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].first, "stale");
  ASSERT_EQ(store.errors().size(), 1u);
  EXPECT_EQ(store.errors()[0].job_id, "j");  // whose error it is
  // Past it, it writes; and files found at start count the same.
  ASSERT_TRUE(store.Write("j", 2, 51, Encode("j", 51, 2.0f)).ok());
  SnapshotStore restarted(store.dir(), nullptr);
  ASSERT_TRUE(restarted.Scan().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(
      restarted.Write("j", 1, 3, Encode("j", 3, 3.0f))));
  // The operator moved the file away: a fresh history may start.
  ASSERT_EQ(::unlink(store.PathOf("j").c_str()), 0);
  EXPECT_TRUE(restarted.Write("j", 1, 3, Encode("j", 3, 3.0f)).ok());
}

TEST(SnapshotStore, AFailedWriteLeavesNoTemporaryFileAndIsReported) {
  std::vector<std::string> kinds;
  SnapshotStore store(
      testing::NewTempDir("snap"), nullptr,
      [&](const char* kind, const absl::Status&) { kinds.push_back(kind); });
  ASSERT_TRUE(store.Write("j", 1, 1, Encode("j", 1, 1.0f)).ok());
  // The disk fills up mid-write (the file-size limit: EFBIG).
  std::string big = Encode("j", 2, 2.0f);
  big.resize(1 << 20, 'x');
  signal(SIGXFSZ, SIG_IGN);
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status st = store.Write("j", 1, 2, big);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_NE(st.message().find("writing"), std::string::npos) << st;
  struct stat sb;
  EXPECT_NE(::stat(store.TempPathOf("j").c_str(), &sb), 0)
      << "temporary file left behind";
  // The old snapshot is intact.
  EXPECT_EQ(
      SnapshotStore::Read(store.PathOf("j"))->head.header().completed_steps(),
      1);
  EXPECT_EQ(kinds, std::vector<std::string>{"write"});
  ASSERT_EQ(store.errors().size(), 1u);
  EXPECT_EQ(store.errors()[0].job_id, "j");
}

TEST(SnapshotStore, MoveAsideKeepsTheBytesUnderANewName) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  const std::string path = store.PathOf("m");
  { std::ofstream(path) << "bad"; }
  auto first = store.MoveAside(path, absl::DataLossError("snapshot bad"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_NE(first->find(".corrupt-"), std::string::npos);
  { std::ofstream(path) << "bad again"; }  // the same second: a new name
  auto second = store.MoveAside(path, absl::DataLossError("snapshot bad"));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(*first, *second);
  std::ifstream a(*first), b(*second);
  std::string sa, sb;
  std::getline(a, sa);
  std::getline(b, sb);
  EXPECT_EQ(sa, "bad");
  EXPECT_EQ(sb, "bad again");
  EXPECT_FALSE(store.MoveAside(path, absl::DataLossError("gone")).ok());
}

TEST(SnapshotStore, ReadTellsGoneFromDamaged) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  EXPECT_TRUE(absl::IsNotFound(
      SnapshotStore::Read(store.dir() + "/job-00.dmst").status()));
  ASSERT_TRUE(store.Write("j", 1, 1, Encode("j", 1, 1.0f)).ok());
  {
    std::fstream f(store.PathOf("j"),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');
  }
  auto bad = SnapshotStore::Read(store.PathOf("j"));
  EXPECT_TRUE(absl::IsDataLoss(bad.status())) << bad.status();
  EXPECT_NE(bad.status().message().find("checksum"), std::string::npos);
}

// A file with a valid CRC is still untrusted: shapes that would overflow
// the size arithmetic or ask for more momentum than the file holds are
// refused by name, before anything is allocated.
TEST(SnapshotStore, ReadRefusesCraftedShapesWithAValidChecksum) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  const int64_t shapes[][2] = {{int64_t{1} << 62, 1},
                               {int64_t{1} << 32, int64_t{1} << 32},
                               {-1, 4},
                               {0, 3},
                               {3, 3}};  // 9 floats asked, 6 there
  for (const auto& shape : shapes) {
    v1::StateHeader h = Header("j", 1);
    h.mutable_parameters(0)->set_shape(0, shape[0]);
    h.mutable_parameters(0)->set_shape(1, shape[1]);
    const std::vector<float> m(6, 1.0f);
    const std::string bytes = EncodeSnapshot(h, {&m});
    std::ofstream(store.PathOf("j"), std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    auto f = SnapshotStore::Read(store.PathOf("j"));
    ASSERT_FALSE(f.ok()) << shape[0] << "x" << shape[1];
    EXPECT_TRUE(absl::IsDataLoss(f.status())) << f.status();
    EXPECT_NE(f.status().message().find("'w'"), std::string::npos)
        << f.status();
    EXPECT_EQ(SnapshotStore::Check(store.PathOf("j")).status(), f.status());
  }
}

// Writes `bytes` as the file at `path`.
void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A header of `shapes` (parameters p0, p1, ...) and random momentum for it.
struct Snapshot {
  v1::StateHeader header;
  std::vector<std::vector<float>> momentum;
  std::string Encode() const {
    std::vector<const std::vector<float>*> m;
    for (const auto& v : momentum) m.push_back(&v);
    return EncodeSnapshot(header, m);
  }
};
Snapshot RandomSnapshot(std::mt19937_64& rng,
                        const std::vector<std::pair<int, int>>& shapes) {
  Snapshot s;
  s.header.set_job_id("j");
  s.header.set_completed_steps(static_cast<int64_t>(rng() % 1000));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto* p = s.header.add_parameters();
    p->set_name(absl::StrCat("p", i));
    p->add_shape(shapes[i].first);
    p->add_shape(shapes[i].second);
    s.momentum.emplace_back(shapes[i].first * shapes[i].second);
    for (float& x : s.momentum.back()) x = value(rng);
  }
  return s;
}

// Reads `path` by chunks of `chunk` bytes: Read returns `want`'s header and
// momentum, and Check its header.
void ExpectReadsAs(const std::string& path, size_t chunk,
                   const Snapshot& want) {
  auto f = SnapshotStore::Read(path, chunk);
  ASSERT_TRUE(f.ok()) << f.status() << " (chunk " << chunk << ")";
  EXPECT_EQ(f->head.header().SerializeAsString(),
            want.header.SerializeAsString());
  EXPECT_EQ(f->momentum, want.momentum) << "chunk " << chunk;
  auto head = SnapshotStore::Check(path, chunk);
  ASSERT_TRUE(head.ok()) << head.status() << " (chunk " << chunk << ")";
  EXPECT_EQ(head->SerializeAsString(), want.header.SerializeAsString());
}

// Streamed reads (issue 27, defect 1): whatever the chunk size, parameters
// that start, end or span chunk boundaries anywhere come back exactly as
// they were encoded.
TEST(SnapshotStore, ReadsByChunksOfAnySize) {
  std::mt19937_64 rng(std::random_device{}());
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::pair<int, int>> shapes;
    for (int n = 1 + static_cast<int>(rng() % 4); n > 0; --n)
      shapes.emplace_back(1 + rng() % 9, 1 + rng() % 9);
    const Snapshot want = RandomSnapshot(rng, shapes);
    const std::string bytes = want.Encode();
    WriteFile(store.PathOf("j"), bytes);
    const size_t size = bytes.size();
    for (size_t chunk :
         {size_t{1}, size_t{3}, size_t{4}, size_t{7}, size / 2, size - 4, size,
          size + 1, kSnapshotReadChunk, size_t{1} + rng() % size}) {
      ExpectReadsAs(store.PathOf("j"), chunk, want);
    }
  }
}

// Files of exactly one and two default chunks, the first one's last
// parameter ending on the chunk boundary, the second's spanning it.
TEST(SnapshotStore, ReadsFilesOfExactlyWholeChunks) {
  std::mt19937_64 rng(std::random_device{}());
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  for (size_t chunks : {1, 2}) {
    Snapshot want = RandomSnapshot(rng, {{3, 5}, {256, 1000}});
    // The owner pads the header so that the file is a whole number of
    // chunks (its length is varint-coded: settle it in two rounds).
    const uint64_t want_size = chunks * kSnapshotReadChunk;
    for (int settle = 0; settle < 2; ++settle) {
      const size_t size = want.Encode().size();
      ASSERT_LT(size, want_size + want.header.owner().size());
      want.header.set_owner(
          std::string(want.header.owner().size() + want_size - size, 'o'));
    }
    ASSERT_EQ(want.Encode().size(), want_size);
    WriteFile(store.PathOf("j"), want.Encode());
    ExpectReadsAs(store.PathOf("j"), kSnapshotReadChunk, want);
    ExpectReadsAs(store.PathOf("j"), kSnapshotReadChunk / 4, want);
  }
}

// One bit flipped anywhere in a file is refused by Read and Check alike:
// in the magic as no snapshot, anywhere else (the header's length, the
// header, the momentum, the CRC itself, each in whatever chunk) as a
// checksum mismatch, and Read returns no momentum.
TEST(SnapshotStore, EveryDamagedByteIsRefusedWhateverTheChunk) {
  std::mt19937_64 rng(std::random_device{}());
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  const Snapshot good = RandomSnapshot(rng, {{2, 3}, {5, 7}});
  const std::string bytes = good.Encode();
  for (size_t at = 0; at < bytes.size(); ++at) {
    std::string bad = bytes;
    bad[at] ^= static_cast<char>(1 << (rng() % 8));
    WriteFile(store.PathOf("j"), bad);
    const size_t chunk = 1 + rng() % (bytes.size() + 8);
    const std::string why =
        at < 8 ? "not a dmuon snapshot" : "checksum mismatch";
    auto f = SnapshotStore::Read(store.PathOf("j"), chunk);
    ASSERT_FALSE(f.ok()) << "byte " << at << ", chunk " << chunk;
    EXPECT_TRUE(absl::IsDataLoss(f.status())) << f.status();
    EXPECT_NE(f.status().message().find(store.PathOf("j") + ": " + why),
              std::string::npos)
        << "byte " << at << ", chunk " << chunk << ": " << f.status();
    EXPECT_EQ(SnapshotStore::Check(store.PathOf("j"), chunk).status(),
              f.status());
  }
}

// A CRC error in the last chunk of a multi-chunk file (the last momentum
// bytes, or the stored CRC) is found at the end of the stream, after every
// chunk before it was read: refused, and Scan moves the file aside.
TEST(SnapshotStore, AChecksumErrorInTheLastChunkIsFoundAtTheEnd) {
  std::mt19937_64 rng(std::random_device{}());
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  const Snapshot good = RandomSnapshot(rng, {{700, 1000}});  // 2.7 chunks
  const std::string bytes = good.Encode();
  ASSERT_GT(bytes.size(), 2 * kSnapshotReadChunk);
  for (size_t from_end : {size_t{1}, size_t{4}, size_t{5}, size_t{4096}}) {
    std::string bad = bytes;
    bad[bad.size() - from_end] ^= 0x10;
    WriteFile(store.PathOf("j"), bad);
    for (size_t chunk : {kSnapshotReadChunk, size_t{4093}}) {
      auto f = SnapshotStore::Read(store.PathOf("j"), chunk);
      EXPECT_TRUE(absl::IsDataLoss(f.status())) << f.status();
      EXPECT_NE(f.status().message().find("checksum mismatch"),
                std::string::npos)
          << f.status();
      EXPECT_EQ(SnapshotStore::Check(store.PathOf("j"), chunk).status(),
                f.status());
    }
    auto scan = store.Scan();
    ASSERT_TRUE(scan.ok()) << scan.status();
    EXPECT_TRUE(scan->good.empty());
    EXPECT_NE(scan->first_error.message().find("checksum mismatch; moved "
                                               "aside to"),
              std::string::npos)
        << scan->first_error;
    struct stat sb;
    EXPECT_NE(::stat(store.PathOf("j").c_str(), &sb), 0);
  }
  // Intact, it is read whole and found good.
  WriteFile(store.PathOf("j"), bytes);
  ExpectReadsAs(store.PathOf("j"), kSnapshotReadChunk, good);
  auto scan = store.Scan();
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->good.size(), 1u);
}

TEST(SnapshotStore, ScanListsGoodFilesAndReportsTheFirstBadOne) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  ASSERT_TRUE(store.Write("a", 1, 1, Encode("a", 1, 1.0f)).ok());
  { std::ofstream(store.dir() + "/job-ff.dmst") << "junk"; }
  { std::ofstream(store.dir() + "/other.txt") << "not a snapshot"; }
  auto scan = store.Scan();
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->good.size(), 1u);
  EXPECT_EQ(scan->good[0].first, "a");
  EXPECT_EQ(scan->good[0].second, store.PathOf("a"));
  EXPECT_TRUE(absl::IsDataLoss(scan->first_error));
  // The bad file was moved aside, not left to be overwritten.
  EXPECT_NE(scan->first_error.message().find("moved aside to"),
            std::string::npos)
      << scan->first_error;
  struct stat sb;
  EXPECT_NE(::stat((store.dir() + "/job-ff.dmst").c_str(), &sb), 0);
  // Its job (by the file's name: 0xff) is told, for its next open.
  ASSERT_EQ(scan->moved_aside.size(), 1u);
  const std::string& notice = scan->moved_aside.at("\xff");
  EXPECT_NE(notice.find("could not be used"), std::string::npos) << notice;
  EXPECT_NE(
      notice.find("moved aside to " + store.dir() + "/job-ff.dmst.corrupt-"),
      std::string::npos)
      << notice;

  SnapshotStore missing(store.dir() + "/nope", nullptr);
  EXPECT_TRUE(absl::IsFailedPrecondition(missing.Scan().status()));
}

// Odd entries named like snapshots (issue 27, defect 8): a FIFO would block
// the start forever, a link to /dev/zero or a huge sparse file would be read
// whole. Each is refused without reading its contents, moved aside and
// listed; the good file is still found. (On the old code this test hangs
// on the FIFO until its timeout.)
TEST(SnapshotStore, ScanRefusesOddEntriesWithoutReadingThem) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  ASSERT_TRUE(store.Write("a", 1, 1, Encode("a", 1, 1.0f)).ok());
  ASSERT_EQ(::mkfifo((store.dir() + "/job-f1f0.dmst").c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", (store.dir() + "/job-2e20.dmst").c_str()),
            0);
  {  // a valid header and momentum, then 1 TiB of holes
    const std::string bytes = Encode("b", 1, 1.0f);
    const std::string path = store.PathOf("b");
    std::ofstream(path, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_EQ(::truncate(path.c_str(), off_t{1} << 40), 0);
  }
  auto scan = store.Scan();
  ASSERT_TRUE(scan.ok()) << scan.status();
  ASSERT_EQ(scan->good.size(), 1u);
  EXPECT_EQ(scan->good[0].first, "a");
  const std::vector<SnapshotStore::Error> errors = store.errors();
  auto listed = [&](const std::string& what) {
    for (const SnapshotStore::Error& e : errors)
      if (e.message.find(what) != std::string::npos) return true;
    return false;
  };
  // Each names its job by the file's name (hex), for Status's redaction.
  std::vector<std::string> jobs;
  for (const SnapshotStore::Error& e : errors) jobs.push_back(e.job_id);
  std::sort(jobs.begin(), jobs.end());
  EXPECT_EQ(jobs, (std::vector<std::string>{". ", "b", "\xf1\xf0"}));
  EXPECT_TRUE(listed("job-f1f0.dmst: not a regular file"));
  EXPECT_TRUE(listed("job-2e20.dmst: a symbolic link"));
  EXPECT_TRUE(listed("bytes, is more than the"));
  for (const char* name : {"/job-f1f0.dmst", "/job-2e20.dmst"}) {
    struct stat sb;
    EXPECT_NE(::lstat((store.dir() + name).c_str(), &sb), 0) << name;
  }
}

// A valid file (its CRC matches) whose step is out of range (issue 27,
// defect 11) is moved aside and listed at start, not left to fail every
// open of its id.
TEST(SnapshotStore, ScanMovesAsideAStepOutOfRange) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  for (int64_t steps : {(int64_t{1} << 62) + 1, int64_t{-3}}) {
    const std::vector<float> m(6, 1.0f);
    const std::string bytes = EncodeSnapshot(Header("j", steps), {&m});
    std::ofstream(store.PathOf("j"), std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    auto scan = store.Scan();
    ASSERT_TRUE(scan.ok()) << scan.status();
    EXPECT_TRUE(scan->good.empty());
    EXPECT_NE(scan->first_error.message().find(
                  absl::StrCat("completed_steps ", steps, " is outside")),
              std::string::npos)
        << scan->first_error;
    EXPECT_NE(scan->first_error.message().find("moved aside to"),
              std::string::npos)
        << scan->first_error;
    struct stat sb;
    EXPECT_NE(::stat(store.PathOf("j").c_str(), &sb), 0);
  }
}

TEST(SnapshotStore, JobOfPathReadsTheFileName) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  for (const std::string& id :
       std::vector<std::string>{"a", "job one", std::string("\0\xff", 2)}) {
    EXPECT_EQ(SnapshotStore::JobOfPath(store.PathOf(id)), id);
    EXPECT_EQ(SnapshotStore::JobOfPath(store.PathOf(id) + ".corrupt-x"), id);
  }
  for (const char* path : {"/d/job-6.dmst", "/d/job-zz.dmst", "/d/x.dmst",
                           "/d/job-61", "job-.dmst"}) {
    EXPECT_EQ(SnapshotStore::JobOfPath(path), "") << path;
  }
}

TEST(PendingSnapshots, ReadOnceThenTaken) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  ASSERT_TRUE(store.Write("j", 1, 4, Encode("j", 4, 2.0f)).ok());
  PendingSnapshots pending;
  EXPECT_FALSE(pending.StartRead("j"));  // nothing pending
  pending.AddFile("j", store.PathOf("j"));
  auto path = pending.StartRead("j");
  ASSERT_TRUE(path);
  EXPECT_TRUE(pending.reading("j"));
  ASSERT_TRUE(pending.FinishRead("j", *path, SnapshotStore::Read(*path)).ok());
  EXPECT_FALSE(pending.reading("j"));
  EXPECT_FALSE(pending.StartRead("j"));  // read already
  ASSERT_NE(pending.Find("j"), nullptr);
  SnapshotFile f = pending.Take("j");
  EXPECT_EQ(f.head.header().completed_steps(), 4);
  EXPECT_EQ(pending.Find("j"), nullptr);
}

TEST(PendingSnapshots, UnloadedAfterTheLastOpenTheFileIsReadAgain) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  ASSERT_TRUE(store.Write("j", 1, 4, Encode("j", 4, 2.0f)).ok());
  PendingSnapshots pending;
  pending.AddFile("j", store.PathOf("j"));
  pending.BeginOpen("j");
  pending.BeginOpen("j");
  auto path = pending.StartRead("j");
  ASSERT_TRUE(path);
  ASSERT_TRUE(pending.FinishRead("j", *path, SnapshotStore::Read(*path)).ok());
  EXPECT_FALSE(pending.EndOpen("j"));  // another open still needs it
  ASSERT_NE(pending.Find("j"), nullptr);
  EXPECT_TRUE(pending.EndOpen("j"));
  pending.Unload("j");
  EXPECT_EQ(pending.Find("j"), nullptr);
  EXPECT_EQ(pending.StartRead("j"), store.PathOf("j"));  // to read again
  pending.AbortRead("j");
  EXPECT_FALSE(pending.reading("j"));
}

TEST(SnapshotStore, ReadHeaderReadsNoMomentum) {
  SnapshotStore store(testing::NewTempDir("snap"), nullptr);
  v1::StateHeader h = Header("j", 9);
  h.set_owner("alice");
  const std::vector<float> m(6, 1.0f);
  std::string bytes = EncodeSnapshot(h, {&m});
  bytes[bytes.size() - 8] ^= 0x40;  // damaged momentum: Read would refuse it
  std::ofstream(store.PathOf("j"), std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  auto head = SnapshotStore::ReadHeader(store.PathOf("j"));
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->owner(), "alice");
  EXPECT_EQ(head->completed_steps(), 9);
  EXPECT_FALSE(SnapshotStore::Read(store.PathOf("j")).ok());
  ASSERT_EQ(::mkfifo((store.dir() + "/job-00.dmst").c_str(), 0600), 0);
  EXPECT_TRUE(absl::IsDataLoss(
      SnapshotStore::ReadHeader(store.dir() + "/job-00.dmst").status()));
  EXPECT_TRUE(absl::IsNotFound(
      SnapshotStore::ReadHeader(store.dir() + "/job-01.dmst").status()));
}

TEST(PendingSnapshots, AGoneFileIsForgottenABadOneIsAnError) {
  const std::string dir = testing::NewTempDir("snap");
  PendingSnapshots pending;
  pending.AddFile("gone", dir + "/job-00.dmst");
  auto path = pending.StartRead("gone");
  ASSERT_TRUE(path);
  EXPECT_TRUE(
      pending.FinishRead("gone", *path, SnapshotStore::Read(*path)).ok());
  EXPECT_FALSE(pending.StartRead("gone"));
  EXPECT_EQ(pending.Find("gone"), nullptr);

  SnapshotStore store(dir, nullptr);
  ASSERT_TRUE(store.Write("x", 1, 1, Encode("x", 1, 1.0f)).ok());
  pending.AddFile("y", store.PathOf("x"));  // a file of another job
  path = pending.StartRead("y");
  const absl::Status st =
      pending.FinishRead("y", *path, SnapshotStore::Read(*path));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_NE(st.message().find("of job 'x'"), std::string::npos);
  EXPECT_EQ(pending.Find("y"), nullptr);
}

}  // namespace
}  // namespace dmuon::server
