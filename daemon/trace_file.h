// dmuond --trace-file: the daemon's step timeline (server/step_trace.h)
// streamed to a Chrome trace-event JSON file while the daemon runs.
//
// Open truncates the file and starts the recorder; a thread appends what
// was recorded every `flush_every` (so the recorder's per-thread buffers
// hold one interval's events, and tracing can stay on for a daemon's life),
// and Close the rest. Each write goes where the previous one's footer began
// and ends with the footer again (the thread names, and "otherData": the
// clock, the wall minus monotonic offset, the dropped-event count), so the
// file is a whole trace after every flush, readable while dmuond runs or
// after it was killed. (The merge, python -m dmuon.trace merge, reads a
// file cut mid-write too.)

#ifndef DMUON_DAEMON_TRACE_FILE_H_
#define DMUON_DAEMON_TRACE_FILE_H_

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/trace.h"

namespace dmuon::server {

class TraceFile {
 public:
  // INVALID_ARGUMENT naming --trace-file and why when `path` cannot be
  // written. `trace` outlives the TraceFile.
  static absl::StatusOr<std::unique_ptr<TraceFile>> Open(
      const std::string& path, TraceRecorder* trace,
      std::chrono::milliseconds flush_every = std::chrono::seconds(1));
  ~TraceFile();  // Close()
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  // Stops the recorder and the thread and ends the file. Idempotent; an
  // error names --trace-file (a full disk).
  absl::Status Close();

 private:
  TraceFile(std::string path, std::FILE* f, TraceRecorder* trace);
  void Loop(std::chrono::milliseconds every);
  // Appends the recorder's events (`always`: even when there are none) and
  // rewrites the footer after them.
  void Flush(bool always);

  const std::string path_;
  std::FILE* file_;
  TraceRecorder* const trace_;
  const int pid_;
  bool wrote_event_ = false;  // a comma goes before the next event
  long footer_at_ = 0;        // the file offset where the footer begins
  bool write_failed_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closing_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_TRACE_FILE_H_
