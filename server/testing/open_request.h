// Test-only: OpenSessionRequests for a table of parameters, as a client
// would send them. Header-only, testonly.

#ifndef DMUON_SERVER_TESTING_OPEN_REQUEST_H_
#define DMUON_SERVER_TESTING_OPEN_REQUEST_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "proto/dmuon.pb.h"

namespace dmuon::server::testing {

struct TableParam {
  std::string name;
  int64_t rows, cols;
  v1::Sharding sharding;
};

// Rank `rank` of `world` of job `job` over transport `t`: protocol version
// 1, one group (adjust_lr_fn "original"), `params` in forward order; a
// SHARDING_ROWS parameter's rows cut in blocks of ceil(rows / world), rank
// by rank (the last ones shorter or empty).
inline v1::OpenSessionRequest OpenRequest(
    const std::string& job, int rank, int world, v1::Transport t,
    const std::vector<TableParam>& params) {
  v1::OpenSessionRequest r;
  r.set_protocol_version(v1::PROTOCOL_VERSION_1);
  r.set_job_id(job);
  r.set_rank(rank);
  r.set_world_size(world);
  r.set_transport(t);
  r.add_groups()->set_adjust_lr_fn("original");
  int order = 0;
  for (const TableParam& p : params) {
    auto* s = r.add_parameters();
    s->set_name(p.name);
    s->add_shape(p.rows);
    s->add_shape(p.cols);
    s->set_sharding(p.sharding);
    s->set_forward_order(order++);
    if (p.sharding == v1::SHARDING_ROWS) {
      const int64_t per = (p.rows + world - 1) / world;
      s->set_row_begin(std::min(p.rows, rank * per));
      s->set_row_end(std::min(p.rows, (rank + 1) * per));
    }
  }
  return r;
}

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_OPEN_REQUEST_H_
