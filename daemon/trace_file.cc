// TraceFile (trace_file.h): the recorder's events appended to --trace-file.

#include "daemon/trace_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::server {

absl::StatusOr<std::unique_ptr<TraceFile>> TraceFile::Open(
    const std::string& path, TraceRecorder* trace,
    std::chrono::milliseconds flush_every) {
  if (path.empty())
    return absl::InvalidArgumentError("--trace-file needs a path");
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--trace-file=", path, " cannot be written: ", std::strerror(errno)));
  }
  std::unique_ptr<TraceFile> t(new TraceFile(path, f, trace));
  std::fputs("{\"traceEvents\":[\n", f);
  t->footer_at_ = std::ftell(f);
  t->Flush(/*always=*/true);  // a whole (empty) trace from the start
  trace->Start();
  t->thread_ =
      std::thread([p = t.get(), flush_every] { p->Loop(flush_every); });
  return t;
}

TraceFile::TraceFile(std::string path, std::FILE* f, TraceRecorder* trace)
    : path_(std::move(path)), file_(f), trace_(trace), pid_(getpid()) {}

TraceFile::~TraceFile() { (void)Close(); }

void TraceFile::Loop(std::chrono::milliseconds every) {
  std::unique_lock<std::mutex> l(mu_);
  while (!cv_.wait_for(l, every, [this] { return closing_; })) Flush(false);
}

void TraceFile::Flush(bool always) {
  const std::string events = trace_->TakeEventsJson(pid_, /*metadata=*/false);
  if (events.empty() && !always) return;
  std::fseek(file_, footer_at_, SEEK_SET);
  if (!events.empty()) {
    if (wrote_event_) std::fputs(",\n", file_);
    std::fputs(events.c_str(), file_);
    wrote_event_ = true;
    footer_at_ = std::ftell(file_);
  }
  const std::string footer =
      absl::StrCat(wrote_event_ ? ",\n" : "", trace_->MetadataJson(pid_),
                   "\n],\n\"otherData\":", trace_->OtherDataJson(), "}\n");
  std::fputs(footer.c_str(), file_);
  if (std::fflush(file_) != 0 ||
      ftruncate(fileno(file_), std::ftell(file_)) != 0) {
    write_failed_ = true;
  }
}

absl::Status TraceFile::Close() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (file_ == nullptr) return absl::OkStatus();
    closing_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  trace_->Stop();
  std::lock_guard<std::mutex> l(mu_);
  Flush(/*always=*/true);
  const bool failed = std::fclose(file_) != 0 || write_failed_;
  file_ = nullptr;
  if (failed) {
    return absl::DataLossError(absl::StrCat(
        "--trace-file=", path_, ": the trace could not be written whole"));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
