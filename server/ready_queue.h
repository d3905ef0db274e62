// One job's ready matrices on one executor (the Scheduler's per-job queue):
// in the order they run, forward order then arrival, and grouped by batch
// key (SameBatchKey: shape and Newton–Schulz options), so that taking the
// next batch never scans or sorts the queue.
//
// Why: the scheduler sorted the whole queue at each pick and scanned it for
// batch mates, O(n log n) a pick and O(n^2 log n) a step when a trainer's
// n matrices are all queued (its declarations outrun the executor). At
// 8,192 small matrices that was 40 % of dmuond's CPU (perf, 2026-12-07).
// Here a push costs O(log n + k) and a pick O(b log n), for k distinct
// batch keys in the queue (a handful: one per shape) and a batch of b.
//
// Not thread-safe: the Scheduler holds its mutex around every call.

#ifndef DMUON_SERVER_READY_QUEUE_H_
#define DMUON_SERVER_READY_QUEUE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "server/executor.h"

namespace dmuon::server {

class Work;  // scheduler.h; only held here

class ReadyQueue {
 public:
  struct Entry {
    int32_t order = 0;  // Work::forward_order(): smaller runs first
    uint64_t seq = 0;   // arrival, unique: ties in `order` run by it
    std::chrono::steady_clock::time_point submitted;
    std::shared_ptr<Work> work;
    // The work's batch key (Work::shape(), Work::muon()): entries batch
    // together when SameBatchKey says so (never with a null `muon`).
    kernels::Shape shape;
    const MuonParams* muon = nullptr;
  };

  // Adds `e`; its (order, seq) must not be in the queue.
  void Push(Entry e);
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // Removes and returns the first entry (least order, then seq) and up to
  // `max_batch` - 1 more of its batch key, earliest first. Empty when the
  // queue is.
  std::vector<Entry> PopBatch(int max_batch);

 private:
  using Key = std::pair<int32_t, uint64_t>;  // (order, seq): run order
  struct Class {
    ComputeTask key;        // shape and muon of one of its members
    std::set<Key> members;  // in run order
  };
  struct Held {
    Entry entry;
    int klass = -1;  // its Class's id; -1: batches with nothing
  };
  // The class entries of `e`'s key join (made when none is live); -1 for
  // a null muon.
  int ClassOf(const Entry& e);
  // Takes `it` out of the queue (and its class, dropped when empty).
  Entry Take(std::map<Key, Held>::iterator it);

  std::map<Key, Held> entries_;
  std::map<int, Class> classes_;  // live (non-empty) classes by id
  int next_class_ = 0;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_READY_QUEUE_H_
