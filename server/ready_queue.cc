#include "server/ready_queue.h"

namespace dmuon::server {

int ReadyQueue::ClassOf(const Entry& e) {
  if (e.muon == nullptr) return -1;
  ComputeTask key;
  key.shape = e.shape;
  key.muon = e.muon;
  for (const auto& [id, c] : classes_) {
    if (SameBatchKey(c.key, key)) return id;
  }
  const int id = next_class_++;
  classes_[id].key = key;
  return id;
}

void ReadyQueue::Push(Entry e) {
  const Key k{e.order, e.seq};
  const int klass = ClassOf(e);
  if (klass >= 0) classes_[klass].members.insert(k);
  entries_[k] = Held{std::move(e), klass};
}

ReadyQueue::Entry ReadyQueue::Take(std::map<Key, Held>::iterator it) {
  if (it->second.klass >= 0) {
    auto c = classes_.find(it->second.klass);
    c->second.members.erase(it->first);
    if (c->second.members.empty()) {
      classes_.erase(c);
    } else if (c->second.key.muon == it->second.entry.muon) {
      // The key points at a queued member's options, never at those of
      // a work taken out (which nothing here keeps alive).
      c->second.key.muon = entries_.at(*c->second.members.begin()).entry.muon;
    }
  }
  Entry e = std::move(it->second.entry);
  entries_.erase(it);
  return e;
}

std::vector<ReadyQueue::Entry> ReadyQueue::PopBatch(int max_batch) {
  std::vector<Entry> picked;
  if (entries_.empty()) return picked;
  const int klass = entries_.begin()->second.klass;
  picked.push_back(Take(entries_.begin()));
  if (klass < 0) return picked;
  auto c = classes_.find(klass);  // gone when the first was its last
  while (c != classes_.end() && static_cast<int>(picked.size()) < max_batch) {
    const Key next = *c->second.members.begin();
    const bool last = c->second.members.size() == 1;
    picked.push_back(Take(entries_.find(next)));
    if (last) break;  // its class was dropped
  }
  return picked;
}

}  // namespace dmuon::server
