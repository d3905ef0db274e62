#include "server/mark_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::server {

MarkStore::MarkStore(int per_job, uint64_t budget_bytes)
    : per_job_(std::max(per_job, 1)), budget_(budget_bytes) {}

uint64_t MarkStore::BytesOf(const std::vector<std::vector<float>>& momentum) {
  uint64_t n = 0;
  for (const auto& m : momentum) n += m.size() * sizeof(float);
  return n;
}

absl::Status MarkStore::CheckFits(uint64_t bytes) const {
  if (bytes <= budget_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "a mark of ", bytes, " bytes of fp32 momentum is larger than all the ",
      "daemon may keep as marks, --mark-bytes=", budget_,
      ": raise --mark-bytes, or checkpoint the momentum in the trainer's "
      "state_dict instead"));
}

MarkList MarkStore::ListLocked(const std::string& job_id) const {
  MarkList out;
  auto it = marks_.find(job_id);
  if (it == marks_.end()) return out;
  std::vector<std::pair<uint64_t, int64_t>> order;
  for (const auto& [step, h] : it->second) {
    order.emplace_back(h.seq, step);
    out.bytes += h.bytes;
  }
  std::sort(order.begin(), order.end());
  for (const auto& [seq, step] : order) out.steps.push_back(step);
  return out;
}

Mark MarkStore::RemoveLocked(const std::string& job_id, int64_t step) {
  auto job = marks_.find(job_id);
  auto it = job->second.find(step);
  Mark out;
  out.header = std::move(it->second.mark.header);
  out.path = std::move(it->second.mark.path);
  total_ -= it->second.bytes;
  job->second.erase(it);
  if (job->second.empty()) marks_.erase(job);
  return out;
}

void MarkStore::LimitCountLocked(const std::string& job_id,
                                 std::vector<Mark>* dropped) {
  for (;;) {
    auto job = marks_.find(job_id);
    if (job == marks_.end() ||
        static_cast<int>(job->second.size()) < per_job_) {
      return;
    }
    auto oldest = std::min_element(job->second.begin(), job->second.end(),
                                   [](const auto& a, const auto& b) {
                                     return a.second.seq < b.second.seq;
                                   });
    dropped->push_back(RemoveLocked(job_id, oldest->first));
  }
}

absl::StatusOr<MarkStore::Added> MarkStore::Add(const std::string& job_id,
                                                Mark mark) {
  const int64_t step = mark.header.completed_steps();
  const uint64_t bytes = BytesOf(mark.momentum);
  absl::MutexLock lock(&mu_);
  Added out;
  if (auto st = CheckFits(bytes); !st.ok()) return st;
  if (FindLocked(job_id, step) != nullptr) {
    out.existed = true;
    Mark old = RemoveLocked(job_id, step);
    if (!old.path.empty() && old.path != mark.path) {
      out.dropped.push_back(std::move(old));
    }
  }
  LimitCountLocked(job_id, &out.dropped);
  // The oldest marks daemon-wide go until this one fits.
  while (total_ + bytes > budget_) {
    const std::string* oldest_job = nullptr;
    int64_t oldest_step = 0;
    uint64_t oldest_seq = 0;
    for (const auto& [id, steps] : marks_) {
      for (const auto& [s, h] : steps) {
        if (h.bytes == 0 || (oldest_job && h.seq >= oldest_seq)) continue;
        oldest_job = &id;
        oldest_step = s;
        oldest_seq = h.seq;
      }
    }
    const std::string id = *oldest_job;  // total_ > 0: one holds bytes
    Held& held = marks_[id][oldest_step];
    if (!held.mark.path.empty()) {
      // On disk too: only its memory goes (read from its file if resumed),
      // so one tenant's marks never delete another's durable ones.
      total_ -= held.bytes;
      held.bytes = 0;
      std::vector<std::vector<float>>().swap(held.mark.momentum);
      continue;
    }
    out.dropped.push_back(RemoveLocked(id, oldest_step));
  }
  marks_[job_id][step] = Held{std::move(mark), bytes, next_seq_++};
  total_ += bytes;
  out.list = ListLocked(job_id);
  return out;
}

std::vector<Mark> MarkStore::AddOnDisk(const std::string& job_id, Mark mark) {
  const int64_t step = mark.header.completed_steps();
  mark.momentum.clear();
  absl::MutexLock lock(&mu_);
  std::vector<Mark> dropped;
  if (auto job = marks_.find(job_id);
      job != marks_.end() && job->second.count(step) > 0) {
    return dropped;
  }
  LimitCountLocked(job_id, &dropped);
  marks_[job_id][step] = Held{std::move(mark), 0, next_seq_++};
  return dropped;
}

std::optional<Mark> MarkStore::Remove(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (FindLocked(job_id, step) == nullptr) return std::nullopt;
  return RemoveLocked(job_id, step);
}

bool MarkStore::Has(const std::string& job_id, int64_t step) const {
  absl::MutexLock lock(&mu_);
  return FindLocked(job_id, step) != nullptr;
}

const MarkStore::Held* MarkStore::FindLocked(const std::string& job_id,
                                             int64_t step) const {
  auto job = marks_.find(job_id);
  if (job == marks_.end()) return nullptr;
  auto it = job->second.find(step);
  return it == job->second.end() ? nullptr : &it->second;
}

std::optional<Mark> MarkStore::Get(const std::string& job_id,
                                   int64_t step) const {
  absl::MutexLock lock(&mu_);
  const Held* h = FindLocked(job_id, step);
  if (!h) return std::nullopt;
  return h->mark;
}

std::optional<v1::StateHeader> MarkStore::Header(const std::string& job_id,
                                                 int64_t step) const {
  absl::MutexLock lock(&mu_);
  const Held* h = FindLocked(job_id, step);
  if (!h) return std::nullopt;
  return h->mark.header;
}

MarkList MarkStore::List(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return ListLocked(job_id);
}

std::map<std::string, MarkList> MarkStore::All() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, MarkList> out;
  for (const auto& [id, steps] : marks_) out[id] = ListLocked(id);
  return out;
}

std::vector<Mark> MarkStore::DropJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  std::vector<Mark> out;
  while (marks_.count(job_id) > 0)
    out.push_back(RemoveLocked(job_id, marks_[job_id].begin()->first));
  return out;
}

uint64_t MarkStore::total_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

}  // namespace dmuon::server
