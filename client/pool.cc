// A pool of daemons behind the Client/Session interface: the table is split
// by SessionSpec::pool_owner, or else by PlanPool over every daemon's devices
// (counted from its Status RPC), each daemon gets its share as a job of the
// same id, and every call is routed to the owning daemon's session.
//
// GPU transports (cuda_ipc, nccl) need one region (and, for nccl, one
// communicator) per daemon, which one SessionSpec cannot describe: a pool of
// several daemons refuses them (UNIMPLEMENTED); a pool of one daemon passes
// them through, since its session is that daemon's.

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kernels/cost_model.h"
#include "planner/planner.h"

namespace dmuon {
namespace {

kernels::NsOptions NsOf(const SessionSpec& spec, int group) {
  kernels::NsOptions o;
  if (group >= 0 && group < static_cast<int>(spec.groups.size())) {
    const GroupSpec& g = spec.groups[group];
    auto sched = kernels::ScheduleByName(
        g.schedule == "custom" ? "classic" : g.schedule,
        g.schedule == "custom" ? static_cast<int>(g.coefficients.size())
                               : g.ns_steps);
    if (sched.ok()) o.schedule = *sched;
    auto m = kernels::ParseMethod(g.method);
    if (m.ok()) o.method = *m;
  }
  return o;
}

// SessionSpec::pool_owner given by the caller: one entry per parameter,
// each a daemon of the pool.
absl::Status CheckOwner(const SessionSpec& spec, int daemons) {
  if (spec.pool_owner.size() != spec.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool_owner has ", spec.pool_owner.size(), " entries; the table has ",
        spec.params.size(), " parameters (one daemon index each)"));
  }
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const int d = spec.pool_owner[i];
    if (d < 0 || d >= daemons) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pool_owner[", i, "] = ", d, " for parameter '", spec.params[i].name,
          "' is not a daemon of this pool of ", daemons, " (0 to ", daemons - 1,
          ")"));
    }
  }
  return absl::OkStatus();
}

class PoolSession : public Session {
 public:
  PoolSession(std::vector<std::unique_ptr<Session>> subs,
              std::vector<int> owner, std::vector<int> local)
      : subs_(std::move(subs)),
        owner_(std::move(owner)),
        local_(std::move(local)) {}

  absl::Span<float> gradient(int i) override {
    return valid(i) ? subs_[owner_[i]]->gradient(local_[i])
                    : absl::Span<float>();
  }
  absl::Span<const float> update(int i) override {
    return valid(i) ? subs_[owner_[i]]->update(local_[i])
                    : absl::Span<const float>();
  }
  int64_t step() const override { return subs_.empty() ? 1 : subs_[0]->step(); }
  std::string transport() const override {
    return subs_.empty() ? "" : subs_[0]->transport();
  }
  // One daemon: its session's (the pool's table order is its table order).
  // Several: empty, each daemon has its own region.
  const RegionLayout& layout() const override {
    static const RegionLayout* const kNone = new RegionLayout();
    return subs_.size() == 1 ? subs_[0]->layout() : *kNone;
  }
  const NcclInfo& nccl() const override {
    static const NcclInfo* const kNone = new NcclInfo();
    return subs_.size() == 1 ? subs_[0]->nccl() : *kNone;
  }
  absl::StatusOr<std::vector<int>> NextAnnounced() override {
    if (subs_.size() == 1) return subs_[0]->NextAnnounced();
    return absl::UnimplementedError(absl::StrCat(
        "NextAnnounced is for a session on one daemon; this pool session "
        "spans ",
        subs_.size(), " daemons: use WaitUpdate/TryUpdate"));
  }
  absl::Status GradientReady(int i) override {
    if (!valid(i))
      return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
    return subs_[owner_[i]]->GradientReady(local_[i]);
  }
  absl::Status GradientsReady(absl::Span<const int> ids) override {
    return ForEachDaemon(ids, &Session::GradientsReady);
  }
  absl::Status GradientsAbsent(absl::Span<const int> ids) override {
    return ForEachDaemon(ids, &Session::GradientsAbsent);
  }
  absl::Status GradientsReadyWithMomentum(
      absl::Span<const int> ids, absl::Span<const double> momentum) override {
    if (momentum.empty()) return GradientsReady(ids);
    if (momentum.size() != ids.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GradientsReady: ", momentum.size(),
                       " momentum values for ", ids.size(), " parameters"));
    }
    std::vector<std::vector<int>> by(subs_.size());
    std::vector<std::vector<double>> betas(subs_.size());
    for (size_t k = 0; k < ids.size(); ++k) {
      const int i = ids[k];
      if (!valid(i))
        return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
      by[owner_[i]].push_back(local_[i]);
      betas[owner_[i]].push_back(momentum[k]);
    }
    for (size_t d = 0; d < subs_.size(); ++d) {
      if (by[d].empty()) continue;
      if (auto st = subs_[d]->GradientsReadyWithMomentum(by[d], betas[d]);
          !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }
  // Splits pool indices by the daemon that owns them and calls `fn` on each
  // daemon's session with its local indices.
  absl::Status ForEachDaemon(
      absl::Span<const int> ids,
      absl::Status (Session::*fn)(absl::Span<const int>)) {
    std::vector<std::vector<int>> by(subs_.size());
    for (int i : ids) {
      if (!valid(i))
        return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
      by[owner_[i]].push_back(local_[i]);
    }
    for (size_t d = 0; d < subs_.size(); ++d) {
      if (by[d].empty()) continue;
      if (auto st = (subs_[d].get()->*fn)(by[d]); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  absl::Status WaitUpdate(int i) override {
    if (!valid(i))
      return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
    return subs_[owner_[i]]->WaitUpdate(local_[i]);
  }
  bool TryUpdate(int i) override {
    return valid(i) && subs_[owner_[i]]->TryUpdate(local_[i]);
  }
  int64_t update_received_ns(int i) const override {
    return valid(i) ? subs_[owner_[i]]->update_received_ns(local_[i]) : 0;
  }
  bool skipped(int i) const override {
    return valid(i) && subs_[owner_[i]]->skipped(local_[i]);
  }
  bool absent(int i) const override {
    return valid(i) && subs_[owner_[i]]->absent(local_[i]);
  }
  absl::Status FinishStep() override {
    for (auto& s : subs_)
      if (auto st = s->FinishStep(); !st.ok()) return st;
    return absl::OkStatus();
  }
  std::string not_durable() const override {
    return Joined(&Session::not_durable);
  }
  std::string notice() const override { return Joined(&Session::notice); }
  // Every daemon's non-empty `what`, joined by "; ".
  std::string Joined(std::string (Session::*what)() const) const {
    std::string all;
    for (const auto& s : subs_) {
      const std::string one = ((*s).*what)();
      if (!one.empty()) absl::StrAppend(&all, all.empty() ? "" : "; ", one);
    }
    return all;
  }
  absl::Status Rewind() override {
    for (auto& s : subs_)
      if (auto st = s->Rewind(); !st.ok()) return st;
    return absl::OkStatus();
  }
  absl::StatusOr<State> GetState() override {
    State all;
    std::vector<State> parts;
    for (auto& s : subs_) {
      auto st = s->GetState();
      if (!st.ok()) return st.status();
      parts.push_back(std::move(*st));
    }
    all.completed_steps = parts.empty() ? 0 : parts[0].completed_steps;
    for (size_t i = 0; i < owner_.size(); ++i) {
      State& p = parts[owner_[i]];
      all.names.push_back(p.names[local_[i]]);
      all.shapes.push_back(p.shapes[local_[i]]);
      all.momentum.push_back(std::move(p.momentum[local_[i]]));
    }
    return all;
  }
  absl::StatusOr<MarkInfo> Mark(int64_t step) override {
    MarkInfo all;
    for (size_t d = 0; d < subs_.size(); ++d) {
      absl::StatusOr<MarkInfo> m = subs_[d]->Mark(step);
      if (!m.ok()) return m.status();
      if (d == 0) {
        all = *std::move(m);
        continue;
      }
      if (m->step != all.step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Mark: the pool's daemons marked different steps (", all.step,
            " and ", m->step, "): their jobs are not at one step"));
      }
      // The steps every daemon can resume, in the first daemon's order
      // (oldest first); each daemon lists its marks by age, not by step.
      std::vector<int64_t> theirs = m->marks;
      std::sort(theirs.begin(), theirs.end());
      std::vector<int64_t> both;
      for (int64_t s : all.marks)
        if (std::binary_search(theirs.begin(), theirs.end(), s))
          both.push_back(s);
      all.marks = std::move(both);
      all.mark_bytes += m->mark_bytes;
      if (!m->not_durable.empty()) {
        absl::StrAppend(&all.not_durable, all.not_durable.empty() ? "" : "; ",
                        m->not_durable);
      }
    }
    return all;
  }
  bool doorbell() const override {
    bool all = !subs_.empty();
    for (const auto& s : subs_) all = all && s->doorbell();
    return all;
  }
  uint32_t daemon_protocol_minor() const override {
    uint32_t oldest = UINT32_MAX;
    for (const auto& s : subs_)
      oldest = std::min(oldest, s->daemon_protocol_minor());
    return subs_.empty() ? 0 : oldest;
  }
  absl::Status SetState(const State& s) override {
    if (s.momentum.size() != owner_.size() || s.names.size() != owner_.size() ||
        s.shapes.size() != owner_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state has ", s.momentum.size(),
                       " parameters; the table has ", owner_.size()));
    }
    std::vector<State> parts(subs_.size());
    for (auto& p : parts) p.completed_steps = s.completed_steps;
    for (size_t i = 0; i < owner_.size(); ++i) {  // local order is table order
      State& p = parts[owner_[i]];
      p.names.push_back(s.names[i]);
      p.shapes.push_back(s.shapes[i]);
      p.momentum.push_back(s.momentum[i]);
    }
    for (size_t d = 0; d < subs_.size(); ++d)
      if (auto st = subs_[d]->SetState(parts[d]); !st.ok()) return st;
    return absl::OkStatus();
  }
  absl::Status Close() override {
    absl::Status first;
    for (auto& s : subs_)
      if (auto st = s->Close(); !st.ok() && first.ok()) first = st;
    return first;
  }
  bool region_released() const override {
    for (const auto& s : subs_)
      if (!s->region_released()) return false;
    return true;
  }

 private:
  bool valid(int i) const {
    return i >= 0 && i < static_cast<int>(owner_.size());
  }
  std::vector<std::unique_ptr<Session>> subs_;
  std::vector<int> owner_;  // daemon of each parameter
  std::vector<int> local_;  // its index in that daemon's table
};

class PoolClient : public Client {
 public:
  PoolClient(std::vector<std::unique_ptr<Client>> members, std::string address)
      : members_(std::move(members)), address_(std::move(address)) {}
  const std::string& address() const override { return address_; }

  // In address order; a member's error names its address.
  absl::StatusOr<std::vector<int>> DeviceCounts() override {
    std::vector<int> counts;
    for (size_t d = 0; d < members_.size(); ++d) {
      auto c = members_[d]->DeviceCounts();
      if (!c.ok()) {
        return absl::Status(
            c.status().code(),
            absl::StrCat(c.status().message(), " (pool member ", d, ")"));
      }
      counts.insert(counts.end(), c->begin(), c->end());
    }
    return counts;
  }

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(
      const SessionSpec& spec) override {
    const int n = static_cast<int>(members_.size());
    if (n > 1 && (spec.transport == TransportChoice::kCudaIpc ||
                  spec.transport == TransportChoice::kNccl)) {
      return absl::UnimplementedError(absl::StrCat(
          "transport ",
          spec.transport == TransportChoice::kCudaIpc ? "cuda_ipc" : "nccl",
          " is not supported by a pool of ", n, " daemons (", address_,
          "): each daemon would need its own GPU region and communicator; "
          "connect to one daemon (Client::Connect), or use shm/inline"));
    }
    const bool planned = spec.pool_owner.empty();
    std::vector<int> owner;
    if (!planned) {
      if (absl::Status st = CheckOwner(spec, n); !st.ok()) return st;
      owner = spec.pool_owner;
    } else if (n == 1) {
      owner.assign(spec.params.size(), 0);  // no need to ask the daemon
    } else {
      // Fetched once per open: every rank asks, so a health change between
      // two ranks' opens can split them (see client.h ConnectPool).
      auto counts = DeviceCounts();
      if (!counts.ok()) return counts.status();
      owner = PlanPool(spec, *counts);
    }
    std::vector<SessionSpec> parts(n, spec);
    for (auto& p : parts) {
      p.params.clear();
      p.pool_owner.clear();
    }
    std::vector<int> local(owner.size());
    for (size_t i = 0; i < owner.size(); ++i) {
      local[i] = static_cast<int>(parts[owner[i]].params.size());
      parts[owner[i]].params.push_back(spec.params[i]);
    }
    std::vector<std::unique_ptr<Session>> subs;
    std::vector<int> remap(n, -1);
    for (int d = 0; d < n; ++d) {
      if (parts[d].params.empty()) continue;  // more daemons than matrices
      auto s = members_[d]->OpenSession(parts[d]);
      if (!s.ok()) {
        // The daemon's table-mismatch error (server/table.cc CompareTables)
        // with a planned split most likely means the ranks planned over
        // different device counts: say how to make them agree.
        const bool mismatch =
            planned && n > 1 &&
            s.status().code() == absl::StatusCode::kInvalidArgument &&
            absl::StrContains(s.status().message(), "does not match rank");
        return absl::Status(
            s.status().code(),
            absl::StrCat(
                s.status().message(), " (pool member ", d, ": ",
                members_[d]->address(), ")",
                mismatch ? "; if the ranks' tables are alike, they split them "
                           "differently over the pool (each planned from the "
                           "daemons' healthy executors, which changed between "
                           "their opens?): compute Client::PlanPool once and "
                           "pass it to every rank as SessionSpec::pool_owner"
                         : ""));
      }
      remap[d] = static_cast<int>(subs.size());
      subs.push_back(std::move(*s));
    }
    std::vector<int> o(owner.size());
    for (size_t i = 0; i < owner.size(); ++i) o[i] = remap[owner[i]];
    return std::unique_ptr<Session>(
        new PoolSession(std::move(subs), std::move(o), std::move(local)));
  }

 private:
  std::vector<std::unique_ptr<Client>> members_;
  std::string address_;
};

}  // namespace

std::vector<int> Client::PlanPool(const SessionSpec& spec,
                                  const std::vector<int>& devices_per_daemon) {
  std::vector<double> costs;
  std::vector<int> layers;
  for (const ParamSpec& p : spec.params) {
    layers.push_back(p.layer);
    kernels::NsOptions o = NsOf(spec, p.group);
    kernels::Shape s{std::max<int64_t>(1, p.rows),
                     std::max<int64_t>(1, p.cols)};
    if (o.method == kernels::Method::kAuto)
      o.method = kernels::CheapestMethod(s, o);
    costs.push_back(kernels::EstimateCost(o.method, s, o).flops);
  }
  // Slot k of the plan is a device of daemon_of[k]; daemon 0's come first.
  std::vector<int> daemon_of;
  for (size_t d = 0; d < devices_per_daemon.size(); ++d)
    daemon_of.insert(daemon_of.end(), std::max(1, devices_per_daemon[d]),
                     static_cast<int>(d));
  if (daemon_of.empty()) daemon_of.push_back(0);  // no daemons: one
  std::vector<int> owner =
      planner::PlanBest(costs, layers, static_cast<int>(daemon_of.size()))
          .executor_of;
  for (int& o : owner) o = daemon_of[o];
  return owner;
}

std::vector<int> Client::PlanPool(const SessionSpec& spec, int daemons) {
  return PlanPool(spec, std::vector<int>(std::max(1, daemons), 1));
}

absl::StatusOr<std::unique_ptr<Client>> Client::ConnectPool(
    const std::vector<std::string>& addresses, ClientOptions options) {
  if (addresses.empty())
    return absl::InvalidArgumentError("a pool needs at least one address");
  std::vector<std::unique_ptr<Client>> members;
  std::string joined;
  for (const std::string& a : addresses) {
    auto c = Connect(a, options);
    if (!c.ok()) return c.status();
    members.push_back(std::move(*c));
    joined += (joined.empty() ? "" : ",") + a;
  }
  return std::unique_ptr<Client>(new PoolClient(std::move(members), joined));
}

}  // namespace dmuon
