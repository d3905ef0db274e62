#include "benchmarks/scaling/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <queue>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "planner/planner.h"

namespace dmuon::scaling {
namespace {

struct Topology {
  int g = 1;  // GPUs per node actually used
  int n = 1;  // nodes
};

Topology Topo(const Links& links, int gpus) {
  Topology t;
  t.g = std::max(1, std::min(gpus, std::max(1, links.gpus_per_node)));
  t.n = (std::max(1, gpus) + t.g - 1) / t.g;
  return t;
}

double TreeLatency(const Links& links, int nodes) {
  return nodes > 1 ? links.ib_latency * std::ceil(std::log2(nodes)) : 0.0;
}

}  // namespace

CommCost AllGather(const Links& links, int gpus, double bytes) {
  const Topology t = Topo(links, gpus);
  CommCost c;
  if (gpus <= 1) return c;
  if (t.n > 1) {
    c.busy += (t.n - 1.0) / t.n * bytes / (t.g * links.ib_bandwidth);
    c.latency += TreeLatency(links, t.n);
  }
  if (t.g > 1) {
    c.busy += (t.g - 1.0) / t.g * bytes / links.nvlink_bandwidth;
    c.latency += links.nvlink_latency;
  }
  return c;
}

CommCost AllReduce(const Links& links, int gpus, double bytes) {
  CommCost c = AllGather(links, gpus, bytes);
  return {2 * c.busy, 2 * c.latency};
}

CommCost ReduceTo(const Links& links, int gpus, double bytes) {
  const Topology t = Topo(links, gpus);
  CommCost c;
  if (gpus <= 1) return c;
  if (t.g > 1) {
    c.busy += 2 * (t.g - 1.0) / t.g * bytes / links.nvlink_bandwidth;
    c.latency += 2 * links.nvlink_latency;
  }
  if (t.n > 1) {
    c.busy += bytes / (t.g * links.ib_bandwidth);
    c.latency += TreeLatency(links, t.n);
  }
  return c;
}

CommCost BroadcastFrom(const Links& links, int gpus, double bytes) {
  return ReduceTo(links, gpus, bytes);
}

CommCost GatherTo(const Links& links, int gpus, double bytes) {
  return AllGather(links, gpus, bytes);
}

CommCost ScatterFrom(const Links& links, int gpus, double bytes) {
  return GatherTo(links, gpus, bytes);
}

CommCost AllToAll(const Links& links, int gpus, double bytes_per_gpu) {
  const Topology t = Topo(links, gpus);
  CommCost c;
  if (gpus <= 1) return c;
  if (t.n > 1) {
    c.busy += (t.n - 1.0) / t.n * bytes_per_gpu / links.ib_bandwidth;
    c.latency += links.ib_latency;
  }
  if (t.g > 1) {
    c.busy +=
        (t.g - 1.0) / (t.g * t.n) * bytes_per_gpu / links.nvlink_bandwidth;
    c.latency += links.nvlink_latency;
  }
  return c;
}

const char* JobName(Job job) {
  return job == Job::kFsdp2 ? "fsdp2" : "replicated";
}

double Timeline::forward() const {
  return std::accumulate(forward_s.begin(), forward_s.end(), 0.0);
}
double Timeline::backward() const {
  return std::accumulate(backward_s.begin(), backward_s.end(), 0.0);
}

namespace {

enum class Ev {
  kGradReady,
  kReduceDone,
  kBroadcastDone,
  kArrive,
  kBatchDone,
  kUpdate,
  kWake,
  kForwardDone,
  kUnshardOpen,  // after backward (and after_backward_s): all-gathers may go
  kUnshardDone,  // the channel is free again
  kUnsharded     // a segment's parameters are gathered
};

struct Event {
  double t;
  uint64_t seq;
  Ev type;
  int a;  // task, device or GPU
};

struct Later {
  bool operator()(const Event& x, const Event& y) const {
    return x.t != y.t ? x.t > y.t : x.seq > y.seq;
  }
};

// One trainer timeline (a GPU in kShared, the trainer in kDedicated).
struct Trainer {
  bool started = false;  // backward and after_backward are over
  bool busy = false;
  size_t next = 0;  // next forward segment
  double end = 0;
};

struct Device {
  std::vector<int> ready;  // arrival order
  std::vector<int> batch;
  bool busy = false;
  double busy_s = 0;
};

class PoolSim {
 public:
  PoolSim(const Timeline& tl, const std::vector<Task>& tasks,
          const PoolConfig& cfg)
      : tl_(tl), tasks_(tasks), cfg_(cfg), segs_(tl.forward_s.size()) {}

  absl::StatusOr<PoolResult> Run() {
    const bool shared = cfg_.placement == Placement::kShared;
    devices_.assign(cfg_.devices, Device{});
    trainers_.assign(shared ? cfg_.devices : 1, Trainer{});
    missing_.assign(segs_, 0);
    for (const Task& t : tasks_) ++missing_[t.segment];
    unsharded_.assign(segs_, tl_.unshard.empty());
    // Backward runs segments S-1 .. 0; a gradient is ready at its end.
    std::vector<double> grad_ready(segs_, 0.0);
    double t = 0;
    for (size_t s = segs_; s-- > 0;) {
      t += tl_.backward_s[s];
      grad_ready[s] = t;
    }
    result_.backward_end = t;
    result_.baseline_end = t + tl_.forward();
    for (size_t i = 0; i < tasks_.size(); ++i) {
      Push(grad_ready[tasks_[i].segment], Ev::kGradReady, static_cast<int>(i));
    }
    const double start = t + tl_.after_backward_s;
    for (size_t g = 0; g < trainers_.size(); ++g) {
      Push(start, Ev::kWake, static_cast<int>(g));
    }
    if (!tl_.unshard.empty()) Push(start, Ev::kUnshardOpen, 0);
    while (!queue_.empty()) {
      const Event e = queue_.top();
      queue_.pop();
      Handle(e);
    }
    for (const Trainer& tr : trainers_) {
      if (tr.next != segs_) {
        return absl::InternalError("the simulated forward did not finish");
      }
      result_.forward_end = std::max(result_.forward_end, tr.end);
    }
    result_.exposed = result_.forward_end - result_.baseline_end;
    for (const Device& d : devices_) result_.device_busy.push_back(d.busy_s);
    return result_;
  }

 private:
  void Push(double t, Ev type, int a) { queue_.push({t, seq_++, type, a}); }

  void Handle(const Event& e) {
    const double now = e.t;
    switch (e.type) {
      case Ev::kGradReady:
        pending_.insert({tasks_[e.a].segment, now, 0, e.a});
        TryChannel(now);
        break;
      case Ev::kReduceDone:
        channel_busy_ = false;
        Push(now + tasks_[e.a].reduce.latency, Ev::kArrive, e.a);
        TryChannel(now);
        break;
      case Ev::kBroadcastDone:
        channel_busy_ = false;
        Push(now + tasks_[e.a].broadcast.latency, Ev::kUpdate, e.a);
        TryChannel(now);
        break;
      case Ev::kArrive:
        devices_[tasks_[e.a].owner].ready.push_back(e.a);
        TryDevice(tasks_[e.a].owner, now);
        break;
      case Ev::kBatchDone: {
        Device& d = devices_[e.a];
        for (int i : d.batch) pending_.insert({tasks_[i].segment, now, 1, i});
        d.batch.clear();
        d.busy = false;
        TryChannel(now);
        TryDevice(e.a, now);
        break;
      }
      case Ev::kUpdate:
        result_.last_update = std::max(result_.last_update, now);
        if (--missing_[tasks_[e.a].segment] == 0) {
          TryUnshard(now);
          for (size_t g = 0; g < trainers_.size(); ++g) {
            TryTrainer(static_cast<int>(g), now);
          }
        }
        break;
      case Ev::kUnshardOpen:
        unshard_open_ = true;
        TryUnshard(now);
        break;
      case Ev::kUnshardDone:
        channel_busy_ = false;
        Push(now + tl_.unshard[e.a].latency, Ev::kUnsharded, e.a);
        TryChannel(now);
        break;
      case Ev::kUnsharded:
        unsharded_[e.a] = true;
        for (size_t g = 0; g < trainers_.size(); ++g) {
          TryTrainer(static_cast<int>(g), now);
        }
        break;
      case Ev::kWake:
        trainers_[e.a].started = true;
        TryTrainer(e.a, now);
        break;
      case Ev::kForwardDone: {
        Trainer& tr = trainers_[e.a];
        tr.busy = false;
        if (++tr.next == segs_) tr.end = now;
        TryTrainer(e.a, now);
        break;
      }
    }
  }

  // FSDP2: queues the parameter all-gathers, in forward order, of the
  // segments whose updates are all back (once backward and after_backward
  // are over).
  void TryUnshard(double now) {
    if (!unshard_open_) return;
    while (next_unshard_ < segs_ && missing_[next_unshard_] == 0) {
      const int s = static_cast<int>(next_unshard_++);
      pending_.insert({s, now, 2, s});
    }
    TryChannel(now);
  }

  // One transfer at a time: the earliest forward segment first, then the
  // earliest request (kind 0 gradient, 1 update, 2 a segment's all-gather).
  void TryChannel(double now) {
    if (channel_busy_ || pending_.empty()) return;
    const auto [seg, t, kind, task] = *pending_.begin();
    pending_.erase(pending_.begin());
    channel_busy_ = true;
    if (kind == 2) {
      Push(now + tl_.unshard[task].busy, Ev::kUnshardDone, task);
      return;
    }
    const CommCost& c =
        kind == 0 ? tasks_[task].reduce : tasks_[task].broadcast;
    Push(now + c.busy, kind == 0 ? Ev::kReduceDone : Ev::kBroadcastDone, task);
  }

  // Segment s's forward may start: its updates are back, its parameters
  // gathered.
  bool Ready(size_t s) const { return missing_[s] == 0 && unsharded_[s]; }

  bool Shared() const { return cfg_.placement == Placement::kShared; }

  // In kShared a GPU is one server for its trainer and its optimizer work;
  // ready optimizer work goes first, then the next forward segment.
  void TryTrainer(int g, double now) {
    if (Shared()) {
      TryDevice(g, now);
      return;
    }
    Trainer& tr = trainers_[g];
    if (!tr.started || tr.busy || tr.next >= segs_) return;
    if (!Ready(tr.next)) return;
    StartForward(g, now);
  }

  void StartForward(int g, double now) {
    Trainer& tr = trainers_[g];
    tr.busy = true;
    double d = tl_.forward_s[tr.next];
    if (tr.next < tl_.apply_s.size()) d += tl_.apply_s[tr.next];
    Push(now + d, Ev::kForwardDone, g);
  }

  void TryDevice(int index, double now) {
    Device& d = devices_[index];
    if (d.busy) return;
    if (Shared()) {
      Trainer& tr = trainers_[index];
      if (!tr.started || tr.busy) return;
      if (d.ready.empty()) {
        if (tr.next < segs_ && Ready(tr.next)) StartForward(index, now);
        return;
      }
    }
    if (d.ready.empty()) return;
    // The earliest forward segment (then arrival), and every other ready
    // matrix of its shape, earliest first, up to max_batch.
    std::vector<size_t> order(d.ready.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return tasks_[d.ready[a]].segment < tasks_[d.ready[b]].segment;
    });
    const int key = tasks_[d.ready[order[0]]].shape_key;
    std::vector<bool> take(d.ready.size(), false);
    int n = 0;
    for (size_t k : order) {
      if (n >= std::max(1, cfg_.max_batch)) break;
      if (tasks_[d.ready[k]].shape_key != key) continue;
      take[k] = true;
      ++n;
    }
    double seconds = 0;
    std::vector<int> rest;
    for (size_t k = 0; k < d.ready.size(); ++k) {
      if (take[k]) {
        d.batch.push_back(d.ready[k]);
        seconds += tasks_[d.ready[k]].kernel_s;
      } else {
        rest.push_back(d.ready[k]);
      }
    }
    d.ready = std::move(rest);
    d.busy = true;
    d.busy_s += seconds;
    Push(now + seconds, Ev::kBatchDone, index);
  }

  const Timeline& tl_;
  const std::vector<Task>& tasks_;
  const PoolConfig& cfg_;
  const size_t segs_;
  std::priority_queue<Event, std::vector<Event>, Later> queue_;
  uint64_t seq_ = 0;
  std::set<std::tuple<int, double, int, int>> pending_;
  bool channel_busy_ = false;
  std::vector<Device> devices_;
  std::vector<Trainer> trainers_;
  std::vector<int> missing_;     // updates not yet back, per segment
  std::vector<bool> unsharded_;  // parameters gathered, per segment
  bool unshard_open_ = false;
  size_t next_unshard_ = 0;
  PoolResult result_;
};

}  // namespace

absl::StatusOr<PoolResult> SimulatePool(const Timeline& timeline,
                                        const std::vector<Task>& tasks,
                                        const PoolConfig& config) {
  const size_t segs = timeline.forward_s.size();
  if (segs == 0 || timeline.backward_s.size() != segs) {
    return absl::InvalidArgumentError(
        "timeline: forward_s and backward_s need one entry per segment");
  }
  if (config.devices < 1) {
    return absl::InvalidArgumentError("the pool needs at least one device");
  }
  if (!timeline.unshard.empty() && timeline.unshard.size() != segs) {
    return absl::InvalidArgumentError(
        "timeline: unshard needs one entry per segment (or none)");
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    if (t.segment < 0 || static_cast<size_t>(t.segment) >= segs) {
      return absl::InvalidArgumentError(
          absl::StrCat("task ", i, ": segment ", t.segment, " out of range"));
    }
    if (t.owner < 0 || t.owner >= config.devices) {
      return absl::InvalidArgumentError(
          absl::StrCat("task ", i, ": owner ", t.owner, " out of range"));
    }
    if (!(t.kernel_s >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("task ", i, ": negative kernel time"));
    }
  }
  auto result = PoolSim(timeline, tasks, config).Run();
  if (!result.ok() || timeline.unshard.empty()) return result;
  // The same job with no optimizer: no AdamW, nothing to apply, no updates
  // to wait for; the all-gathers still run.
  Timeline bare = timeline;
  bare.after_backward_s = 0;
  bare.apply_s.clear();
  auto base =
      PoolSim(bare, {}, {config.devices, Placement::kDedicated, 1}).Run();
  if (!base.ok()) return base.status();
  result->baseline_end = base->forward_end;
  result->exposed = result->forward_end - result->baseline_end;
  return result;
}

std::vector<int> PlanOwners(const std::vector<double>& seconds,
                            const std::vector<int>& layers, int devices) {
  if (seconds.empty()) return {};
  std::vector<double> costs = seconds;
  for (double& c : costs) c = std::max(c, 1e-12);  // the planner wants > 0
  return planner::PlanBest(costs, layers, std::max(1, devices)).executor_of;
}

absl::StatusOr<std::vector<StrategyResult>> SimulateStrategies(
    const Scenario& sc) {
  const int gpus = std::max(1, sc.gpus);
  const bool fsdp2 = sc.job == Job::kFsdp2;
  // One rank's trainer work: all of it (replicated) or its 1/G (FSDP2), and
  // in FSDP2 the parameter all-gather before each segment's forward.
  Timeline tl = sc.timeline;
  if (fsdp2) {
    tl.after_backward_s /= gpus;
    for (double& a : tl.apply_s) a /= gpus;
    if (!sc.segment_param_bytes.empty()) {
      if (sc.segment_param_bytes.size() != tl.forward_s.size()) {
        return absl::InvalidArgumentError(
            "segment_param_bytes needs one entry per segment");
      }
      for (double b : sc.segment_param_bytes) {
        tl.unshard.push_back(AllGather(sc.links, gpus, b));
      }
    }
  }
  const double fb = tl.forward() + tl.backward();
  const double local =
      tl.after_backward_s +
      std::accumulate(tl.apply_s.begin(), tl.apply_s.end(), 0.0);
  std::vector<StrategyResult> rows;
  // `opt` seconds of trainer work after backward, nothing overlapped.
  auto serial = [&](const std::string& name, double opt) -> absl::Status {
    if (!fsdp2) {
      rows.push_back({name, opt, opt, fb + opt});
      return absl::OkStatus();
    }
    // Then the forward, each segment after its all-gather: the exposed time
    // is what the optimizer delays beyond the bare job's own all-gathers.
    Timeline t = tl;
    t.after_backward_s = opt;
    t.apply_s.clear();
    auto r = SimulatePool(t, {}, {1, Placement::kDedicated, 1});
    if (!r.ok()) return r.status();
    rows.push_back({name, opt, r->exposed, r->forward_end});
    return absl::OkStatus();
  };
  // (a) Every rank, every matrix, after backward (FSDP2: after all-gathering
  // every gradient).
  double redundant = local, bytes = 0;
  std::vector<double> ours;
  std::vector<int> layers;  // a segment is one layer's forward and backward
  for (const MatrixCost& m : sc.matrices) {
    redundant += m.redundant_s;
    bytes += m.bytes;
    ours.push_back(m.ours_s);
    layers.push_back(m.segment);
  }
  if (fsdp2) redundant += AllGather(sc.links, gpus, bytes).total();
  if (auto st = serial("redundant", redundant); !st.ok()) return st;
  // (b) Matrix i on GPU i mod G, then one all-gather of every update
  // (FSDP2: gathered into its GPU and scattered back, two all-to-alls).
  std::vector<double> load(gpus, 0.0), owned(gpus, 0.0);
  for (size_t i = 0; i < ours.size(); ++i) {
    load[i % gpus] += ours[i];
    owned[i % gpus] += sc.matrices[i].bytes;
  }
  const double rr_comm =
      fsdp2 ? 2 * AllToAll(sc.links, gpus,
                           *std::max_element(owned.begin(), owned.end()))
                      .total()
            : AllGather(sc.links, gpus, bytes).total();
  if (auto st =
          serial("round_robin",
                 local + *std::max_element(load.begin(), load.end()) + rr_comm);
      !st.ok()) {
    return st;
  }
  // (c) The pool, both placements.
  const std::vector<int> owners = PlanOwners(ours, layers, gpus);
  std::vector<Task> tasks;
  for (size_t i = 0; i < sc.matrices.size(); ++i) {
    const MatrixCost& m = sc.matrices[i];
    tasks.push_back({m.segment, owners[i], m.shape_key, m.ours_s,
                     fsdp2 ? GatherTo(sc.links, gpus, m.bytes)
                           : ReduceTo(sc.links, gpus, m.bytes),
                     fsdp2 ? ScatterFrom(sc.links, gpus, m.bytes)
                           : BroadcastFrom(sc.links, gpus, m.bytes)});
  }
  Timeline alone = tl;  // no forward to overlap with, nothing to all-gather
  std::fill(alone.forward_s.begin(), alone.forward_s.end(), 0.0);
  alone.unshard.clear();
  for (Placement p : {Placement::kShared, Placement::kDedicated}) {
    const PoolConfig cfg{gpus, p, sc.max_batch};
    auto step = SimulatePool(tl, tasks, cfg);
    if (!step.ok()) return step.status();
    auto opt = SimulatePool(alone, tasks, cfg);
    if (!opt.ok()) return opt.status();
    rows.push_back({p == Placement::kShared ? "dmuon" : "dmuon_dedicated",
                    opt->forward_end - opt->backward_end, step->exposed,
                    fsdp2 ? step->forward_end : fb + step->exposed});
  }
  // (d) Fused AdamW over every parameter on every rank (FSDP2: over each
  // rank's shard).
  if (auto st = serial("adamw", fsdp2 ? sc.adamw_all_s / gpus : sc.adamw_all_s);
      !st.ok()) {
    return st;
  }
  return rows;
}

Traffic DmuonTraffic(const Scenario& sc, const std::vector<int>& owners) {
  const int gpus = std::max(1, sc.gpus);
  const Topology t = Topo(sc.links, gpus);
  Traffic out;
  std::vector<double> in(gpus, 0.0), node(t.n, 0.0);
  for (size_t i = 0; i < sc.matrices.size(); ++i) {
    const double b = sc.matrices[i].bytes;
    if (sc.job != Job::kFsdp2) {
      out.rank_out += b;
      out.rank_in += b;
      continue;
    }
    out.rank_out += b / gpus;
    out.rank_in += b / gpus;
    const int o = i < owners.size() ? std::clamp(owners[i], 0, gpus - 1) : 0;
    in[o] += (gpus - 1.0) / gpus * b;
    node[o / t.g] += (t.n - 1.0) / t.n * b;
  }
  out.owner_in = out.owner_out = *std::max_element(in.begin(), in.end());
  out.node_in = *std::max_element(node.begin(), node.end());
  return out;
}

}  // namespace dmuon::scaling
