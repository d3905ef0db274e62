// Momentum state in and out: GetState/SetState streams and --state-dir
// snapshots.
//
// Snapshot file (one per job, <state-dir>/job-<hex(job id)>.dmst):
//   "DMUONST1" | u64 header length | StateHeader | per parameter, its fp32
//   momentum (row-major) | u32 CRC-32 (zlib) of everything before it.
// Written to a temporary file, fsynced, renamed over the old one, and the
// directory fsynced: a crash leaves the old or the new file, never a torn one.
// Read when a job of that id is next created (LoadPendingSnapshot), not
// before: a daemon keeps no momentum in memory for jobs nobody reopens.

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

constexpr char kMagic[] = "DMUONST1";

std::string HexOf(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(hex[c >> 4]);
    out.push_back(hex[c & 15]);
  }
  return out;
}

// A snapshot file's header (in a StateChunk, as snapshot_headers_ keeps
// it) and momentum, by parameter.
struct SnapshotFile {
  v1::StateChunk head;
  std::vector<std::vector<float>> momentum;
};

// Reads and checks one snapshot file: NOT_FOUND when it does not exist,
// DATA_LOSS naming what is wrong with it otherwise.
absl::StatusOr<SnapshotFile> ReadSnapshotFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT)
    return absl::NotFoundError(absl::StrCat("snapshot ", path, ": gone"));
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::DataLossError(
        absl::StrCat("snapshot ", path, ": cannot open it"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("snapshot ", path, ": ", why));
  };
  if (data.size() < 8 + 8 + 4 || data.compare(0, 8, kMagic, 8) != 0)
    return bad("not a dmuon snapshot");
  uint32_t crc;
  std::memcpy(&crc, data.data() + data.size() - 4, 4);
  if (crc !=
      static_cast<uint32_t>(crc32(
          0L, reinterpret_cast<const Bytef*>(data.data()), data.size() - 4))) {
    return bad("checksum mismatch");
  }
  uint64_t len;
  std::memcpy(&len, data.data() + 8, 8);
  SnapshotFile out;
  if (16 + len > data.size() - 4 ||
      !out.head.mutable_header()->ParseFromArray(data.data() + 16, len)) {
    return bad("unreadable header");
  }
  size_t off = 16 + len;
  for (const auto& p : out.head.header().parameters()) {
    const uint64_t n = p.shape_size() == 2 ? p.shape(0) * p.shape(1) : 0;
    if (off + n * 4 > data.size() - 4) return bad("truncated momentum");
    out.momentum.emplace_back(n);
    std::memcpy(out.momentum.back().data(), data.data() + off, n * 4);
    off += n * 4;
  }
  if (off != data.size() - 4) return bad("truncated momentum");
  return out;
}

v1::StateHeader HeaderOf(const Job& job) {
  v1::StateHeader h;
  h.set_job_id(job.id);
  h.set_completed_steps(job.completed_steps);
  for (const auto& p : job.table.params) *h.add_parameters() = ToSpec(p);
  for (const auto& g : job.table.groups) *h.add_groups() = g;
  return h;
}

}  // namespace

absl::StatusOr<std::vector<v1::StateChunk>> OptimizerService::StateChunksLocked(
    const Job& job) const {
  if (job.broken) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id,
        "' is broken (a step failed or a rank left mid-step): its state may "
        "be half a step ahead; restore from your last checkpoint"));
  }
  if (job.mid_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "' is in the middle of step ", job.completed_steps + 1,
        "; read or write state between steps"));
  }
  std::vector<v1::StateChunk> out;
  v1::StateChunk head;
  *head.mutable_header() = HeaderOf(job);
  out.push_back(std::move(head));
  const uint64_t max_chunk =
      transport::MaxChunkPayload(options_.max_message_bytes);
  for (size_t i = 0; i < job.params.size(); ++i) {
    const auto& m = job.params[i].momentum;
    const uint64_t bytes = m.size() * sizeof(float);
    const char* base = reinterpret_cast<const char*>(m.data());
    for (const auto& c : transport::SplitChunks(bytes, max_chunk)) {
      v1::StateChunk ch;
      auto* mc = ch.mutable_momentum();
      mc->set_param_id(static_cast<int>(i));
      mc->set_name(job.table.params[i].name);
      mc->set_offset(c.offset);
      mc->set_total_bytes(bytes);
      mc->set_data(base + c.offset, c.bytes);
      out.push_back(std::move(ch));
    }
  }
  return out;
}

absl::StatusOr<std::vector<v1::StateChunk>> OptimizerService::GetState(
    const std::string& session_id) {
  auto s = FindSession(session_id);
  if (!s) return absl::NotFoundError("no open session with this session_id");
  auto job = s->job.lock();
  if (!job) return absl::AbortedError("the session's job is gone");
  std::lock_guard<std::mutex> lock(job->mu);
  if (!job->broken && !job->mid_step()) {
    if (auto st = PullStateLocked(*job); !st.ok()) return st;
  }
  return StateChunksLocked(*job);
}

absl::StatusOr<int64_t> OptimizerService::SetState(
    const std::vector<v1::StateChunk>& chunks) {
  if (chunks.empty() || !chunks[0].has_header()) {
    return absl::InvalidArgumentError(
        "SetState: the first message must carry the header");
  }
  auto s = FindSession(chunks[0].session_id());
  if (!s)
    return absl::NotFoundError(
        "SetState: no open session with this session_id");
  auto job = s->job.lock();
  if (!job) return absl::AbortedError("the session's job is gone");
  const v1::StateHeader& h = chunks[0].header();
  std::lock_guard<std::mutex> lock(job->mu);
  if (job->mid_step() || job->broken) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id,
        "' is in the middle of a step; restore state before the first step"));
  }
  const auto& params = job->table.params;
  if (h.parameters_size() != static_cast<int>(params.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has ", h.parameters_size(),
                     " parameters; the job's table has ", params.size()));
  }
  for (int i = 0; i < h.parameters_size(); ++i) {
    const auto& sp = h.parameters(i);
    if (sp.name() != params[i].name || sp.shape_size() != 2 ||
        sp.shape(0) != params[i].shape.rows ||
        sp.shape(1) != params[i].shape.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("state parameter ", i, " '", sp.name(),
                       "' does not match the table's '", params[i].name, "' ",
                       kernels::ShapeString(params[i].shape)));
    }
  }
  if (h.completed_steps() < 0)
    return absl::InvalidArgumentError("completed_steps is negative");
  // Assemble into scratch: nothing changes unless every byte is accounted for.
  std::vector<std::vector<float>> mom(params.size());
  std::vector<uint64_t> got(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i)
    mom[i].assign(params[i].shape.elements(), 0.0f);
  for (size_t k = 1; k < chunks.size(); ++k) {
    if (!chunks[k].has_momentum())
      return absl::InvalidArgumentError("SetState: a second header");
    const v1::MomentumChunk& c = chunks[k].momentum();
    if (c.param_id() < 0 || c.param_id() >= static_cast<int>(params.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("momentum chunk for parameter id ", c.param_id(),
                       " which does not exist"));
    }
    const uint64_t bytes = mom[c.param_id()].size() * sizeof(float);
    if (c.offset() != got[c.param_id()] ||
        c.offset() + c.data().size() > bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "momentum chunk of '", params[c.param_id()].name, "' at offset ",
          c.offset(), " (", c.data().size(), " bytes) does not continue the ",
          bytes, "-byte tensor"));
    }
    std::memcpy(reinterpret_cast<char*>(mom[c.param_id()].data()) + c.offset(),
                c.data().data(), c.data().size());
    got[c.param_id()] += c.data().size();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (got[i] != mom[i].size() * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "momentum of '", params[i].name, "' is incomplete: ", got[i], " of ",
          mom[i].size() * sizeof(float), " bytes"));
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    job->params[i].momentum = std::move(mom[i]);
  if (auto st = PushStateLocked(*job); !st.ok()) {
    // Some executors may hold the new state and others the old: the job
    // cannot step until state is set again.
    job->broken = true;
    return st;
  }
  job->completed_steps = h.completed_steps();
  for (auto& r : job->ranks)
    if (r) r->step = job->completed_steps + 1;
  return job->completed_steps;
}

std::string OptimizerService::SerializeJobLocked(const Job& job) const {
  const std::string header = HeaderOf(job).SerializeAsString();
  std::string out(kMagic, 8);
  const uint64_t len = header.size();
  out.append(reinterpret_cast<const char*>(&len), sizeof(len));
  out += header;
  for (const auto& p : job.params) {
    out.append(reinterpret_cast<const char*>(p.momentum.data()),
               p.momentum.size() * sizeof(float));
  }
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(out.data()), out.size()));
  out.append(reinterpret_cast<const char*>(&crc), sizeof(crc));
  return out;
}

absl::Status OptimizerService::WriteSnapshot(const std::string& job_id,
                                             uint64_t job_serial,
                                             int64_t completed_steps,
                                             const std::string& bytes) {
  std::lock_guard<std::mutex> lock(snapshot_mu_);
  if (auto it = snapshot_steps_.find(job_serial);
      it != snapshot_steps_.end() && it->second > completed_steps) {
    return absl::OkStatus();  // a newer state of this job is on disk already
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string path = SnapshotPath(job_id);
  const std::string tmp = absl::StrCat(path, ".tmp");
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("snapshot: cannot create ", tmp, ": ", strerror(errno)));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      ::close(fd);
      return absl::UnavailableError(
          absl::StrCat("snapshot: writing ", tmp, ": ", strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || ::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("snapshot: cannot commit ", path, ": ", strerror(errno)));
  }
  int dir = ::open(options_.state_dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  snapshot_steps_[job_serial] = completed_steps;
  if (metrics_) {
    metrics_->Snapshot(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  return absl::OkStatus();
}

absl::Status OptimizerService::SnapshotAll() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, j] : jobs_) jobs.push_back(j);
  }
  absl::Status first;
  for (auto& j : jobs) {
    std::string bytes;
    int64_t steps = 0;
    {
      std::lock_guard<std::mutex> lock(j->mu);
      // Only consistent states; a job the reaper dropped saved its own.
      if (j->broken || j->dropped || j->mid_step()) continue;
      if (auto st = PullStateLocked(*j); !st.ok()) {
        if (first.ok()) first = st;
        continue;
      }
      bytes = SerializeJobLocked(*j);
      steps = j->completed_steps;
    }
    if (auto st = WriteSnapshot(j->id, j->serial, steps, bytes);
        !st.ok() && first.ok())
      first = st;
  }
  return first;
}

absl::Status OptimizerService::LoadSnapshots() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  DIR* d = ::opendir(options_.state_dir.c_str());
  if (!d) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--state-dir ", options_.state_dir, ": ", strerror(errno)));
  }
  std::vector<std::string> files;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.rfind("job-", 0) == 0 &&
        n.substr(n.size() - 5) == ".dmst")
      files.push_back(n);
  }
  ::closedir(d);
  // Each file is checked now (a bad one is reported at start) but its
  // momentum is read again only when its job is reopened.
  absl::Status first;
  for (const std::string& f : files) {
    const std::string path = absl::StrCat(options_.state_dir, "/", f);
    auto snap = ReadSnapshotFile(path);
    if (!snap.ok()) {
      if (first.ok())
        first = absl::DataLossError(
            absl::StrCat(snap.status().message(), "; ignored"));
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    snapshot_files_[snap->head.header().job_id()] = path;
  }
  return first;
}

std::string OptimizerService::SnapshotPath(const std::string& job_id) const {
  return absl::StrCat(options_.state_dir, "/job-", HexOf(job_id), ".dmst");
}

absl::Status OptimizerService::LoadPendingSnapshot(const std::string& job_id) {
  std::unique_lock<std::mutex> lock(mu_);
  snapshot_loaded_.wait(lock, [&] { return !snapshot_loading_.count(job_id); });
  auto it = snapshot_files_.find(job_id);
  if (it == snapshot_files_.end() || jobs_.count(job_id) ||
      snapshot_headers_.count(job_id)) {
    return absl::OkStatus();
  }
  const std::string path = it->second;
  snapshot_loading_.insert(job_id);
  lock.unlock();
  auto snap = ReadSnapshotFile(path);
  lock.lock();
  snapshot_loading_.erase(job_id);
  snapshot_loaded_.notify_all();
  if (!snap.ok()) {
    if (absl::IsNotFound(snap.status())) {
      // Removed by the operator: the job starts afresh.
      if (auto f = snapshot_files_.find(job_id);
          f != snapshot_files_.end() && f->second == path) {
        snapshot_files_.erase(f);
      }
      return absl::OkStatus();
    }
    return absl::DataLossError(
        absl::StrCat("job '", job_id,
                     "' has a snapshot in --state-dir that cannot be read (",
                     snap.status().message(), "); remove ", path,
                     " to start the job from zero momentum, or fix it"));
  }
  if (snap->head.header().job_id() != job_id) {
    return absl::DataLossError(absl::StrCat(
        "snapshot ", path, " is of job '", snap->head.header().job_id(),
        "', not '", job_id, "'; remove it to start the job from zero"));
  }
  snapshot_files_.erase(job_id);
  snapshot_headers_[job_id] = std::move(snap->head);
  snapshot_momentum_[job_id] = std::move(snap->momentum);
  return absl::OkStatus();
}

}  // namespace dmuon::server
