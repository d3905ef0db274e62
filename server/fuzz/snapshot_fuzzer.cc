// Fuzzes the reading of --state-dir snapshot files: a daemon starting on a
// directory holding a damaged or crafted file (LoadSnapshots), then a job
// reopening with that id (which reads the file's momentum). Any crash,
// sanitizer report, leak or oversized allocation is a bug; refusals are
// expected.
//
// Input: [flags: 1 byte][n: 2 bytes LE][n bytes: the OpenSessionRequest the
// job reopens with][the rest: the file]. Flag bit 0 rewrites the file's last
// four bytes with the CRC-32 of the rest, as the daemon writes it
// (docs/protocol.md "Snapshots"), so that inputs get past the checksum.
// Flag bit 1 writes the file as a mark of the job instead (docs/protocol.md
// "Marks": <snapshot file>.mark-<step>, the step the request resumes at, or
// 1), which LoadSnapshots lists by its header and an open at that step
// reads whole.

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "proto/dmuon.pb.h"
#include "server/fuzz/fuzz_support.h"
#include "server/service.h"
#include "server/snapshot_store.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server::fuzz {
namespace {

const std::string& StateDir() {
  static const std::string* dir =
      new std::string(testing::NewTempDir("snapshot-fuzz"));
  return *dir;
}

void Run(const uint8_t* data, size_t size) {
  if (size < 3) return;
  const uint8_t flags = data[0];
  const size_t n = std::min<size_t>(data[1] | (data[2] << 8), size - 3);
  v1::OpenSessionRequest req;
  if (!req.ParseFromArray(data + 3, static_cast<int>(n))) return;
  std::string file(reinterpret_cast<const char*>(data + 3 + n), size - 3 - n);
  if ((flags & 1) && file.size() >= 4) {
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(file.data()),
              static_cast<uInt>(file.size() - 4)));
    std::memcpy(file.data() + file.size() - 4, &crc, 4);
  }
  const std::string& dir = StateDir();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    // Where the service looks for the job's snapshot, or for its mark.
    const SnapshotStore store(dir, nullptr);
    const int64_t step = req.resume_step() > 0 ? req.resume_step() : 1;
    std::ofstream out((flags & 2) ? store.MarkPathOf(req.job_id(), step)
                                  : store.PathOf(req.job_id()),
                      std::ios::binary);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
  }
  ServiceOptions o;
  o.state_dir = dir;
  o.max_sessions = 4;
  o.max_message_bytes = 1 << 20;
  // dmuond always runs with a state limit (--max-state-bytes, by default a
  // quarter of the host's memory); without one a fuzzed table of 14 GB was
  // allocated (an out-of-memory in CI), which the daemon refuses.
  o.max_state_bytes = 64 << 20;
  auto service = NewFastService(o, /*executors=*/1);
  OptimizerService& svc = *service;
  (void)svc.LoadSnapshots();
  auto r = svc.OpenSession(req);
  if (r.ok()) {
    (void)testing::GetState(svc, r->session_id());
    (void)svc.Status();
    svc.Detach(r->session_id(), absl::CancelledError("fuzz: end of input"));
  }
}

}  // namespace
}  // namespace dmuon::server::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dmuon::server::fuzz::SilenceProtobufLogs();
  dmuon::server::fuzz::Run(data, size);
  return 0;
}
