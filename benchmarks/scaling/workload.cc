#include "benchmarks/scaling/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cost_model.h"

namespace dmuon::scaling {
namespace {

using kernels::Method;
using kernels::Shape;

absl::StatusOr<nlohmann::json> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON"));
  }
  return j;
}

double Elements(const nlohmann::json& shape) {
  double e = 1;
  for (const auto& d : shape) e *= d.get<double>();
  return e;
}

}  // namespace

double Model::muon_params() const {
  double p = 0;
  for (const ModelMatrix& m : matrices) p += m.shape.elements();
  return p;
}

absl::StatusOr<std::vector<Model>> LoadModels(const std::string& path) {
  auto j = ReadJson(path);
  if (!j.ok()) return j.status();
  if (!j->contains("models") || !(*j)["models"].is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no 'models'"));
  }
  std::vector<Model> out;
  try {
    for (const auto& m : (*j)["models"]) {
      Model model;
      model.name = m.at("model").get<std::string>();
      const auto& c = m.at("config");
      model.layers = c.at("layers").get<int>();
      model.hidden = c.at("hidden").get<int64_t>();
      model.vocab = c.at("vocab").get<int64_t>();
      model.experts = c.value("experts", 0);
      for (const auto& x : m.at("muon_matrices")) {
        ModelMatrix mm;
        mm.name = x.at("name").get<std::string>();
        mm.shape = {x.at("shape")[0].get<int64_t>(),
                    x.at("shape")[1].get<int64_t>()};
        mm.layer = x.at("layer").get<int>();
        mm.expert = absl::StrContains(mm.name, ".experts.");
        if (mm.layer < 0 || mm.layer >= model.layers) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": ", mm.name, " has layer ", mm.layer));
        }
        model.matrices.push_back(mm);
      }
      for (const auto& x : m.value("adamw_params", nlohmann::json::array())) {
        if (!x.contains("shape")) continue;  // e.g. gpt2's "ln/bias": tiny
        const double n = x.value("count", 1) * Elements(x["shape"]);
        const std::string name = x.value("name", "");
        model.other_params += n;
        if (absl::StrContains(name, "lm_head")) model.head_params += n;
        if (absl::StartsWith(name, "layers.")) model.layer_other_params += n;
      }
      out.push_back(std::move(model));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return out;
}

absl::StatusOr<Model> FindModel(const std::vector<Model>& models,
                                const std::string& name) {
  std::string known;
  for (const Model& m : models) {
    if (m.name == name) return m;
    absl::StrAppend(&known, known.empty() ? "" : ", ", m.name);
  }
  return absl::NotFoundError(
      absl::StrCat("no model '", name, "' (known: ", known, ")"));
}

KernelTimes KernelTimes::CostModel(const Hardware& hw) {
  KernelTimes k;
  k.hw_ = hw;
  k.source_ =
      absl::StrCat("cost model at ", hw.peak_flops / 1e12, " TFLOP/s x ",
                   hw.efficiency, ", HBM ", hw.hbm_bandwidth / 1e12, " TB/s, +",
                   hw.kernel_overhead_s * 1e6, " us per matrix");
  k.variants_ = {{"direct", Method::kDirect, 0.5, {}},
                 {"gram", Method::kGram, 0.5, {}},
                 {"direct-dense", Method::kDirect, 1.0, {}}};
  return k;
}

absl::StatusOr<KernelTimes> KernelTimes::Measured(const std::string& path,
                                                  const Hardware& hw) {
  auto j = ReadJson(path);
  if (!j.ok()) return j.status();
  KernelTimes k;
  k.hw_ = hw;
  k.measured_ = true;
  std::map<std::string, Variant> by_name;
  try {
    for (const auto& r : j->at("rows")) {
      const std::string method = r.at("method").get<std::string>();
      if (r.value("batch", 1) != 1 || absl::StartsWith(method, "gemm"))
        continue;
      Variant v;
      v.name = method;
      if (absl::StartsWith(method, "gram")) {
        v.method = Method::kGram;
      } else if (absl::StartsWith(method, "direct")) {
        v.symmetric = absl::StrContains(method, "dense") ? 1.0 : 0.5;
      } else {
        continue;
      }
      std::vector<std::string> rc =
          absl::StrSplit(r.at("shape").get<std::string>(), 'x');
      Shape s;
      if (rc.size() != 2 || !absl::SimpleAtoi(rc[0], &s.rows) ||
          !absl::SimpleAtoi(rc[1], &s.cols)) {
        continue;
      }
      const double sec = r.at("seconds").get<double>();
      if (!(sec > 0)) continue;
      auto it = by_name.emplace(method, v).first;
      const double f = k.Flops(it->second, s);
      it->second.points.push_back({std::log(f), std::log(f / sec)});
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  for (auto& [name, v] : by_name) {
    std::sort(v.points.begin(), v.points.end());
    k.variants_.push_back(v);
  }
  if (k.variants_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no single-matrix direct or gram rows"));
  }
  k.source_ = absl::StrCat("measured: ", path);
  return k;
}

double KernelTimes::Flops(const Variant& v, Shape s) const {
  kernels::NsOptions o;
  o.method = v.method;
  return kernels::EstimateCost(v.method, s, o, v.symmetric).flops;
}

double KernelTimes::Seconds(const Variant& v, Shape s) const {
  const double f = Flops(v, s);
  if (!measured_) {
    kernels::NsOptions o;
    o.method = v.method;
    const auto c =
        kernels::EstimateCost(v.method, s, o, v.symmetric, hw_.element_bytes);
    return kernels::PredictSeconds(c, hw_.peak_flops * hw_.efficiency,
                                   hw_.hbm_bandwidth) +
           hw_.kernel_overhead_s;
  }
  const double x = std::log(f);
  const auto& p = v.points;
  double y = p.front().second;
  if (x >= p.back().first) {
    y = p.back().second;
  } else if (x > p.front().first) {
    for (size_t i = 1; i < p.size(); ++i) {
      if (x <= p[i].first) {
        const double w = (x - p[i - 1].first) / (p[i].first - p[i - 1].first);
        y = p[i - 1].second + w * (p[i].second - p[i - 1].second);
        break;
      }
    }
  }
  return std::max(f / std::exp(y), hw_.kernel_overhead_s);
}

double KernelTimes::Momentum(Shape s) const {
  return s.elements() * hw_.momentum_bytes / hw_.hbm_bandwidth;
}

std::pair<std::string, double> KernelTimes::Ours(Shape s) const {
  std::pair<std::string, double> best{"", 0};
  for (const Variant& v : variants_) {
    if (!measured_ && v.symmetric == 1.0) continue;  // ours use symmetry
    const double t = Seconds(v, s);
    if (best.first.empty() || t < best.second) best = {v.name, t};
  }
  best.second += Momentum(s);
  return best;
}

double KernelTimes::Redundant(Shape s) const {
  const Variant* dense = nullptr;
  const Variant* direct = nullptr;
  for (const Variant& v : variants_) {
    if (v.method != Method::kDirect) continue;
    if (v.symmetric == 1.0 && !dense) dense = &v;
    if (v.symmetric != 1.0 && !direct) direct = &v;
  }
  double t = 0;
  if (dense) {
    t = Seconds(*dense, s);
  } else if (direct) {  // the direct rate at the dense flop count
    Variant d = *direct;
    d.symmetric = 1.0;
    t = Seconds(d, s);
  } else {
    t = Ours(s).second - Momentum(s);
  }
  return t + Momentum(s);
}

absl::StatusOr<Workload> BuildWorkload(const Model& model,
                                       const KernelTimes& kernels,
                                       const TrainerConfig& tc) {
  if (model.layers < 1 || model.matrices.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(model.name, ": no layers or no matrices"));
  }
  Workload w;
  const int segs = model.layers + 2;  // embedding, layers, head
  std::vector<double> weight(segs, 0.0);
  std::map<std::pair<int64_t, int64_t>, int> keys;
  const double expert_share =
      model.experts > 0 ? std::min(1.0, double(tc.moe_top_k) / model.experts)
                        : 1.0;
  std::vector<double> apply(segs, 0.0);
  // FSDP2: what each segment's forward all-gathers, in elements.
  std::vector<double> params(segs, 0.0);
  params[0] = model.other_params - model.head_params - model.layer_other_params;
  params[segs - 1] = model.head_params;
  for (int l = 1; l <= model.layers; ++l) {
    params[l] = model.layer_other_params / model.layers;
  }
  for (const ModelMatrix& m : model.matrices) {
    const double e = static_cast<double>(m.shape.elements());
    const int seg = m.layer + 1;
    params[seg] += e;
    weight[seg] += m.expert ? e * expert_share : e;
    apply[seg] += e * tc.apply_bytes_per_param / tc.hbm_bandwidth;
    MatrixCost c;
    c.segment = seg;
    c.shape_key = keys.emplace(std::make_pair(m.shape.rows, m.shape.cols),
                               static_cast<int>(keys.size()))
                      .first->second;
    const auto ours = kernels.Ours(m.shape);
    c.ours_s = ours.second;
    c.redundant_s = kernels.Redundant(m.shape);
    c.bytes = e * tc.comm_bytes_per_element;
    w.ns_seconds += c.ours_s;
    if (absl::StartsWith(ours.first, "gram")) ++w.gram_matrices;
    w.scenario.matrices.push_back(c);
  }
  weight[segs - 1] = static_cast<double>(model.vocab) * model.hidden;  // head
  double active = 0;
  for (double x : weight) active += x;
  double fwd = tc.forward_s, bwd = tc.backward_s;
  const double rate = tc.peak_flops * tc.mfu;
  if (fwd <= 0) fwd = 2 * active * tc.tokens_per_gpu / rate;
  if (bwd <= 0)
    bwd = tc.forward_s > 0 ? 2 * fwd : 4 * active * tc.tokens_per_gpu / rate;
  Timeline& tl = w.scenario.timeline;
  for (int s = 0; s < segs; ++s) {
    tl.forward_s.push_back(fwd * weight[s] / active);
    tl.backward_s.push_back(bwd * weight[s] / active);
  }
  tl.apply_s = apply;
  for (double p : params) {
    w.scenario.segment_param_bytes.push_back(p * tc.comm_bytes_per_element);
  }
  tl.after_backward_s =
      model.other_params * tc.adamw_bytes_per_param / tc.hbm_bandwidth;
  w.muon_params = model.muon_params();
  w.other_params = model.other_params;
  w.active_params = active;
  w.scenario.adamw_all_s = (w.muon_params + w.other_params) *
                           tc.adamw_bytes_per_param / tc.hbm_bandwidth;
  return w;
}

}  // namespace dmuon::scaling
