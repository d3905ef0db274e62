// A restart's memory (issue 27, defect 1): a real dmuond started on a
// --state-dir holding one large snapshot must not hold that file several
// times over. Its peak resident memory (VmHWM) is compared with that of the
// same daemon started on an empty directory: after the start (every file's
// checksum checked) it may exceed it by little more than one read chunk,
// and after the job's open by little more than the momentum itself. The
// file is written here from the format's description (docs/design.md
// "State and snapshots"), not by the daemon's own encoder, and the momentum
// the daemon resumed from is read back (GetState) and compared with it.

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "client/client.h"
#include "proto/dmuon.pb.h"
#include "tests/proc_stats.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

constexpr char kJob[] = "big";
constexpr int64_t kSteps = 12;

// About 256 MiB of momentum: two large matrices of odd sizes (so that no
// parameter starts on a round offset) and a tiny one.
std::vector<ParamSpec> Table() {
  return {{"a", 16384, 2048}, {"b", 16383, 2047}, {"c", 3, 5}};
}

uint64_t MomentumBytes() {
  uint64_t n = 0;
  for (const ParamSpec& p : Table())
    n += static_cast<uint64_t>(p.rows) * static_cast<uint64_t>(p.cols) * 4;
  return n;
}

// Element `i` of parameter `p`'s momentum: a hash of (seed, p, i) as a
// float in [-1, 1), so that any misplaced byte shows.
float Value(uint64_t seed, int p, uint64_t i) {
  uint64_t z = seed ^ (uint64_t(p) << 56) ^ (i * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)) /
         static_cast<float>(1 << 23);
}

// Writes <dir>/job-<hex>.dmst: "DMUONST1" | u64 header length | StateHeader
// | each parameter's fp32 momentum | u32 CRC-32 (zlib) of all before it,
// a piece at a time (the test holds no copy of the momentum).
void WriteSnapshot(const std::string& dir, uint64_t seed) {
  v1::StateHeader h;
  h.set_job_id(kJob);
  h.set_completed_steps(kSteps);
  for (const ParamSpec& p : Table()) {
    auto* sp = h.add_parameters();
    sp->set_name(p.name);
    sp->add_shape(p.rows);
    sp->add_shape(p.cols);
  }
  const std::string head = h.SerializeAsString();
  std::ofstream out(dir + "/job-" + absl::BytesToHexString(kJob) + ".dmst",
                    std::ios::binary);
  uLong crc = crc32(0L, Z_NULL, 0);
  auto put = [&](const void* data, size_t n) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    crc = crc32(crc, static_cast<const Bytef*>(data), static_cast<uInt>(n));
  };
  const uint64_t len = head.size();
  put("DMUONST1", 8);
  put(&len, 8);
  put(head.data(), head.size());
  std::vector<float> piece;
  const std::vector<ParamSpec> table = Table();
  for (size_t p = 0; p < table.size(); ++p) {
    const uint64_t n = static_cast<uint64_t>(table[p].rows) *
                       static_cast<uint64_t>(table[p].cols);
    for (uint64_t i = 0; i < n; i += piece.size()) {
      piece.resize(std::min<uint64_t>(n - i, uint64_t{1} << 18));
      for (size_t k = 0; k < piece.size(); ++k)
        piece[k] = Value(seed, static_cast<int>(p), i + k);
      put(piece.data(), piece.size() * 4);
    }
  }
  const uint32_t sum = static_cast<uint32_t>(crc);
  out.write(reinterpret_cast<const char*>(&sum), 4);
  ASSERT_TRUE(out.good());
}

double MiB(int64_t kb) { return static_cast<double>(kb) / 1024.0; }

TEST(SnapshotMemory, ARestartHoldsALargeSnapshotAtMostOnce) {
  const uint64_t seed = std::random_device{}();
  const double snapshot_mib = MomentumBytes() / 1048576.0;
  // The baseline: the same daemon on an empty directory, once serving.
  int64_t baseline_kb = 0;
  {
    Daemon d({"--state-dir=" + TempDir("empty-state")});
    const ProcStats s = ReadProcStats(d.process().pid());
    ASSERT_TRUE(s.ok) << d.log();
    baseline_kb = s.hwm_kb;
  }

  const std::string dir = TempDir("big-state");
  WriteSnapshot(dir, seed);
  Daemon d({"--state-dir=" + dir});
  // Serving: its start checked the file (Scan) and kept none of it.
  const ProcStats started = ReadProcStats(d.process().pid());
  ASSERT_TRUE(started.ok) << d.log();
  const double scan_extra = MiB(started.hwm_kb - baseline_kb);

  ClientOptions o;
  o.deadline = std::chrono::seconds(60);
  auto client = Client::Connect(d.address(), o);
  ASSERT_TRUE(client.ok()) << client.status();
  SessionSpec spec;
  spec.job_id = kJob;
  spec.params = Table();
  spec.transport = TransportChoice::kInline;  // a calloc'd region: untouched
  spec.resume = Resume::kContinue;
  auto session = (*client)->OpenSession(spec);
  ASSERT_TRUE(session.ok()) << session.status() << "\n" << d.log();
  EXPECT_EQ((*session)->step(), kSteps + 1);
  const ProcStats opened = ReadProcStats(d.process().pid());
  ASSERT_TRUE(opened.ok);
  const double open_extra = MiB(opened.hwm_kb - baseline_kb);

  std::cout << "snapshot " << snapshot_mib << " MiB; baseline peak "
            << MiB(baseline_kb) << " MiB; peak beyond it after start "
            << scan_extra << " MiB, after the open " << open_extra << " MiB\n";
  // Today's bounds: one read chunk at start; the momentum plus one chunk at
  // the open. (Read whole, the start held the file twice and the open two
  // to three times.) The slack covers allocator and thread noise.
  EXPECT_LT(scan_extra, 0.15 * snapshot_mib);
  EXPECT_LT(open_extra, 1.25 * snapshot_mib);

  // What it resumed from is the file's momentum, element for element.
  auto state = (*session)->GetState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->completed_steps, kSteps);
  ASSERT_EQ(state->momentum.size(), Table().size());
  for (size_t p = 0; p < state->momentum.size(); ++p) {
    const std::vector<float>& m = state->momentum[p];
    ASSERT_EQ(m.size(), static_cast<size_t>(Table()[p].rows * Table()[p].cols));
    size_t wrong = 0;
    for (size_t i = 0; i < m.size(); ++i)
      wrong += m[i] != Value(seed, static_cast<int>(p), i);
    EXPECT_EQ(wrong, 0u) << "parameter " << Table()[p].name;
  }
}

}  // namespace
}  // namespace dmuon::testing
