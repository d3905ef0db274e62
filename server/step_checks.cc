// The checks of a Step stream message (step_checks.h).

#include "server/step_checks.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/protocol.h"

namespace dmuon::server {

absl::Status CheckStep(const Session& s, const SessionState& st, int64_t step) {
  if (step == st.step) return absl::OkStatus();
  if (step < st.step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is already complete for rank ", s.rank(),
                     "; the next step is ", st.step));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, " skips step ", st.step, " (rank ", s.rank(), ")"));
}

absl::Status CheckParam(const Job& job, int id) {
  if (id >= 0 && id < job.num_params()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("parameter id ", id, " does not exist (the table has ",
                   job.num_params(), " parameters)"));
}

absl::Status CheckGradientChunk(const Session& s, const Job& job,
                                const SessionState& st,
                                const v1::TensorChunk& c) {
  if (s.transport() != v1::TRANSPORT_INLINE) {
    return absl::InvalidArgumentError(
        "gradient chunks are for TRANSPORT_INLINE; this session's "
        "gradients go in its shm segment");
  }
  if (auto e = CheckStep(s, st, c.step()); !e.ok()) return e;
  if (auto e = CheckParam(job, c.param_id()); !e.ok()) return e;
  const std::string& name = job.table().params[c.param_id()].name;
  const auto& slot = s.layout().slots[c.param_id()];
  if (st.declared[c.param_id()]) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient chunk for parameter '", name,
                     "' after it was declared ready at step ", c.step()));
  }
  if (c.offset() != st.received[c.param_id()]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient chunk for parameter '", name, "' at offset ", c.offset(),
        "; expected ", st.received[c.param_id()], " (chunks in order)"));
  }
  if (c.offset() + c.data().size() > slot.bytes) {
    return absl::OutOfRangeError(
        absl::StrCat("gradient chunk for parameter '", name, "' ends at byte ",
                     c.offset() + c.data().size(), "; the tensor has ",
                     slot.bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckDeclared(const Session& s, const Job& job,
                           const SessionState& st,
                           const v1::GradientsReady& g) {
  std::vector<uint8_t> seen(job.num_params(), 0);
  for (int id : g.param_ids()) {
    if (auto e = CheckParam(job, id); !e.ok()) return e;
    const std::string& name = job.table().params[id].name;
    if (st.declared[id] || seen[id]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' declared ready twice at step ", g.step()));
    }
    seen[id] = 1;
    if (s.transport() == v1::TRANSPORT_INLINE &&
        st.received[id] != s.layout().slots[id].bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of parameter '", name, "' is incomplete: ", st.received[id],
          " of ", s.layout().slots[id].bytes, " bytes received"));
    }
  }
  // Protocol minor 1: parameters without a gradient this step (torch:
  // .grad is None). Nothing is read for them; they complete as absent.
  for (int id : g.absent_param_ids()) {
    if (auto e = CheckParam(job, id); !e.ok()) return e;
    const std::string& name = job.table().params[id].name;
    if (st.declared[id] || seen[id]) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "' declared twice at step ",
                       g.step(), " (absent_param_ids included)"));
    }
    seen[id] = 1;
    if (st.received[id] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' declared absent at step ", g.step(),
          " after ", st.received[id], " bytes of its gradient were sent"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Two momenta that differ, shortest first; every digit when that does not
// tell them apart.
std::pair<std::string, std::string> Distinct(double ours, double theirs) {
  std::string a = absl::StrCat(ours), b = absl::StrCat(theirs);
  if (a == b) {
    a = absl::StrFormat("%.17g", ours);
    b = absl::StrFormat("%.17g", theirs);
  }
  return {a, b};
}

}  // namespace

absl::StatusOr<std::vector<double>> StepMomenta(const Session& s,
                                                const Job& job,
                                                const v1::GradientsReady& g) {
  // Protocol minor 2: this step's momentum per parameter (empty: each
  // group's). A daemon of an older minor ignores it, as that release did.
  const bool step_momentum = SpeaksMinor(2) && g.momentum_size() > 0;
  if (step_momentum && g.momentum_size() != g.param_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradients_ready.momentum at step ", g.step(), " has ",
        g.momentum_size(), " values for ", g.param_ids_size(),
        " param_ids: send one per param_ids entry (same order), or none"));
  }
  std::vector<double> betas;  // by param_ids entry: this step's momentum
  for (int k = 0; k < g.param_ids_size(); ++k) {
    const ParamInfo& info = job.table().params[g.param_ids(k)];
    const double m = step_momentum ? g.momentum(k) : info.muon.momentum;
    if (!(m >= 0 && m < 1)) {  // NaN too
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", info.name, "' at step ", g.step(),
          ": gradients_ready.momentum must be in [0, 1), got ", m));
    }
    // Every rank that declares the parameter uses the same momentum (a
    // rank that sends none: its group's).
    const ParamState& p = job.param(g.param_ids(k));
    if (p.has_step_momentum && p.step_momentum != m) {
      const auto [ours, theirs] = Distinct(m, p.step_momentum);
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", info.name, "' at step ", g.step(), ": rank ", s.rank(),
          " declared it with momentum ", ours, " but another rank with ",
          theirs,
          " (gradients_ready.momentum; a rank that sends none uses its "
          "group's, ",
          info.muon.momentum,
          "); every rank must send the same momentum for a parameter"));
    }
    betas.push_back(m);
  }
  return betas;
}

absl::Status CheckPresenceAgrees(const Session& s, const Job& job,
                                 const v1::GradientsReady& g) {
  // SHARDING_REPLICATED (rank 0's gradient is the one used), SHARDING_ROWS
  // and SHARDING_BLOCKS: every rank must say alike whether it has a
  // gradient (a rank holding nothing of a BLOCKS matrix too).
  // SHARDING_UNREDUCED: absent only when absent on every rank; a rank
  // without one counts as zeros in the mean (torch DDP's all-reduce with
  // find_unused_parameters).
  for (const auto* list : {&g.param_ids(), &g.absent_param_ids()}) {
    const bool none = list == &g.absent_param_ids();
    for (int id : *list) {
      const int r = job.AbsentDisagrees(s.rank(), id, none);
      if (r < 0) continue;
      const ParamInfo& info = job.table().params[id];
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", info.name, "' at step ", g.step(), ": rank ", s.rank(),
          none ? " has no gradient (absent)" : " has one", " but rank ", r,
          none ? " has one" : " has none (absent)", "; a ",
          v1::Sharding_Name(info.sharding),
          " parameter is present or absent on every rank alike "
          "(SHARDING_UNREDUCED counts a missing gradient as zeros)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
