// Which elements of a matrix one rank's local tensor holds: the daemon's
// form of every Sharding mode (docs/protocol.md "Sharding").
//
// A local tensor is the matrix's rows `rows()` by its columns `cols()`, each
// a list of index runs [begin, end) in local order, stored row-major: local
// element (i, j) is matrix element (R[i], C[j]), where R and C list the
// runs' indices in order. SHARDING_REPLICATED and SHARDING_UNREDUCED hold
// the whole matrix, SHARDING_ROWS one run of rows and every column, and
// SHARDING_BLOCKS any product of runs (a DTensor's local shard under any
// Shard/_StridedShard/Replicate placements), possibly nothing.
//
// CUDA-free: the host path copies with ScatterToMatrix/GatherFromMatrix and
// the device path turns Blocks() into 2-D copies
// (server/cuda/cuda_executor_io.cc).

#ifndef DMUON_SERVER_SHARD_MAP_H_
#define DMUON_SERVER_SHARD_MAP_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/types.h"

namespace dmuon::server {

struct IndexRun {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const IndexRun& o) const {
    return begin == o.begin && end == o.end;
  }
  template <typename H>
  friend H AbslHashValue(H h, const IndexRun& r) {
    return H::combine(std::move(h), r.begin, r.end);
  }
};

// One rectangle of a local tensor: its `height` x `width` elements at
// (local_row, local_col) of the local tensor are those at (row, col) of the
// matrix.
struct Block {
  int64_t local_row = 0, local_col = 0;
  int64_t row = 0, col = 0;
  int64_t height = 0, width = 0;
};

// The most runs one list may have, and the most blocks (row runs x column
// runs) one rank's map may have: a DTensor layout needs a handful; the
// bounds keep a hostile table from making the daemon's checks and copies
// quadratic.
inline constexpr int kMaxRuns = 4096;
inline constexpr int64_t kMaxBlocks = int64_t{1} << 16;
// The most blocks of one matrix over all its ranks' maps (each is a copy
// per step on the device path), and the most compressed cells one
// OpenSession's cover checks may examine (CheckCover's `budget`).
inline constexpr int64_t kMaxMatrixBlocks = int64_t{1} << 18;
inline constexpr int64_t kCoverBudget = int64_t{1} << 24;

class ShardMap {
 public:
  ShardMap() = default;
  // The whole matrix.
  static ShardMap Whole(kernels::Shape shape);
  // Rows [begin, end), every column.
  static ShardMap Rows(int64_t begin, int64_t end, int64_t cols);
  // A SHARDING_BLOCKS rank's map. INVALID_ARGUMENT naming `who` (e.g.
  // "parameter 'w'") and the field when a run is empty, outside the matrix
  // or overlaps another of its list, when exactly one list is empty, or
  // when a limit above is passed. Both lists empty: the rank holds nothing.
  static absl::StatusOr<ShardMap> FromRuns(std::vector<IndexRun> rows,
                                           std::vector<IndexRun> cols,
                                           kernels::Shape shape,
                                           const std::string& who);

  const std::vector<IndexRun>& rows() const { return rows_; }
  const std::vector<IndexRun>& cols() const { return cols_; }
  int64_t local_rows() const { return local_rows_; }
  int64_t local_cols() const { return local_cols_; }
  int64_t elements() const { return local_rows_ * local_cols_; }
  bool empty() const { return elements() == 0; }
  // Row-major order of the local tensor equals the matrix's from element
  // offset() on: one run of rows by every column of `shape`.
  bool Contiguous(kernels::Shape shape) const;
  int64_t offset(kernels::Shape shape) const {
    return rows_.empty() ? 0 : rows_[0].begin * shape.cols;
  }
  // Every rectangle (row run x column run), local row-major order.
  std::vector<Block> Blocks() const;
  // "rows [0,4) [8,12) x cols [0,16)", for messages and logs (a list of
  // more than 4 runs shows its first 4 and the count).
  std::string DebugString() const;

  // The same elements in the same local order (replicas hold equal maps).
  bool operator==(const ShardMap& o) const {
    return rows_ == o.rows_ && cols_ == o.cols_;
  }
  template <typename H>
  friend H AbslHashValue(H h, const ShardMap& m) {
    return H::combine(std::move(h), m.rows_, m.cols_);
  }

 private:
  std::vector<IndexRun> rows_, cols_;
  int64_t local_rows_ = 0, local_cols_ = 0;
};

// Copies a local tensor (map.elements() floats) into its elements of the
// matrix (shape.elements() floats), and back.
void ScatterToMatrix(const ShardMap& map, kernels::Shape shape,
                     const float* local, float* matrix);
void GatherFromMatrix(const ShardMap& map, kernels::Shape shape,
                      const float* matrix, float* local);

// For the gradient gather: the index of each distinct non-empty map's
// lowest holder among `maps` (rank order), ascending. Equal maps (whole
// replicas, e.g. HSDP's) are read once.
std::vector<int> DistinctHolders(absl::Span<const ShardMap* const> maps);

// OK when every element of the matrix is held by at least one of `maps`
// (one per rank, rank order); otherwise INVALID_ARGUMENT naming parameter
// `name`, the first element (row-major) no rank holds, and the first ranks'
// maps. Also INVALID_ARGUMENT when the maps have more than
// kMaxMatrixBlocks blocks together, or when their runs cut the matrix into
// more compressed cells than `*budget` has left (taken from it: one
// OpenSession's checks share one budget, so a table of many parameters
// cannot make them cost more than kCoverBudget cells).
absl::Status CheckCover(absl::Span<const ShardMap* const> maps,
                        kernels::Shape shape, const std::string& name,
                        int64_t* budget);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SHARD_MAP_H_
