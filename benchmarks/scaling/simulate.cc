// ./dmuon bench scaling (predictions): the optimizer step and its exposed
// time for each model and GPU count under the four strategies of
// simulator.h, for replicated (DDP) and FSDP2 jobs (--job), with kernel
// times from the cost model at a stated H200 rate or from a measured
// kernels-*.json. Writes benchmarks/results/scaling.json.

#include <cstdio>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmarks/scaling/simulator.h"
#include "benchmarks/scaling/workload.h"

ABSL_FLAG(std::string, model_shapes, "benchmarks/data/model_shapes.json",
          "model tables");
ABSL_FLAG(std::string, models,
          "gpt2-124m,llama-3-8b,llama-3-70b,qwen2.5-7b,mixtral-8x7b", "");
ABSL_FLAG(std::string, gpus, "8,16,32,64,128,256", "GPU counts");
ABSL_FLAG(int, gpus_per_node, 8, "");
ABSL_FLAG(double, nvlink_gbps, 360,
          "GB/s per GPU per direction achieved in collectives (H200 SXM "
          "NVLink 4: 450 raw)");
ABSL_FLAG(double, ib_gbps, 45,
          "GB/s per GPU between nodes (NDR 400 Gb/s = 50 GB/s per NIC, one "
          "NIC per GPU)");
ABSL_FLAG(double, nvlink_latency_us, 5, "per intra-node collective phase");
ABSL_FLAG(double, ib_latency_us, 10, "per level of a log2(nodes) tree");
ABSL_FLAG(std::string, kernels, "cost_model",
          "'cost_model', or a kernels-gpu.json / kernels-cpu.json to "
          "interpolate");
ABSL_FLAG(double, peak_tflops, 790,
          "dense bf16 GEMM rate (measured on the lent H200: 769-798)");
ABSL_FLAG(double, efficiency, 0.6, "fraction of the peak NS reaches");
ABSL_FLAG(double, hbm_tbps, 4.3, "HBM rate (H200 device copy measured: 4.3)");
ABSL_FLAG(double, kernel_overhead_us, 20, "launch overhead per matrix");
ABSL_FLAG(double, forward_s, 0, "trainer forward seconds (0: estimate)");
ABSL_FLAG(double, backward_s, 0, "trainer backward seconds (0: estimate)");
ABSL_FLAG(double, tokens_per_gpu, 16384,
          "tokens per GPU per optimizer step, for the estimate");
ABSL_FLAG(double, mfu, 0.4, "model flops utilization, for the estimate");
ABSL_FLAG(int, moe_top_k, 2, "experts active per token (MoE models)");
ABSL_FLAG(double, adamw_bytes, 28, "HBM bytes per parameter of fused AdamW");
ABSL_FLAG(double, apply_bytes, 10, "HBM bytes per Muon parameter to apply");
ABSL_FLAG(double, comm_bytes, 2, "bytes per element on the wire (bf16)");
ABSL_FLAG(int, max_batch, 16, "same-shape matrices per launch (dmuond's)");
ABSL_FLAG(int, target_gpus, 64, "GPU count of the issue's target");
ABSL_FLAG(std::string, job, "replicated,fsdp2",
          "jobs to simulate: 'replicated' (DDP: every rank holds the model, "
          "AdamW and applying on every rank), 'fsdp2' (each rank holds 1/G "
          "of each parameter's rows: dmuon gathers a matrix's shards into "
          "its owner and scatters the update's rows back; each rank applies "
          "and AdamW-updates only its shard; AdamW is sharded), or both");
ABSL_FLAG(bool, fsdp2_allgathers, true,
          "FSDP2: simulate each segment's parameter all-gather (bf16, on "
          "dmuon's channel, once its updates are back); false: assume them "
          "hidden, as DDP's all-reduce is");
ABSL_FLAG(std::string, out, "", "JSON results path");

namespace dmuon::scaling {
namespace {

std::string Now() {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

nlohmann::json Assumptions(const std::string& kernel_source) {
  return {
      {"parallelism",
       "data parallel, ranks in lockstep; the trainer's own gradient "
       "collective (DDP all-reduce, FSDP2 reduce-scatter) hidden under "
       "backward"},
      {"jobs", absl::GetFlag(FLAGS_job)},
      {"replicated_job",
       "every rank holds the model: AdamW of the non-Muon parameters and "
       "applying every update on every rank; AdamW baseline on every "
       "parameter on every rank"},
      {"fsdp2_job",
       "each rank holds 1/G of each parameter's rows: dmuon gathers a "
       "matrix's G row shards into its owner GPU (each rank sends S/G, the "
       "owner receives (G-1)/G S) and scatters the update's rows back, on "
       "its one serial channel; each rank applies only its rows (apply / G) "
       "and runs AdamW only on its shard of the non-Muon parameters "
       "(/ G); before each segment's forward its parameters are "
       "all-gathered (bf16) on the same channel once its updates are back; "
       "AdamW baseline sharded (each rank 1/G); exposed = the step's end "
       "minus that of the same FSDP2 job with no optimizer"},
      {"gpus_per_node", absl::GetFlag(FLAGS_gpus_per_node)},
      {"nvlink_gbps", absl::GetFlag(FLAGS_nvlink_gbps)},
      {"ib_gbps", absl::GetFlag(FLAGS_ib_gbps)},
      {"nvlink_latency_us", absl::GetFlag(FLAGS_nvlink_latency_us)},
      {"ib_latency_us", absl::GetFlag(FLAGS_ib_latency_us)},
      {"kernels", kernel_source},
      {"peak_tflops", absl::GetFlag(FLAGS_peak_tflops)},
      {"efficiency", absl::GetFlag(FLAGS_efficiency)},
      {"hbm_tbps", absl::GetFlag(FLAGS_hbm_tbps)},
      {"kernel_overhead_us", absl::GetFlag(FLAGS_kernel_overhead_us)},
      {"forward_s", absl::GetFlag(FLAGS_forward_s)},
      {"backward_s", absl::GetFlag(FLAGS_backward_s)},
      {"tokens_per_gpu", absl::GetFlag(FLAGS_tokens_per_gpu)},
      {"mfu", absl::GetFlag(FLAGS_mfu)},
      {"moe_top_k", absl::GetFlag(FLAGS_moe_top_k)},
      {"adamw_bytes_per_param", absl::GetFlag(FLAGS_adamw_bytes)},
      {"apply_bytes_per_param", absl::GetFlag(FLAGS_apply_bytes)},
      {"comm_bytes_per_element", absl::GetFlag(FLAGS_comm_bytes)},
      {"max_batch", absl::GetFlag(FLAGS_max_batch)},
      {"fsdp2_allgathers", absl::GetFlag(FLAGS_fsdp2_allgathers)},
      {"gpu_measurements",
       "none yet: no GPU machine was lent; kernel times "
       "come from the cost model at the stated rate"},
  };
}

// dmuon's exposed time over AdamW's at `gpus` (shared, dedicated).
absl::StatusOr<std::pair<double, double>> Ratio(const Model& model,
                                                const KernelTimes& kt,
                                                const TrainerConfig& tc,
                                                const Links& links, int gpus,
                                                Job job) {
  auto w = BuildWorkload(model, kt, tc);
  if (!w.ok()) return w.status();
  Scenario sc = w->scenario;
  sc.job = job;
  if (!absl::GetFlag(FLAGS_fsdp2_allgathers)) sc.segment_param_bytes.clear();
  sc.gpus = gpus;
  sc.links = links;
  sc.max_batch = absl::GetFlag(FLAGS_max_batch);
  auto rows = SimulateStrategies(sc);
  if (!rows.ok()) return rows.status();
  double adamw = 0, ours = 0, ded = 0;
  for (const StrategyResult& r : *rows) {
    if (r.strategy == "adamw") adamw = r.exposed_s;
    if (r.strategy == "dmuon") ours = r.exposed_s;
    if (r.strategy == "dmuon_dedicated") ded = r.exposed_s;
  }
  return std::make_pair(ours / adamw, ded / adamw);
}

// The target's ratio when one assumption at a time is made less favourable.
absl::Status Sensitivity(const std::vector<Model>& models,
                         const std::vector<std::string>& names,
                         const Hardware& hw, bool measured,
                         const KernelTimes& kt, const TrainerConfig& tc,
                         const Links& links, int gpus, Job job,
                         nlohmann::json& out) {
  struct Variant {
    std::string name;
    Hardware hw;
    TrainerConfig tc;
    Links links;
  };
  std::vector<Variant> vs = {{"as stated", hw, tc, links}};
  if (!measured) {
    vs.push_back({"NS at half the efficiency", hw, tc, links});
    vs.back().hw.efficiency /= 2;
  }
  vs.push_back({"half the InfiniBand and NVLink bandwidth", hw, tc, links});
  vs.back().links.ib_bandwidth /= 2;
  vs.back().links.nvlink_bandwidth /= 2;
  vs.push_back({"a quarter of the tokens per GPU", hw, tc, links});
  vs.back().tc.tokens_per_gpu /= 4;
  vs.push_back({"AdamW at 2x the bytes/s (a faster AdamW)", hw, tc, links});
  vs.back().tc.adamw_bytes_per_param /= 2;
  std::printf(
      "\nsensitivity at %d GPUs, %s job: dmuon exposed / AdamW%s "
      "(dedicated)\n",
      gpus, JobName(job), job == Job::kFsdp2 ? " (sharded)" : "");
  out = nlohmann::json::array();
  for (const Variant& v : vs) {
    const KernelTimes k = measured ? kt : KernelTimes::CostModel(v.hw);
    nlohmann::json row = {{"variant", v.name}};
    std::printf("  %-42s", v.name.c_str());
    for (const std::string& name : names) {
      auto m = FindModel(models, name);
      if (!m.ok()) return m.status();
      auto r = Ratio(*m, k, v.tc, v.links, gpus, job);
      if (!r.ok()) return r.status();
      row[name] = {{"ratio", r->first}, {"ratio_dedicated", r->second}};
      std::printf(" %s %.2f (%.2f)", name.c_str(), r->first, r->second);
    }
    std::printf("\n");
    out.push_back(row);
  }
  return absl::OkStatus();
}

absl::Status Run() {
  Hardware hw;
  hw.peak_flops = absl::GetFlag(FLAGS_peak_tflops) * 1e12;
  hw.efficiency = absl::GetFlag(FLAGS_efficiency);
  hw.hbm_bandwidth = absl::GetFlag(FLAGS_hbm_tbps) * 1e12;
  hw.kernel_overhead_s = absl::GetFlag(FLAGS_kernel_overhead_us) * 1e-6;
  KernelTimes kt = KernelTimes::CostModel(hw);
  if (absl::GetFlag(FLAGS_kernels) != "cost_model") {
    auto m = KernelTimes::Measured(absl::GetFlag(FLAGS_kernels), hw);
    if (!m.ok()) return m.status();
    kt = *m;
  }
  TrainerConfig tc;
  tc.forward_s = absl::GetFlag(FLAGS_forward_s);
  tc.backward_s = absl::GetFlag(FLAGS_backward_s);
  tc.tokens_per_gpu = absl::GetFlag(FLAGS_tokens_per_gpu);
  tc.mfu = absl::GetFlag(FLAGS_mfu);
  tc.peak_flops = hw.peak_flops;
  tc.moe_top_k = absl::GetFlag(FLAGS_moe_top_k);
  tc.hbm_bandwidth = hw.hbm_bandwidth;
  tc.adamw_bytes_per_param = absl::GetFlag(FLAGS_adamw_bytes);
  tc.apply_bytes_per_param = absl::GetFlag(FLAGS_apply_bytes);
  tc.comm_bytes_per_element = absl::GetFlag(FLAGS_comm_bytes);
  Links links;
  links.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  links.nvlink_bandwidth = absl::GetFlag(FLAGS_nvlink_gbps) * 1e9;
  links.ib_bandwidth = absl::GetFlag(FLAGS_ib_gbps) * 1e9;
  links.nvlink_latency = absl::GetFlag(FLAGS_nvlink_latency_us) * 1e-6;
  links.ib_latency = absl::GetFlag(FLAGS_ib_latency_us) * 1e-6;
  std::vector<int> gpus;
  for (absl::string_view g :
       absl::StrSplit(absl::GetFlag(FLAGS_gpus), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(g, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--gpus: '", g, "'"));
    }
    gpus.push_back(n);
  }
  std::vector<Job> jobs;
  for (absl::string_view j :
       absl::StrSplit(absl::GetFlag(FLAGS_job), ',', absl::SkipEmpty())) {
    if (j == "replicated" || j == "ddp") {
      jobs.push_back(Job::kReplicated);
    } else if (j == "fsdp2") {
      jobs.push_back(Job::kFsdp2);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--job: '", j, "' (replicated, fsdp2)"));
    }
  }
  if (jobs.empty()) return absl::InvalidArgumentError("--job: none");
  auto models = LoadModels(absl::GetFlag(FLAGS_model_shapes));
  if (!models.ok()) return models.status();

  nlohmann::json out;
  out["benchmark"] = "scaling";
  out["date"] = Now();
  out["command"] = "./dmuon bench scaling";
  out["assumptions"] = Assumptions(kt.source());
  out["models"] = nlohmann::json::array();
  out["rows"] = nlohmann::json::array();
  out["target"] = nlohmann::json::array();
  out["fsdp2"] = nlohmann::json::array();
  const int target = absl::GetFlag(FLAGS_target_gpus);
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty())) {
    auto model = FindModel(*models, std::string(name));
    if (!model.ok()) return model.status();
    auto w = BuildWorkload(*model, kt, tc);
    if (!w.ok()) return w.status();
    const Timeline& tl = w->scenario.timeline;
    double apply = 0;
    for (double a : tl.apply_s) apply += a;
    out["models"].push_back({{"model", model->name},
                             {"muon_matrices", model->matrices.size()},
                             {"muon_params", w->muon_params},
                             {"other_params", w->other_params},
                             {"active_params", w->active_params},
                             {"forward_s", tl.forward()},
                             {"backward_s", tl.backward()},
                             {"local_adamw_s", tl.after_backward_s},
                             {"apply_s", apply},
                             {"ns_seconds_one_gpu", w->ns_seconds},
                             {"gram_matrices", w->gram_matrices}});
    std::printf(
        "\n%s: %zu Muon matrices, %.2fB Muon + %.2fB other params; forward "
        "%.3f s, backward %.3f s; NS on one GPU %.3f s (%d Gram); local "
        "AdamW %.1f ms, apply %.1f ms\n",
        model->name.c_str(), model->matrices.size(), w->muon_params / 1e9,
        w->other_params / 1e9, tl.forward(), tl.backward(), w->ns_seconds,
        w->gram_matrices, tl.after_backward_s * 1e3, apply * 1e3);
    for (Job job : jobs) {
      std::printf("%s job\n%6s %6s  %-16s %12s %12s %10s\n", JobName(job),
                  "gpus", "nodes", "strategy", "optimizer_ms", "exposed_ms",
                  "step_s");
      for (int g : gpus) {
        Scenario sc = w->scenario;
        sc.job = job;
        if (!absl::GetFlag(FLAGS_fsdp2_allgathers)) {
          sc.segment_param_bytes.clear();
        }
        sc.gpus = g;
        sc.links = links;
        sc.max_batch = absl::GetFlag(FLAGS_max_batch);
        auto rows = SimulateStrategies(sc);
        if (!rows.ok()) return rows.status();
        const int nodes = (g + links.gpus_per_node - 1) / links.gpus_per_node;
        double adamw = 0, ours = 0, ded = 0, bare = 0;
        for (const StrategyResult& r : *rows) {
          std::printf("%6d %6d  %-16s %12.2f %12.2f %10.3f\n", g, nodes,
                      r.strategy.c_str(), r.optimizer_s * 1e3,
                      r.exposed_s * 1e3, r.step_s);
          out["rows"].push_back({{"model", model->name},
                                 {"job", JobName(job)},
                                 {"gpus", g},
                                 {"nodes", nodes},
                                 {"strategy", r.strategy},
                                 {"optimizer_s", r.optimizer_s},
                                 {"exposed_s", r.exposed_s},
                                 {"step_s", r.step_s}});
          if (r.strategy == "adamw") {
            adamw = r.exposed_s;
            bare = r.step_s - r.exposed_s;  // no optimizer at all
          }
          if (r.strategy == "dmuon") ours = r.exposed_s;
          if (r.strategy == "dmuon_dedicated") ded = r.exposed_s;
        }
        if (job == Job::kFsdp2) {
          std::vector<double> secs;
          std::vector<int> layers;
          for (const MatrixCost& m : sc.matrices) {
            secs.push_back(m.ours_s);
            layers.push_back(m.segment);
          }
          const Traffic tr = DmuonTraffic(sc, PlanOwners(secs, layers, g));
          out["fsdp2"].push_back(
              {{"model", model->name},
               {"gpus", g},
               {"nodes", nodes},
               {"dmuon_exposed_s", ours},
               {"dmuon_dedicated_exposed_s", ded},
               {"adamw_sharded_s", adamw},
               {"ratio", ours / adamw},
               {"ratio_dedicated", ded / adamw},
               // What the bare FSDP2 job's own parameter all-gathers add
               // beyond backward + forward (in every strategy; not in the
               // exposed times).
               {"bare_job_allgather_exposed_s",
                bare - tl.forward() - tl.backward()},
               {"rank_out_bytes", tr.rank_out},
               {"rank_in_bytes", tr.rank_in},
               {"owner_in_bytes_max", tr.owner_in},
               {"owner_out_bytes_max", tr.owner_out},
               {"node_in_bytes_max", tr.node_in}});
        }
        if (g == target && job == Job::kReplicated) {
          out["target"].push_back({{"model", model->name},
                                   {"gpus", g},
                                   {"dmuon_exposed_s", ours},
                                   {"dmuon_dedicated_exposed_s", ded},
                                   {"adamw_s", adamw},
                                   // ZeRO-1/FSDP: each rank updates 1/G of
                                   // the parameters (see "fsdp2" for the
                                   // simulated sharded job).
                                   {"adamw_sharded_s", adamw / g},
                                   {"ratio", ours / adamw},
                                   {"ratio_dedicated", ded / adamw},
                                   {"holds", ours <= 1.10 * adamw}});
        }
      }
    }
  }
  std::printf(
      "\ntarget: dmuon's exposed optimizer time at %d GPUs within 10%% "
      "of AdamW's\n",
      target);
  for (const auto& t : out["target"]) {
    std::printf(
        "  %-14s dmuon %.1f ms (dedicated %.1f ms) vs AdamW %.1f ms: "
        "ratio %.2f (%.2f) %s; AdamW sharded over the ranks (ZeRO-1) "
        "%.2f ms\n",
        t["model"].get<std::string>().c_str(),
        t["dmuon_exposed_s"].get<double>() * 1e3,
        t["dmuon_dedicated_exposed_s"].get<double>() * 1e3,
        t["adamw_s"].get<double>() * 1e3, t["ratio"].get<double>(),
        t["ratio_dedicated"].get<double>(),
        t["holds"].get<bool>() ? "holds" : "MISSED",
        t["adamw_sharded_s"].get<double>() * 1e3);
  }
  if (!out["fsdp2"].empty()) {
    std::printf("\nFSDP2 jobs at %d GPUs: dmuon vs sharded AdamW\n", target);
  }
  for (const auto& f : out["fsdp2"]) {
    if (f["gpus"].get<int>() != target) continue;
    std::printf(
        "  FSDP2 %-14s dmuon %.2f ms (dedicated %.2f ms) vs sharded AdamW "
        "%.2f ms: ratio %.2f (%.2f); per rank %.1f MB out, %.1f MB in; "
        "owner GPU in <= %.1f MB, node (daemon) in <= %.1f MB\n",
        f["model"].get<std::string>().c_str(),
        f["dmuon_exposed_s"].get<double>() * 1e3,
        f["dmuon_dedicated_exposed_s"].get<double>() * 1e3,
        f["adamw_sharded_s"].get<double>() * 1e3, f["ratio"].get<double>(),
        f["ratio_dedicated"].get<double>(),
        f["rank_out_bytes"].get<double>() / 1e6,
        f["rank_in_bytes"].get<double>() / 1e6,
        f["owner_in_bytes_max"].get<double>() / 1e6,
        f["node_in_bytes_max"].get<double>() / 1e6);
  }
  std::vector<std::string> names =
      absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty());
  for (Job job : jobs) {
    if (auto st = Sensitivity(
            *models, names, hw, absl::GetFlag(FLAGS_kernels) != "cost_model",
            kt, tc, links, target, job,
            out[job == Job::kFsdp2 ? "sensitivity_fsdp2" : "sensitivity"]);
        !st.ok()) {
      return st;
    }
  }
  const std::string path = absl::GetFlag(FLAGS_out);
  if (path.empty()) return absl::OkStatus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << out.dump(2) << "\n";
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  std::printf("wrote %s\n", path.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace dmuon::scaling

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Predicts the optimizer step and exposed time of redundant Muon, "
      "round-robin Muon, dmuon and AdamW vs GPU count, for replicated (DDP) "
      "and FSDP2 jobs");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status st = dmuon::scaling::Run(); !st.ok()) {
    std::fprintf(stderr, "simulate: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
