#include "server/table.h"

#include <cmath>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"

namespace dmuon::server {
namespace {

std::string Quote(const std::string& s) { return absl::StrCat("'", s, "'"); }

absl::StatusOr<MuonParams> BuildGroup(const v1::HyperparameterGroup& g,
                                      int index) {
  const std::string where = absl::StrCat("group ", index, ": ");
  MuonParams m;
  if (g.has_momentum()) m.momentum = g.momentum();
  if (!(m.momentum >= 0 && m.momentum < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "momentum must be in [0, 1), got ", m.momentum));
  }
  if (g.has_nesterov()) m.nesterov = g.nesterov();
  const int steps = g.has_ns_steps() ? g.ns_steps() : 5;
  const std::string sched = g.schedule().empty() ? "classic" : g.schedule();
  if (sched == "custom") {
    if (g.coefficients_size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "schedule 'custom' needs coefficients"));
    }
    std::vector<kernels::StepCoefficients> c;
    for (const auto& k : g.coefficients()) c.push_back({k.a(), k.b(), k.c()});
    auto s = kernels::CustomSchedule(std::move(c));
    if (!s.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(where, s.status().message()));
    m.ns.schedule = *s;
  } else {
    if (g.coefficients_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "coefficients are only allowed with schedule 'custom', not ",
          Quote(sched)));
    }
    auto s = kernels::ScheduleByName(sched, steps);
    if (!s.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(where, s.status().message()));
    m.ns.schedule = *s;
  }
  if (g.has_eps()) m.ns.eps = g.eps();
  auto method =
      kernels::ParseMethod(g.method().empty() ? "direct" : g.method());
  if (!method.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(where, method.status().message()));
  m.ns.method = *method;
  auto adjust = kernels::ParseLrAdjust(
      g.adjust_lr_fn().empty() ? "original" : g.adjust_lr_fn());
  if (!adjust.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(where, adjust.status().message()));
  m.adjust = *adjust;
  if (auto st = kernels::ValidateOptions(m.ns); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, st.message()));
  }
  return m;
}

std::string ShapeOf(const ParamInfo& p) {
  return kernels::ShapeString(p.shape);
}

// The part of `p` this rank holds, from `s`'s sharding fields (row range
// for SHARDING_ROWS, runs for SHARDING_BLOCKS; the others: the whole
// matrix); a field of another sharding is an error naming `who`.
absl::StatusOr<ShardMap> HeldOf(const v1::ParameterSpec& s, const ParamInfo& p,
                                const std::string& who) {
  ShardMap held = ShardMap::Whole(p.shape);
  if (p.sharding == v1::SHARDING_ROWS) {
    if (s.row_begin() < 0 || s.row_end() > p.shape.rows ||
        s.row_begin() >= s.row_end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, " row range [", s.row_begin(), ",", s.row_end(),
          ") is not a non-empty part of its ", p.shape.rows, " rows"));
    }
    held = ShardMap::Rows(s.row_begin(), s.row_end(), p.shape.cols);
  } else if (s.row_begin() != 0 || s.row_end() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " has a row range but is not SHARDING_ROWS"));
  }
  if (p.sharding == v1::SHARDING_BLOCKS) {
    auto runs = [](const auto& list) {
      std::vector<IndexRun> v;
      v.reserve(list.size());
      for (const v1::IndexRun& r : list) v.push_back({r.begin(), r.end()});
      return v;
    };
    auto map = ShardMap::FromRuns(runs(s.row_runs()), runs(s.col_runs()),
                                  p.shape, who);
    if (!map.ok()) return map.status();
    held = *std::move(map);
  } else if (s.row_runs_size() != 0 || s.col_runs_size() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " has row_runs/col_runs but is not SHARDING_BLOCKS"));
  }
  return held;
}

}  // namespace

absl::StatusOr<Table> BuildTable(const v1::OpenSessionRequest& req,
                                 std::vector<ShardMap>* shards) {
  Table t;
  std::vector<MuonParams> groups;
  for (int i = 0; i < req.groups_size(); ++i) {
    auto g = BuildGroup(req.groups(i), i);
    if (!g.ok()) return g.status();
    groups.push_back(*g);
    t.groups.push_back(req.groups(i));
  }
  if (groups.empty()) {  // no groups sent: one with every default
    groups.push_back(*BuildGroup(v1::HyperparameterGroup(), 0));
    t.groups.emplace_back();
  }
  if (req.parameters_size() == 0) {
    return absl::InvalidArgumentError("parameter table is empty");
  }
  std::set<std::string> names;
  shards->clear();
  for (const v1::ParameterSpec& s : req.parameters()) {
    const std::string who = absl::StrCat("parameter ", Quote(s.name()));
    if (s.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", t.params.size(), " has no name"));
    }
    if (!names.insert(s.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " appears twice in the table"));
    }
    if (s.shape_size() != 2 || s.shape(0) <= 0 || s.shape(1) <= 0) {
      std::string shape = "[";
      for (int i = 0; i < s.shape_size(); ++i)
        absl::StrAppend(&shape, i ? "," : "", s.shape(i));
      return absl::InvalidArgumentError(
          absl::StrCat(who, " shape ", shape,
                       "] is not a 2-D matrix with positive dimensions"
                       " (flatten conv weights to [out, in*k*k])"));
    }
    ParamInfo p;
    p.name = s.name();
    p.shape = {s.shape(0), s.shape(1)};
    if (s.dtype() == v1::DTYPE_UNSPECIFIED || s.dtype() == v1::DTYPE_F32) {
      p.dtype = v1::DTYPE_F32;
    } else {
      return absl::UnimplementedError(
          absl::StrCat(who, " dtype ", v1::DType_Name(s.dtype()),
                       ": this daemon's CPU transports carry fp32 only (cast "
                       "on the client)"));
    }
    p.sharding = s.sharding() == v1::SHARDING_UNSPECIFIED
                     ? v1::SHARDING_REPLICATED
                     : s.sharding();
    // A daemon built to speak an older minor (dmuond_prev) knows no
    // SHARDING_BLOCKS, as the release before it.
    if (!v1::Sharding_IsValid(p.sharding) ||
        (p.sharding == v1::SHARDING_BLOCKS && !SpeaksMinor(3))) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " sharding ", s.sharding(), " is unknown"));
    }
    auto held = HeldOf(s, p, who);
    if (!held.ok()) return held.status();
    if (s.group() < 0 || s.group() >= static_cast<int>(groups.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " group ", s.group(), " does not exist (",
                       groups.size(), " groups)"));
    }
    if (s.has_layer() && s.layer() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " layer ", s.layer(),
                       " is negative (leave it unset for no layer)"));
    }
    p.forward_order = s.forward_order();
    p.group = s.group();
    p.layer = s.has_layer() ? s.layer() : -1;
    p.muon = groups[s.group()];
    p.lr_scale = kernels::LrScale(p.muon.adjust, p.shape);
    t.params.push_back(std::move(p));
    shards->push_back(*std::move(held));
  }
  return t;
}

absl::Status CompareTables(const Table& ours, int our_rank, const Table& theirs,
                           int their_rank) {
  auto mismatch = [&](const std::string& what, const std::string& mine,
                      const std::string& other) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", other, " does not match rank ", our_rank, "'s ", mine));
  };
  if (ours.params.size() != theirs.params.size()) {
    return mismatch(absl::StrCat("rank ", their_rank, "'s table has"),
                    absl::StrCat(ours.params.size(), " parameters"),
                    absl::StrCat(theirs.params.size(), " parameters;"));
  }
  for (size_t i = 0; i < ours.params.size(); ++i) {
    const ParamInfo& a = ours.params[i];
    const ParamInfo& b = theirs.params[i];
    const std::string who = absl::StrCat("parameter ", i, " ", Quote(b.name));
    if (a.name != b.name)
      return mismatch(absl::StrCat("parameter ", i, " name"), Quote(a.name),
                      Quote(b.name));
    if (a.shape != b.shape)
      return mismatch(who + " shape", ShapeOf(a), ShapeOf(b));
    if (a.sharding != b.sharding) {
      return mismatch(who + " sharding", v1::Sharding_Name(a.sharding),
                      v1::Sharding_Name(b.sharding));
    }
    if (a.dtype != b.dtype)
      return mismatch(who + " dtype", v1::DType_Name(a.dtype),
                      v1::DType_Name(b.dtype));
    if (a.forward_order != b.forward_order) {
      return mismatch(who + " forward_order", absl::StrCat(a.forward_order),
                      absl::StrCat(b.forward_order));
    }
    if (a.layer != b.layer) {
      auto name = [](int32_t l) {
        return l < 0 ? std::string("unset") : absl::StrCat(l);
      };
      return mismatch(who + " layer", name(a.layer), name(b.layer));
    }
    if (a.group != b.group)
      return mismatch(who + " group", absl::StrCat(a.group),
                      absl::StrCat(b.group));
  }
  if (ours.groups.size() != theirs.groups.size()) {
    return mismatch("group count", absl::StrCat(ours.groups.size()),
                    absl::StrCat(theirs.groups.size()));
  }
  for (size_t g = 0; g < ours.groups.size(); ++g) {
    if (ours.groups[g].SerializeAsString() !=
        theirs.groups[g].SerializeAsString()) {
      return mismatch(absl::StrCat("group ", g, " hyperparameters"),
                      ours.groups[g].ShortDebugString(),
                      theirs.groups[g].ShortDebugString());
    }
  }
  return absl::OkStatus();
}

v1::ParameterSpec ToSpec(const ParamInfo& p) {
  v1::ParameterSpec s;
  s.set_name(p.name);
  s.add_shape(p.shape.rows);
  s.add_shape(p.shape.cols);
  s.set_dtype(p.dtype);
  s.set_sharding(p.sharding);
  s.set_forward_order(p.forward_order);
  s.set_group(p.group);
  if (p.layer >= 0) s.set_layer(p.layer);
  return s;
}

}  // namespace dmuon::server
