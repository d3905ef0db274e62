// Scaling simulator: predicts the optimizer step of a data-parallel job on
// G GPUs for four strategies, from per-matrix kernel times, the trainer's
// forward and backward times and link bandwidths, for two kinds of job
// (Job): replicated (DDP: every rank holds the whole model) and FSDP2
// (every rank holds 1/G of each parameter's rows).
//
//   redundant    in-trainer Muon on every rank (torch.optim.Muon): after
//                backward, every GPU runs momentum + NS of every matrix.
//   round_robin  matrix i on GPU i mod G after backward (our kernels),
//                then one bulk all-gather of the updates.
//   dmuon        the pool: PlanBest (planner/planner.h) over the G devices,
//                and an event simulation of the overlap (SimulatePool).
//   adamw        fused AdamW over every parameter on every rank after
//                backward (memory-bound); in an FSDP2 job over each rank's
//                1/G shard only (sharded AdamW, ZeRO/FSDP).
//
// Assumptions (also in benchmarks/README.md, "Scaling"):
// - Plain data parallelism: every rank holds the whole model, all ranks run
//   in lockstep, and the trainer's own gradient all-reduce (DDP) is hidden
//   under backward in every strategy, the no-optimizer baseline included.
//   For dmuon the Muon gradients are not all-reduced: each is reduced into
//   its owner and the update broadcast back (the NCCL transport);
//   these transfers are simulated explicitly.
// - Collectives are hierarchical (NVLink inside a node, one NIC per GPU
//   between nodes, phases not overlapped), see AllGather/ReduceTo. They
//   cost no GPU compute time, and dmuon's run one at a time on one channel
//   (one NCCL communicator issues in order), earliest forward layer first.
// - The non-Muon parameters (embeddings, head, norms) get AdamW on every
//   rank between backward and forward in every Muon strategy
//   (Timeline::after_backward_s), and the trainer applies each matrix's
//   update (W <- W (1 - lr wd) - lr' O: Timeline::apply_s) before that
//   layer's forward: both are exposed trainer time.
// - Placement kShared: the optimizer devices ARE the training GPUs (one
//   dmuond per node owning its GPUs): GPU time is conserved, so a GPU runs
//   its optimizer work after backward and before its own forward
//   (optimizer work first whenever it has any ready). kDedicated: the
//   devices are not the trainer's (spare GPUs, or the idealized
//   overlap): work starts as soon as a gradient is there and never slows
//   the trainer. The CPU validation (validate.cc) is of this kind.
// - A device runs the earliest-forward-order ready matrix, batched with the
//   other ready ones of the same shape (up to max_batch, as dmuond's
//   scheduler does); a batch costs the sum of its matrices' times (no
//   batching speedup is credited) and its updates leave together.
// - FSDP2 jobs (Job::kFsdp2): the trainer's gradient reduce-scatter is hidden
//   under backward in every strategy and the baseline (as DDP's all-reduce
//   is); each rank holds 1/G of each gradient's rows. dmuon gathers a
//   matrix's G row shards into its owner (GatherTo), computes once and
//   scatters the update's rows back (ScatterFrom), on the same serial
//   channel; each rank applies only its rows (apply_s / G) and runs AdamW
//   only on its shard of the non-Muon parameters (after_backward_s / G).
//   Before segment s's forward the trainer all-gathers its parameters
//   (Timeline::unshard, bf16): in order, on the same channel, once every
//   update of s is back. The baseline is the same FSDP2 job with no
//   optimizer at all (its all-gathers included, so they count only where
//   the optimizer delays them).

#ifndef DMUON_BENCHMARKS_SCALING_SIMULATOR_H_
#define DMUON_BENCHMARKS_SCALING_SIMULATOR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dmuon::scaling {

// ---- Links and collectives ------------------------------------------------

struct Links {
  int gpus_per_node = 8;
  // Bytes per second per GPU per direction, as collectives achieve them.
  // H200 SXM: NVLink 4 is 450 GB/s per direction (900 GB/s total); 80% of
  // it. NDR InfiniBand: 400 Gb/s = 50 GB/s per NIC, one per GPU; 90%.
  double nvlink_bandwidth = 360e9;
  double ib_bandwidth = 45e9;
  double nvlink_latency = 5e-6;  // per intra-node phase
  double ib_latency = 10e-6;     // per level of a log2(nodes) tree
};

// `busy` occupies the channel; `latency` delays arrival without occupying it
// (pipelined).
struct CommCost {
  double busy = 0;
  double latency = 0;
  double total() const { return busy + latency; }
};

// S bytes gathered from G GPUs (each holds S/G), g = min(G, gpus_per_node)
// per node, N = ceil(G / g) nodes: an inter-node all-gather of S/g among
// the N GPUs with the same local index, then an intra-node one:
//   (N-1)/N S / (g B_ib) + (g-1)/g S / B_nv.
// A reduce-scatter costs the same; an all-reduce twice that.
CommCost AllGather(const Links& links, int gpus, double bytes);
CommCost AllReduce(const Links& links, int gpus, double bytes);
// An unreduced S-byte gradient on each of G GPUs, summed into one owner:
// reduce-scatter inside each node, each slice reduced across nodes into the
// owner's node (one NIC per slice), gathered into the owner:
//   2 (g-1)/g S / B_nv + [N > 1] S / (g B_ib).
// BroadcastFrom (the update back to every GPU) is the mirror image.
CommCost ReduceTo(const Links& links, int gpus, double bytes);
CommCost BroadcastFrom(const Links& links, int gpus, double bytes);
// FSDP2: an S-byte matrix whose rows are sharded over G GPUs (S/G each),
// gathered into one owner. The shards of other nodes enter the owner's node
// through its g NICs (GPU j's from the GPUs j of the other nodes), then the
// owner takes its g-1 node peers' S/g over NVLink:
//   (N-1)/N S / (g B_ib) + (g-1)/g S / B_nv   (AllGather's cost: the owner
// receives (G-1)/G S, as every GPU of an all-gather does).
// ScatterFrom (each rank's rows of the update back) is the mirror image.
CommCost GatherTo(const Links& links, int gpus, double bytes);
CommCost ScatterFrom(const Links& links, int gpus, double bytes);
// Every GPU sends 1/G of its `bytes_per_gpu` to each GPU (round-robin's
// bulk exchange under FSDP2): its own NIC carries the (N-1)/N that crosses
// nodes, NVLink the (g-1)/(gN) from its node peers:
//   (N-1)/N L / B_ib + (g-1)/(g N) L / B_nv.
CommCost AllToAll(const Links& links, int gpus, double bytes_per_gpu);

// ---- Event simulation of the pool -----------------------------------------

// The trainer's step, by segment in forward order (segment 0 runs first in
// forward and last in backward). Backward runs segments S-1 .. 0.
struct Timeline {
  std::vector<double> forward_s, backward_s;
  double after_backward_s = 0;  // trainer work between backward and forward
  std::vector<double> apply_s;  // per segment, before its forward (or empty)
  // FSDP2: per segment, the all-gather of its parameters before its forward,
  // on the channel, once all its updates are back (empty: none, DDP).
  std::vector<CommCost> unshard;
  double forward() const;
  double backward() const;
};

// One Muon matrix.
struct Task {
  int segment = 0;      // its gradient is ready when this segment's
                        // backward ends; its update is needed before this
                        // segment's forward
  int owner = 0;        // device
  int shape_key = 0;    // equal keys may share a batched launch
  double kernel_s = 0;  // momentum + NS (+ scale) on the owner
  CommCost reduce;      // gradient to the owner
  CommCost broadcast;   // update back to the trainer
};

enum class Placement { kShared, kDedicated };

struct PoolConfig {
  int devices = 1;
  Placement placement = Placement::kShared;
  int max_batch = 16;
};

struct PoolResult {
  double backward_end = 0;
  double forward_end = 0;   // the last GPU's forward
  double baseline_end = 0;  // backward + forward with no optimizer at all
                            // (with `unshard`: simulated, all-gathers in)
  double exposed = 0;       // forward_end - baseline_end
  double last_update = 0;   // the last update's arrival
  std::vector<double> device_busy;  // optimizer seconds per device
};

// Discrete-event simulation. Every gradient is reduced to its owner when its
// segment's backward ends; the owner runs ready work (see the header
// comment); each update is broadcast when its batch ends; segment s's
// forward starts when segment s-1's is done and every update of segment s
// has arrived (and, with `unshard`, its all-gather has). kShared needs
// devices == the GPU count. INVALID_ARGUMENT for an owner or a segment out
// of range.
absl::StatusOr<PoolResult> SimulatePool(const Timeline& timeline,
                                        const std::vector<Task>& tasks,
                                        const PoolConfig& config);

// ---- The four strategies --------------------------------------------------

struct MatrixCost {
  int segment = 0;
  int shape_key = 0;
  double ours_s = 0;       // momentum + NS with our kernel choice
  double redundant_s = 0;  // the same as torch.optim.Muon runs it
  double bytes = 0;        // gradient (= update) bytes on the wire
};

enum class Job {
  kReplicated,  // DDP: every rank holds every parameter and its gradient
  kFsdp2,       // FSDP2: every rank holds 1/G of each parameter's rows
};

const char* JobName(Job job);  // "replicated", "fsdp2"

struct Scenario {
  std::vector<MatrixCost> matrices;
  // Whole-model figures: after_backward_s = AdamW of the non-Muon
  // parameters, apply_s = applying every update, on one rank holding
  // everything; an FSDP2 job divides both by G.
  Timeline timeline;
  double adamw_all_s = 0;  // AdamW over every parameter, one GPU
  // FSDP2: bytes each segment's forward all-gathers (its parameters, bf16).
  std::vector<double> segment_param_bytes;
  Job job = Job::kReplicated;
  int gpus = 1;
  Links links;
  int max_batch = 16;
};

struct StrategyResult {
  std::string strategy;
  // From the end of backward until the last update is applied, were the
  // next forward not overlapped (dmuon's gradient transfers, and in
  // kDedicated its kernels, still overlap the backward, as the trainer's
  // all-reduce does for the others).
  double optimizer_s = 0;
  double exposed_s = 0;  // what it adds to the step
  double step_s = 0;     // backward + forward + exposed
};

// Rows: redundant, round_robin, dmuon (kShared), dmuon_dedicated, adamw.
// Replicated job: as the header says. FSDP2 job (every row's trainer work
// over 1/G: AdamW of the rank's shard, applying its rows):
//   redundant    every rank all-gathers every gradient (AllGather), runs NS
//                of every matrix, keeps its rows;
//   round_robin  matrix i gathered into GPU i mod G and scattered back
//                (two bulk AllToAll), NS in between;
//   dmuon        GatherTo / ScatterFrom per matrix in the event simulation;
//   adamw        sharded AdamW: adamw_all_s / G.
// Serial rows run in the event simulation too (no tasks, their time after
// backward) so that the parameter all-gathers they delay are counted.
absl::StatusOr<std::vector<StrategyResult>> SimulateStrategies(
    const Scenario& scenario);

// dmuon's traffic for one step, bytes, with each matrix's owner.
struct Traffic {
  double rank_out = 0;   // gradient bytes one rank sends (replicated: each
                         // whole unreduced gradient; FSDP2: its rows, 1/G)
  double rank_in = 0;    // update bytes one rank receives (the same)
  double owner_in = 0;   // FSDP2: most gradient bytes into one owner GPU
                         // from the other ranks, (G-1)/G of each matrix it
                         // owns (replicated: 0, not modelled per link)
  double owner_out = 0;  // FSDP2: the same for its scattered updates
  double node_in = 0;    // FSDP2: most bytes into one node's daemon from
                         // other nodes, (N-1)/N of each matrix it owns
};
Traffic DmuonTraffic(const Scenario& scenario, const std::vector<int>& owners);

// Owners as dmuon plans them: PlanBest over `seconds` onto `devices`, each
// layer (`layers[i]`, here the matrix's segment) spread over the devices.
std::vector<int> PlanOwners(const std::vector<double>& seconds,
                            const std::vector<int>& layers, int devices);

}  // namespace dmuon::scaling

#endif  // DMUON_BENCHMARKS_SCALING_SIMULATOR_H_
