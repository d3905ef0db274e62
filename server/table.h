// The parameter table of a job, validated and in the daemon's own types.
//
// Built from an OpenSessionRequest; every rank of a job must register the
// same table (same names, whole-matrix shapes, dtypes, sharding modes,
// forward order, layers and hyperparameters; only the row range of a
// SHARDING_ROWS parameter and the runs of a SHARDING_BLOCKS one differ per
// rank). CompareTables names the first
// difference.

#ifndef DMUON_SERVER_TABLE_H_
#define DMUON_SERVER_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kernels.h"
#include "proto/dmuon.pb.h"
#include "server/shard_map.h"

namespace dmuon::server {

struct MuonParams {
  double momentum = 0.95;
  bool nesterov = true;
  kernels::NsOptions ns;  // schedule, eps, method
  kernels::LrAdjust adjust = kernels::LrAdjust::kOriginal;
};

struct ParamInfo {
  std::string name;
  kernels::Shape shape;  // whole matrix
  v1::DType dtype = v1::DTYPE_F32;
  v1::Sharding sharding = v1::SHARDING_REPLICATED;
  int32_t forward_order = 0;
  int32_t group = 0;
  int32_t layer = -1;  // ParameterSpec.layer; -1: unset
  MuonParams muon;
  double lr_scale = 1.0;
};

struct Table {
  std::vector<ParamInfo> params;
  std::vector<v1::HyperparameterGroup> groups;  // as sent (for GetState)
};

// The fp32 momentum a job of `table` holds (whole matrices), in bytes.
inline uint64_t MomentumBytesOf(const Table& table) {
  uint64_t n = 0;
  for (const ParamInfo& p : table.params)
    n += static_cast<uint64_t>(p.shape.elements()) * sizeof(float);
  return n;
}

// Validates the request's table. Errors are INVALID_ARGUMENT naming the
// parameter (or group) and the field; an unsupported dtype is UNIMPLEMENTED.
// `shards` receives which elements this rank holds, per parameter (the
// whole matrix unless SHARDING_ROWS or SHARDING_BLOCKS; shard_map.h).
absl::StatusOr<Table> BuildTable(const v1::OpenSessionRequest& req,
                                 std::vector<ShardMap>* shards);

// OK when `theirs` (rank `their_rank`) matches `ours` (rank `our_rank`);
// otherwise INVALID_ARGUMENT naming the parameter and both values, e.g.
// "parameter 'w1' shape [4096,11008] does not match rank 0's [4096,14336]".
absl::Status CompareTables(const Table& ours, int our_rank, const Table& theirs,
                           int their_rank);

// The proto form of a table entry (for GetState and snapshots).
v1::ParameterSpec ToSpec(const ParamInfo& p);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_TABLE_H_
