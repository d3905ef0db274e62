// Inputs of the scaling simulator: model tables, per-shape kernel times and
// the trainer's timeline, turned into a Scenario (simulator.h).
//
// - Models: benchmarks/data/model_shapes.json (nn.Linear (out, in) shapes
//   of every Muon matrix with its layer; the AdamW parameters).
// - Kernel times, either
//   * the cost model (kernels/cost_model.h) at a stated peak:
//     max(flops / (peak * efficiency), bytes / HBM) + a per-matrix launch
//     overhead, for the cheaper of direct and Gram (symmetric products
//     counted at half), or
//   * measured rows of a kernels-gpu.json / kernels-cpu.json (our benchmark
//     programs): for each method the measured rate flops/seconds, linearly
//     interpolated in log(flops) between measured shapes and clamped at the
//     ends, times the shape's flops; the fastest method per shape (what the
//     autotuner would pick). Rows with batch > 1 and GEMM rows are skipped.
//   Both add the momentum step, a memory pass of `momentum_bytes` per
//   element. "Redundant" (torch.optim.Muon) is direct NS with dense
//   products: a "-dense" measured method when there is one, else the direct
//   method's rate applied to the dense flops.
// - Trainer: forward and backward seconds given, or 2·P·T and 4·P·T flops
//   (P: active parameters, the head included; T: tokens per GPU per step) at
//   `mfu` of the peak, spread over segments by their active parameters:
//   segment 0 the embedding (no time), 1..L the layers, L+1 the head.
// - FSDP2 all-gathers: each segment's parameters (its Muon matrices, every
//   expert, and its AdamW parameters) at comm_bytes_per_element.

#ifndef DMUON_BENCHMARKS_SCALING_WORKLOAD_H_
#define DMUON_BENCHMARKS_SCALING_WORKLOAD_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "benchmarks/scaling/simulator.h"
#include "kernels/kernels.h"

namespace dmuon::scaling {

struct ModelMatrix {
  std::string name;
  kernels::Shape shape;
  int layer = 0;
  bool expert = false;  // one expert of an MoE layer
};

struct Model {
  std::string name;
  int layers = 0;
  int64_t hidden = 0, vocab = 0;
  int experts = 0;
  std::vector<ModelMatrix> matrices;
  double other_params = 0;  // AdamW's: embeddings, head, norms
  // Of those: the output head's ("lm_head": the last segment) and the
  // layers' ("layers.*": spread evenly); the rest is the embedding's.
  double head_params = 0, layer_other_params = 0;
  double muon_params() const;
};

absl::StatusOr<std::vector<Model>> LoadModels(const std::string& path);
absl::StatusOr<Model> FindModel(const std::vector<Model>& models,
                                const std::string& name);

struct Hardware {
  double peak_flops = 790e12;        // dense bf16, measured on the lent H200
  double efficiency = 0.6;           // of that peak, reached by NS (assumed)
  double hbm_bandwidth = 4.3e12;     // device-to-device copy measured there
  double kernel_overhead_s = 20e-6;  // launches per matrix
  int element_bytes = 2;             // bf16 NS operands
  double momentum_bytes = 16;        // fp32 G read, M read+write, U write
};

class KernelTimes {
 public:
  static KernelTimes CostModel(const Hardware& hw);
  static absl::StatusOr<KernelTimes> Measured(const std::string& path,
                                              const Hardware& hw);
  // Ours: the fastest method (name, seconds), momentum included.
  std::pair<std::string, double> Ours(kernels::Shape shape) const;
  double Redundant(kernels::Shape shape) const;
  const std::string& source() const { return source_; }

 private:
  struct Variant {
    std::string name;
    kernels::Method method = kernels::Method::kDirect;
    double symmetric = 0.5;
    std::vector<std::pair<double, double>> points;  // log flops, log rate
  };
  double Flops(const Variant& v, kernels::Shape s) const;
  double Seconds(const Variant& v, kernels::Shape s) const;
  double Momentum(kernels::Shape s) const;

  Hardware hw_;
  bool measured_ = false;
  std::string source_;
  std::vector<Variant> variants_;
};

struct TrainerConfig {
  double forward_s = 0;   // 0: estimated
  double backward_s = 0;  // 0: estimated (2x forward when forward is given)
  double tokens_per_gpu = 16384;
  double mfu = 0.4;
  double peak_flops = 790e12;
  int moe_top_k = 2;
  double hbm_bandwidth = 4.3e12;
  double adamw_bytes_per_param = 28;  // fp32 p r+w, g r, m r+w, v r+w
  double apply_bytes_per_param = 10;  // fp32 W r+w, bf16 update r
  double comm_bytes_per_element = 2;  // bf16 gradients and updates
};

struct Workload {
  Scenario scenario;  // gpus and links left to the caller
  double muon_params = 0, other_params = 0, active_params = 0;
  double ns_seconds = 0;  // sum of Ours over the matrices
  int gram_matrices = 0;  // where Gram was the faster method
};

absl::StatusOr<Workload> BuildWorkload(const Model& model,
                                       const KernelTimes& kernels,
                                       const TrainerConfig& trainer);

}  // namespace dmuon::scaling

#endif  // DMUON_BENCHMARKS_SCALING_WORKLOAD_H_
