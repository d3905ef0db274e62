// The bookkeeping of a Context's plan cache (context_impl.h), in plain C++
// (no CUDA types) so its policy is built and tested in the default
// configuration. It tracks keys, device bytes, recency and owners; the
// Context holds the plans and frees those whose keys this class returns.
//
// Policy:
//   - A plan is *in use* while an open job references it: every call that
//     uses it names the jobs it runs for (its owners; the CUDA executor
//     passes the jobs of the batch), and Release(job) drops that job's
//     references. A plan used with no owner (tools, benchmarks, tests, the
//     autotuner's measurements) is never in use.
//   - Plans in use are never evicted.
//   - Release(job) frees at once the plans it leaves referenced by no open
//     job (plans used with no owner are not affected).
//   - Before a new plan of B bytes is created, MakeRoom evicts plans not in
//     use, least recently used first, until bytes() + B <= cap() or none is
//     left. So bytes() stays within the cap unless the plans in use (with
//     the new one) exceed it alone; then the new plan is added anyway — a
//     job needs it now and the device may well have the memory — and
//     over_cap() counts it, so the owner can report it. Plans in use are
//     freed when their jobs release them; a later insertion evicts the rest
//     down to the cap again.
// Not thread-safe: one owner (a Context) calls it.

#ifndef DMUON_KERNELS_CUDA_PLAN_CACHE_H_
#define DMUON_KERNELS_CUDA_PLAN_CACHE_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace dmuon::kernels::cuda {

class PlanCache {
 public:
  explicit PlanCache(uint64_t cap_bytes) : cap_(cap_bytes) {}

  uint64_t cap() const { return cap_; }
  // Device bytes of the cached plans.
  uint64_t bytes() const { return bytes_; }
  size_t size() const { return entries_.size(); }
  bool Contains(const std::string& key) const;
  // Referenced by at least one open job.
  bool InUse(const std::string& key) const;
  // Plans evicted or released so far.
  uint64_t freed() const { return freed_; }
  // Insertions that left bytes() above the cap (everything else in use).
  uint64_t over_cap() const { return over_cap_; }

  // A cached plan is used now by `owners` (job serials; empty: none): it
  // becomes the most recently used and each owner references it. False (and
  // nothing changes) when `key` is not cached.
  bool Use(const std::string& key, const std::vector<uint64_t>& owners);

  // Before creating a plan of `bytes`: the keys evicted (removed here; the
  // caller frees their plans), least recently used first, never one in use,
  // until bytes() + `bytes` <= cap() or no plan outside use is left.
  std::vector<std::string> MakeRoom(uint64_t bytes);

  // Adds a plan (not cached yet) of `bytes`, used now by `owners`. Call
  // MakeRoom first; counts over_cap() when bytes() then exceeds the cap.
  void Insert(const std::string& key, uint64_t bytes,
              const std::vector<uint64_t>& owners);

  // Drops `owner`'s references; returns (and removes) the keys of the plans
  // no open job references any longer, least recently used first.
  std::vector<std::string> Release(uint64_t owner);

 private:
  struct Entry {
    uint64_t bytes = 0;
    uint64_t last_use = 0;
    std::set<uint64_t> owners;
  };
  void Touch(const std::string& key, Entry& e,
             const std::vector<uint64_t>& owners);
  void Remove(const std::string& key);

  const uint64_t cap_;
  uint64_t bytes_ = 0;
  uint64_t clock_ = 0;
  uint64_t freed_ = 0;
  uint64_t over_cap_ = 0;
  std::map<std::string, Entry> entries_;
  // Keys by last use: the eviction order.
  std::map<uint64_t, std::string> by_use_;
  // Keys each owner references.
  std::map<uint64_t, std::set<std::string>> owned_;
};

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_PLAN_CACHE_H_
