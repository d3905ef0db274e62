// The memory every GetState stream together may hold (issue: a stalled
// reader held a maximum-size chunk and its serialized copy, about 128 MiB,
// with no limit on readers). A reader leases the bytes of its next chunk
// (twice them: the chunk and the copy gRPC serializes, which lives until
// the write returns) before it copies anything, and gives them back when it
// asks for the next one or goes. Leases never add up past the capacity,
// except that one request is always granted when nothing is leased at all,
// so that a single reader whose smallest unit (a parameter read whole from
// executors that hold state) is larger than the capacity still progresses.
// Plain C++, tested on the CPU (read_budget_test.cc).

#ifndef DMUON_SERVER_READ_BUDGET_H_
#define DMUON_SERVER_READ_BUDGET_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dmuon::server {

class ReadBudget {
 public:
  // Bytes leased back on destruction (or on assignment over it).
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) {
      o.budget_ = nullptr;
      o.bytes_ = 0;
    }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }
    uint64_t bytes() const { return bytes_; }
    void Release();

   private:
    friend class ReadBudget;
    Lease(ReadBudget* budget, uint64_t bytes)
        : budget_(budget), bytes_(bytes) {}
    ReadBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // `capacity` > 0 bytes. Outlives every lease.
  explicit ReadBudget(uint64_t capacity) : capacity_(capacity) {}
  ReadBudget(const ReadBudget&) = delete;
  ReadBudget& operator=(const ReadBudget&) = delete;

  // Between `min` and `want` bytes (min <= want): as many as are free, once
  // at least `min` are (or nothing is leased), waiting up to `wait`.
  // RESOURCE_EXHAUSTED naming the capacity and what is leased when the wait
  // ends first.
  absl::StatusOr<Lease> Acquire(uint64_t min, uint64_t want,
                                absl::Duration wait);

  uint64_t capacity() const { return capacity_; }
  uint64_t leased() const;
  int leases() const;

 private:
  void Give(uint64_t bytes);

  const uint64_t capacity_;
  mutable absl::Mutex mu_;
  uint64_t leased_ ABSL_GUARDED_BY(mu_) = 0;
  int leases_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_READ_BUDGET_H_
