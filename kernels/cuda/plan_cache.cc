#include "kernels/cuda/plan_cache.h"

#include <utility>

namespace dmuon::kernels::cuda {

bool PlanCache::Contains(const std::string& key) const {
  return entries_.count(key) != 0;
}

bool PlanCache::InUse(const std::string& key) const {
  auto it = entries_.find(key);
  return it != entries_.end() && !it->second.owners.empty();
}

void PlanCache::Touch(const std::string& key, Entry& e,
                      const std::vector<uint64_t>& owners) {
  if (e.last_use != 0) by_use_.erase(e.last_use);
  e.last_use = ++clock_;
  by_use_.emplace(e.last_use, key);
  for (uint64_t o : owners) {
    e.owners.insert(o);
    owned_[o].insert(key);
  }
}

bool PlanCache::Use(const std::string& key,
                    const std::vector<uint64_t>& owners) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return false;
  Touch(key, it->second, owners);
  return true;
}

void PlanCache::Remove(const std::string& key) {
  auto it = entries_.find(key);
  by_use_.erase(it->second.last_use);
  for (uint64_t o : it->second.owners) {
    auto owned = owned_.find(o);
    owned->second.erase(key);
    if (owned->second.empty()) owned_.erase(owned);
  }
  bytes_ -= it->second.bytes;
  entries_.erase(it);
  ++freed_;
}

std::vector<std::string> PlanCache::MakeRoom(uint64_t bytes) {
  std::vector<std::string> evicted;
  const auto fits = [&] { return bytes_ <= cap_ && bytes <= cap_ - bytes_; };
  for (auto it = by_use_.begin(); it != by_use_.end() && !fits();) {
    const std::string key = it->second;
    ++it;  // Remove erases the current position
    if (InUse(key)) continue;
    Remove(key);
    evicted.push_back(key);
  }
  return evicted;
}

void PlanCache::Insert(const std::string& key, uint64_t bytes,
                       const std::vector<uint64_t>& owners) {
  Entry& e = entries_[key];
  e.bytes = bytes;
  bytes_ += bytes;
  Touch(key, e, owners);
  if (bytes_ > cap_) ++over_cap_;
}

std::vector<std::string> PlanCache::Release(uint64_t owner) {
  std::vector<std::string> released;
  auto owned = owned_.find(owner);
  if (owned == owned_.end()) return released;
  const std::set<std::string> keys = std::move(owned->second);
  owned_.erase(owned);
  std::map<uint64_t, std::string> unreferenced;  // by last use
  for (const std::string& key : keys) {
    Entry& e = entries_.at(key);
    e.owners.erase(owner);
    if (e.owners.empty()) unreferenced.emplace(e.last_use, key);
  }
  for (const auto& [use, key] : unreferenced) {
    Remove(key);
    released.push_back(key);
  }
  return released;
}

}  // namespace dmuon::kernels::cuda
