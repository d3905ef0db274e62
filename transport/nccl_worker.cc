// NcclWorker (nccl.h): the one thread that makes a device's NCCL calls.

#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/nccl.h"

namespace dmuon::transport {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

NcclWorker::NcclWorker(NcclPolicy policy) : policy_(policy) {
  thread_ = std::thread([this] { Loop(); });
}

NcclWorker::~NcclWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

int NcclWorker::Add(std::unique_ptr<NcclComm> comm) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<Entry>();
  e->comm = std::move(comm);
  e->added = Clock::now();
  const int id = next_id_++;
  comms_[id] = std::move(e);
  cv_.notify_all();
  return id;
}

void NcclWorker::Submit(int comm, std::vector<NcclTransfer> transfers,
                        std::function<void(absl::Status)> posted,
                        std::function<void(absl::Status)> completed) {
  Group g;
  g.transfers = std::move(transfers);
  g.posted = std::move(posted);
  g.completed = std::move(completed);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(comm);
  if (it == comms_.end()) {
    // Removed: fail it on the worker thread, through a dead entry.
    auto e = std::make_unique<Entry>();
    e->aborted = absl::FailedPreconditionError(
        "the job's NCCL communicator was removed");
    e->done = e->remove = true;
    e->queued.push_back(std::move(g));
    comms_[-next_id_++] = std::move(e);
  } else {
    it->second->queued.push_back(std::move(g));
  }
  cv_.notify_all();
}

void NcclWorker::Abort(int comm, absl::Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(comm);
  if (it == comms_.end()) return;
  Entry& e = *it->second;
  if (!e.abort_requested && e.aborted.ok() && !e.done) {
    e.abort_requested = true;
    e.abort_reason = std::move(why);
  }
  cv_.notify_all();
}

void NcclWorker::AbortAndWait(int comm, absl::Status why) {
  Abort(comm, std::move(why));
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    auto it = comms_.find(comm);
    return it == comms_.end() || it->second->done;
  });
}

absl::Status NcclWorker::status(int comm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(comm);
  if (it == comms_.end()) return absl::NotFoundError("no such communicator");
  return it->second->aborted;
}

void NcclWorker::Remove(int comm) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(comm);
  if (it != comms_.end()) it->second->remove = true;
  cv_.notify_all();
}

void NcclWorker::FailGroups(std::deque<Group>& groups,
                            const absl::Status& why) {
  for (auto& g : groups) {
    if (!g.was_posted && g.posted) g.posted(why);
    if (g.completed) g.completed(why);
  }
  groups.clear();
}

void NcclWorker::Fail(Entry& e, const absl::Status& why) {
  std::deque<Group> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e.aborted = why;
    queued.swap(e.queued);
  }
  e.comm->Abort();
  FailGroups(e.pending, why);
  FailGroups(queued, why);
  std::lock_guard<std::mutex> lock(mu_);
  e.done = true;
  cv_.notify_all();
}

bool NcclWorker::Visit(Entry& e) {
  std::deque<Group> batch;
  absl::Status verdict, aborted;
  bool done = false, remove = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = e.done;
    remove = e.remove;
    aborted = e.aborted;
    if (done) batch.swap(e.queued);  // submitted after the end: fail them
    if (e.abort_requested) verdict = e.abort_reason;
    if (verdict.ok() && remove && (!e.queued.empty() || !e.pending.empty()))
      verdict = absl::CancelledError("the job's NCCL transport was closed");
  }
  if (done) {
    FailGroups(batch, aborted.ok()
                          ? absl::FailedPreconditionError(
                                "the job's NCCL communicator is closed")
                          : aborted);
    return false;
  }
  if (verdict.ok()) {
    const absl::Status polled = e.comm->Poll();
    e.initialized = polled.ok();
    NcclHealth h;
    h.initialized = e.initialized;
    h.since_start_seconds = Since(e.added);
    h.oldest_pending_seconds =
        e.pending.empty() ? 0 : Since(e.pending.front().posted_at);
    if (!polled.ok() && !absl::IsUnavailable(polled)) h.async_error = polled;
    verdict = JudgeNccl(policy_, h);
  }
  if (!verdict.ok()) {
    Fail(e, verdict);
    return false;
  }
  if (remove) {  // nothing pending
    e.comm->Close();
    std::lock_guard<std::mutex> lock(mu_);
    e.done = true;
    cv_.notify_all();
    return false;
  }
  if (e.initialized) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.swap(e.queued);
    }
    while (!batch.empty()) {
      Group& g = batch.front();
      auto marker = e.comm->Post(g.transfers);
      if (!marker.ok()) {
        // This group and everything after it fail with the abort.
        std::lock_guard<std::mutex> lock(mu_);
        while (!batch.empty()) {
          e.queued.push_front(std::move(batch.back()));
          batch.pop_back();
        }
        e.abort_requested = true;
        e.abort_reason = absl::Status(
            marker.status().code(),
            absl::StrCat("posting an NCCL group: ", marker.status().message()));
        return true;
      }
      g.marker = *marker;
      g.was_posted = true;
      g.posted_at = Clock::now();
      if (g.posted) g.posted(absl::OkStatus());
      e.pending.push_back(std::move(g));
      batch.pop_front();
    }
  }
  while (!e.pending.empty()) {
    auto complete = e.comm->Done(e.pending.front().marker);
    if (!complete.ok()) {
      Fail(e, complete.status());
      return false;
    }
    if (!*complete) break;
    Group g = std::move(e.pending.front());
    e.pending.pop_front();
    if (g.completed) g.completed(absl::OkStatus());
  }
  return !e.pending.empty();
}

void NcclWorker::Loop() {
  bool busy = false;
  for (;;) {
    std::vector<Entry*> entries;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock,
                   busy ? std::chrono::microseconds(200)
                        : std::chrono::microseconds(50000),
                   [&] {
                     if (stop_) return true;
                     for (const auto& [id, e] : comms_) {
                       if (e->abort_requested || e->remove ||
                           (!e->queued.empty() && (e->initialized || e->done)))
                         return true;
                     }
                     return false;
                   });
      stopping = stop_;
      for (auto& [id, e] : comms_) {
        if (stopping) e->remove = true;
        entries.push_back(e.get());
      }
    }
    busy = false;
    for (Entry* e : entries) busy |= Visit(*e);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = comms_.begin(); it != comms_.end();) {
      Entry& e = *it->second;
      const bool drained = e.queued.empty() && e.pending.empty();
      it = e.done && e.remove && drained ? comms_.erase(it) : std::next(it);
    }
    if (stopping && comms_.empty()) return;
  }
}

}  // namespace dmuon::transport
