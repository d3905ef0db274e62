// dmuon C++ client: connects a trainer rank to dmuond.
//
//   auto client = dmuon::Client::Connect("127.0.0.1:50051");
//   auto session = (*client)->OpenSession(spec);  // the parameter table
//   for each step:
//     copy param i's gradient into session->gradient(i), then
//     session->GradientReady(i);      // as backward produces it
//     session->WaitUpdate(i);         // update(i) = lr_scale * NS(momentum)
//     W_i <- W_i * (1 - lr * wd) - lr * update(i)   // the trainer applies it
//     session->FinishStep();
//
// Transports. kAuto picks shared memory when the daemon is on this host
// (gradients and updates are written in place) and inline (bytes in the Step
// stream) otherwise or when shm cannot be mapped. kAuto never picks a GPU
// transport: only the caller knows its tensors are on a GPU.
//
// GPU transports (kCudaIpc, kNccl; served by dmuond_cuda). The client links
// neither CUDA nor NCCL: the caller owns the GPU memory and the NCCL
// communicator (from Python through torch; from C++ through
// client/cuda/device_region.h). The region is laid out as for every transport
// (Client::ComputeRegionLayout: all gradient slots, then all update slots,
// fp32, 64-byte aligned), so the caller allocates it before OpenSession.
// gradient(i)/update(i) are then empty: the tensors are the caller's GPU
// memory at layout() offsets.
//   kCudaIpc (same host): allocate layout().total_bytes of GPU memory, export
//     it (cudaIpcGetMemHandle, optionally an interprocess event) into
//     SessionSpec::cuda_ipc. Per step: write the gradients, record the
//     exported event on the writing stream (or synchronize) and only then call
//     GradientReady/GradientsReady; the daemon reads them in place and writes
//     each update in place before announcing it (WaitUpdate, NextAnnounced).
//     At the end Close() the session first and free the memory only once
//     region_released() is true (the daemon no longer maps it).
//   kNccl (any host): after OpenSession join the communicator of nccl()
//     (ncclCommInitRank(nranks, unique_id, rank); the daemon is daemon_rank)
//     and, as the communicator's FIRST group, warm it up: one group of an
//     ncclSend of one fp32 to daemon_rank and an ncclRecv of one fp32 from
//     it (NCCL connects peers lazily inside the first group that uses them;
//     without this the first gradient send and the daemon's receive, posted
//     only after GradientsReady, wait for each other forever). Per
//     GradientsReady call: first post ONE ncclGroupStart/End group with an
//     ncclSend (fp32, the slot's elements) to daemon_rank of each listed
//     gradient slot, in the call's order, then call GradientsReady with the
//     same ids in the same order (GradientReady(i): a group of one). Once
//     every gradient of the step is declared, loop on NextAnnounced(): for
//     each vector it returns post one group of ncclRecv of those update
//     slots from daemon_rank, in that order, until it returns an empty
//     vector; then FinishStep. (transport/nccl.h: both sides post each
//     pair's transfers in one order, the step's gradients, then its updates.)
//     A closed session ends the job's communicator: reopen every rank.
// Pools (ConnectPool of several daemons) refuse GPU transports
// (UNIMPLEMENTED): each daemon would need its own region and communicator.
//
// Every call returns a Status carrying the daemon's message; nothing throws
// across this API. A Session is used by one trainer thread (its stream reader
// is internal).

#ifndef DMUON_CLIENT_CLIENT_H_
#define DMUON_CLIENT_CLIENT_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace grpc {
class ChannelCredentials;
}  // namespace grpc

namespace dmuon {

enum class Sharding { kReplicated, kRows, kUnreduced, kBlocks };
enum class TransportChoice { kAuto, kShm, kInline, kCudaIpc, kNccl };

struct ParamSpec {
  std::string name;
  int64_t rows = 0, cols = 0;  // the whole matrix
  Sharding sharding = Sharding::kReplicated;
  int64_t row_begin = 0, row_end = 0;  // kRows: this rank's rows
  int forward_order = 0;               // smaller: needed earlier
  int group = 0;
  // Matrices the next forward needs together (one transformer block's)
  // share a layer >= 0; the planners spread a layer over devices and
  // daemons so its updates come back in parallel. -1: none.
  int layer = -1;
  // kBlocks (protocol minor >= 3): this rank's local tensor is the rows
  // row_runs (their indices concatenated in order) by the columns col_runs,
  // row-major; each run is [begin, end). Both empty: this rank holds
  // nothing (local shape 0x0). Last, so that aggregate initializers of the
  // fields above keep their meaning.
  std::vector<std::pair<int64_t, int64_t>> row_runs{}, col_runs{};
};

// Muon hyperparameters (torch.optim.Muon's names and defaults). lr and weight
// decay stay with the trainer.
struct GroupSpec {
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  std::string schedule = "classic";  // classic | polar_express | you | custom
  std::vector<std::array<double, 3>> coefficients;  // custom
  std::string method = "direct";                    // direct | gram | auto
  std::string adjust_lr_fn = "original";  // original | match_rms_adamw |
                                          // spectral_unclamped
  double eps = 1e-7;
};

// kCudaIpc: the caller's region in GPU memory, exported (the proto's
// CudaIpcExport; strings hold raw bytes). transport/cuda_ipc.h ExportCudaIpc
// fills one from a device pointer.
struct CudaIpcRegion {
  std::string mem_handle;    // cudaIpcMemHandle_t (64 bytes) of the allocation
  uint64_t offset = 0;       // region byte 0 = allocation base + offset (% 64)
  uint64_t bytes = 0;        // exported size, >= the layout's total_bytes
  std::string event_handle;  // cudaIpcEventHandle_t recorded after writing
                             // gradients; empty: the caller synchronizes
  std::string device_uuid;   // cudaDeviceProp.uuid (16 bytes)
};

// What OpenSession expects of the job's existing momentum (the proto's
// Resume; docs/protocol.md "Resume"). A job holds momentum when it has
// completed a step, in the daemon's memory or in its --state-dir snapshot.
enum class Resume {
  // Protocol 1.0 behaviour: continue if the job holds momentum, else start.
  kAuto,
  // Start at step 1; ALREADY_EXISTS (naming the job's step) if it holds
  // momentum.
  kFresh,
  // Continue its momentum; NOT_FOUND if it holds none.
  kContinue,
  // Discard its momentum (memory and snapshot) and start at step 1;
  // FAILED_PRECONDITION while other ranks of it are open past step 0.
  kReplace,
};

struct SessionSpec {
  std::string job_id;
  // Anything but kAuto needs a daemon of protocol 1.1 or newer: an older
  // one would ignore it, so OpenSession refuses it (FAILED_PRECONDITION
  // naming both versions; the session it opened is closed unused).
  Resume resume = Resume::kAuto;
  // > 0: continue from exactly this completed step of the job (the
  // trainer's last completed step; kAuto or kContinue only): dmuond holds
  // the momentum of the step the job is at and, with --state-dir, of its
  // previously snapshotted step, and refuses any other step
  // (FAILED_PRECONDITION naming the steps held) instead of continuing from
  // it. A trainer that resumes after dmuond was killed between a snapshot's
  // write and its step_complete thus continues exactly (docs/protocol.md
  // "Resume at a step"). Needs protocol 1.4, refused like `resume` above.
  int64_t resume_step = 0;
  int rank = 0;
  int world_size = 1;
  std::vector<ParamSpec> params;
  std::vector<GroupSpec> groups;  // empty: one group of defaults
  TransportChoice transport = TransportChoice::kAuto;
  CudaIpcRegion cuda_ipc;  // kCudaIpc only (ignored otherwise)
  // A pool (ConnectPool) only; ignored by a single daemon's Client: the
  // daemon (index into the pool's addresses) of each parameter, used as is.
  // Empty: the pool plans (Client::PlanPool over each daemon's device count
  // as its Status RPC reports it). Every rank of a job must split the table
  // alike, and ranks that each ask the daemons may see different counts if
  // an executor's health changes between their opens; a trainer that can
  // compute the split once (e.g. rank 0: PlanPool(spec, DeviceCounts())) and
  // send it to every rank makes the ranks agree by construction. Checked at
  // OpenSession: one entry per parameter, each in [0, daemons), else
  // INVALID_ARGUMENT naming the parameter.
  std::vector<int> pool_owner;
};

// Where one parameter's two tensors sit in the session's region: this rank's
// view (its rows for kRows), fp32 row-major, offsets in bytes from region
// byte 0 (multiples of 64).
struct RegionSlot {
  int64_t rows = 0, cols = 0;
  uint64_t gradient_offset = 0, update_offset = 0;
  uint64_t bytes = 0;  // of each tensor: rows * cols * 4
};
struct RegionLayout {
  uint64_t total_bytes = 0;
  std::vector<RegionSlot> slots;  // by parameter index
};
bool operator==(const RegionSlot& a, const RegionSlot& b);
bool operator==(const RegionLayout& a, const RegionLayout& b);

// kNccl: the job's communicator (OpenSessionResponse.nccl). Trainer rank r
// joins as NCCL rank r of `nranks` (= world_size + 1); the daemon is
// `daemon_rank` (= world_size).
struct NcclInfo {
  std::string unique_id;  // ncclUniqueId (128 bytes), the same on every rank
  int nranks = 0;
  int daemon_rank = 0;
};

struct ClientOptions {
  std::chrono::milliseconds deadline{10000};  // per call, and for waits
  // How long Connect waits for a daemon that does not answer yet (refused,
  // unreachable); 0: `deadline`. Short for a daemon that should be up
  // already, long for one that may still be starting.
  std::chrono::milliseconds connect_deadline{0};
  int retries = 3;                         // UNAVAILABLE on idempotent calls
  std::chrono::milliseconds backoff{100};  // doubled per retry
  uint64_t max_message_bytes = 64ull << 20;
  // shm sessions: declare gradients and learn of updates through a
  // doorbell in the segment (docs/protocol.md "Doorbell": words and futex
  // wakes) rather than gradients_ready and UpdatesReady messages, which
  // cost the trainer's core 110-175 µs each. A daemon without it answers
  // without one and the stream carries them as before. false: always the
  // stream.
  bool doorbell = true;
  // TLS or other credentials; null: TLS from the tls_* files below when
  // tls_ca_file is set, else insecure (loopback, trusted networks).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // dmuond --auth-token-file: sent as `authorization: Bearer <token>` on
  // every call (over TLS, or plaintext to a loopback daemon). Empty: none.
  std::string token;
  // TLS (docs/security.md): PEM files. tls_ca_file: the CA that signed
  // dmuond's certificate (set: the channel is TLS); tls_cert_file and
  // tls_key_file: this client's certificate for mTLS
  // (--tls-client-ca-file). tls_server_name: the name to check the
  // daemon's certificate against when it differs from the address' host.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
};

// The daemon-held state of a job: enough to restore it onto any daemon.
struct State {
  int64_t completed_steps = 0;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> momentum;  // whole matrices, fp32
};

// What dmuond answered a Mark (Session::Mark; MarkResponse).
struct MarkInfo {
  int64_t step = 0;            // the step marked
  std::vector<int64_t> marks;  // the job's marks after it, oldest first
  uint64_t mark_bytes = 0;     // their bytes in the daemon's memory
  // Empty: on disk (with --state-dir; without it marks live as long as the
  // daemon). Else why the mark could not be written (it is held in memory).
  std::string not_durable;
};

class Session {
 public:
  virtual ~Session() = default;
  // Where this rank writes parameter `i`'s gradient (its rows for kRows),
  // fp32 row-major, before GradientReady(i). Empty for GPU transports (the
  // gradient goes to the caller's GPU memory at layout().slots[i]).
  virtual absl::Span<float> gradient(int i) = 0;
  // Parameter i's update for the current step; valid after WaitUpdate(i).
  // Empty for GPU transports (see gradient()).
  virtual absl::Span<const float> update(int i) = 0;
  // The step being built (1 for a fresh job; later after a resume).
  virtual int64_t step() const = 0;
  // "shm" | "inline" | "cuda_ipc" | "nccl".
  virtual std::string transport() const = 0;
  // Whether this session's declarations and updates go through the shm
  // segment's doorbell (ClientOptions::doorbell, granted) rather than Step
  // messages; a pool session: every daemon's do.
  virtual bool doorbell() const { return false; }
  // The region's layout as the daemon answered it (checked equal to
  // Client::ComputeRegionLayout(spec) at OpenSession). Empty for a pool
  // session spanning several daemons (each has its own region).
  virtual const RegionLayout& layout() const = 0;
  // kNccl: the communicator to join; empty (nranks 0) otherwise.
  virtual const NcclInfo& nccl() const = 0;

  // Hands gradients of the current step to the daemon, in `ids` order.
  // Non-blocking. GPU transports: the caller has first recorded its exported
  // event (cuda_ipc) or posted its ncclSend group of exactly these ids in
  // this order (nccl); see the top of this file.
  virtual absl::Status GradientReady(int i) = 0;
  virtual absl::Status GradientsReady(absl::Span<const int> ids) = 0;
  // GradientsReady with this step's momentum (beta) for each of `ids`, same
  // order, instead of its group's: torch's LR schedulers that cycle momentum
  // (OneCycleLR, CyclicLR; protocol minor 2, GradientsReady.momentum).
  // Every rank must send the same value for a parameter. `momentum` empty:
  // GradientsReady(ids). INVALID_ARGUMENT when the sizes differ; a value
  // outside [0, 1) or non-finite ends the step with INVALID_ARGUMENT from
  // the daemon. A daemon older than minor 2 (it would ignore the values):
  // FAILED_PRECONDITION naming its version, nothing sent.
  virtual absl::Status GradientsReadyWithMomentum(
      absl::Span<const int> ids, absl::Span<const double> momentum) = 0;
  // The hand-off of one host gradient in one call: copies `grad` (parameter
  // i's gradient as gradient(i) holds it: this rank's rows, fp32 row-major)
  // into gradient(i), then GradientsReadyWithMomentum({i}, momentum) (one
  // value or none). For a caller whose gradient is elsewhere in its own
  // memory (a framework's tensor): one copy and one declaration, with no
  // view of gradient(i) to make. Errors, before anything is written or
  // declared: INVALID_ARGUMENT naming the parameter when `grad`'s size is
  // not gradient(i)'s, or `momentum` holds more than one value;
  // FAILED_PRECONDITION for a GPU transport (no host memory). Then
  // GradientsReadyWithMomentum's. copied_ns (optional): when the copy was
  // done and the declaration began (base/trace.h TraceNowNs), for the
  // caller's step timeline.
  absl::Status HandOff(int i, absl::Span<const float> grad,
                       absl::Span<const double> momentum = {},
                       int64_t* copied_ns = nullptr);
  // Declares `ids` absent in the current step: no gradient (torch: .grad is
  // None), so the daemon computes nothing for them and leaves their
  // momentum untouched, as torch.optim.Muon skips them (protocol minor 1,
  // GradientsReady.absent_param_ids). Nothing is written or sent for them
  // (nccl: no ncclSend, and the daemon posts no receive for them, so the
  // other sends keep their order; a dmuond from before that refuses them
  // with UNIMPLEMENTED). Each is then done: WaitUpdate returns OK,
  // absent(i) is true, update(i) is left as it was, and NextAnnounced never
  // returns it (nccl: nothing to receive). With several ranks: a
  // SHARDING_REPLICATED or SHARDING_ROWS parameter must be absent on every
  // rank or none (INVALID_ARGUMENT naming it); a SHARDING_UNREDUCED one is
  // absent when it is absent on every rank, and otherwise counts as zeros
  // from the ranks that declared it absent (which still get its update:
  // announced, and over nccl received, as any other).
  virtual absl::Status GradientsAbsent(absl::Span<const int> ids) = 0;
  // The parameter ids of the current step's next UpdatesReady message, in
  // arrival order; each message is returned exactly once. Blocks until one
  // has arrived (up to the deadline: DEADLINE_EXCEEDED; a failed stream: its
  // Status). Returns an empty vector once every update of the step has been
  // announced and returned. With nccl the caller posts one ncclRecv group
  // per returned vector, in this order (the daemon sends in that order), and
  // must have declared every gradient of the step first (the daemon sends no
  // update before). Works for every transport of a single daemon; a pool
  // session spanning several daemons answers UNIMPLEMENTED.
  virtual absl::StatusOr<std::vector<int>> NextAnnounced() = 0;
  // Blocks until update i of the current step is back (or the deadline, or
  // the stream fails: the Status names the daemon's address). A gradient the
  // daemon skipped (non-finite) returns OK with a zero update; skipped(i) says
  // so. GPU transports: back = announced (cuda_ipc: the bytes are in the
  // caller's memory; nccl: the caller must still receive them).
  virtual absl::Status WaitUpdate(int i) = 0;
  virtual bool TryUpdate(int i) = 0;
  // When the session saw update i's UpdatesReady of the current step: read
  // off the stream, or with the doorbell taken from it by the first
  // WaitUpdate, NextAnnounced or TryUpdate after it landed (nothing wakes
  // the trainer for it). CLOCK_MONOTONIC nanoseconds (base/trace.h
  // TraceNowNs, the step timeline's clock); 0 before that, or for a
  // session that does not record it.
  virtual int64_t update_received_ns(int i) const { return 0; }
  // Whether the daemon skipped update i (non-finite gradient), and whether
  // parameter i was declared absent this step and the daemon answered it
  // (GradientsAbsent: no update, the parameter is unchanged). Both as of
  // the last WaitUpdate, NextAnnounced or TryUpdate that saw update i.
  virtual bool skipped(int i) const = 0;
  virtual bool absent(int i) const = 0;
  // Waits for every update of the current step, then moves to the next.
  // nccl: the daemon completes the step only once the caller has posted the
  // receives of every announced update (NextAnnounced).
  virtual absl::Status FinishStep() = 0;
  // Empty, or why the step FinishStep() last completed is not durable: it
  // was one that dmuond's --snapshot-every snapshots and its snapshot could
  // not be written (StepComplete.not_durable; a full or unwritable
  // --state-dir). Its updates are good, but a restarted dmuond would resume
  // the job from an older step. A pool session: every daemon's reason.
  virtual std::string not_durable() const = 0;
  // Empty, or what dmuond said at OpenSession that is not an error
  // (OpenSessionResponse.notice): this open created the job from zero
  // momentum although a snapshot of its id was found, which could not be
  // used and was moved aside (where to). A pool session: every daemon's.
  virtual std::string notice() const = 0;
  // Undoes the step FinishStep() just completed (protocol minor 1, Rewind in
  // docs/protocol.md): the daemon puts every matrix's momentum back to
  // before it and step() goes back by one, so the step's gradients can be
  // declared again (e.g. edited after they were handed off) and its updates
  // waited for anew. Only between FinishStep() and the next step's first
  // GradientsReady. A job of several ranks: every rank must call it (the
  // daemon undoes the step once all have asked, holding the others' streams
  // until then; a rank that sends the next step's gradients instead fails
  // the round, FAILED_PRECONDITION on every asking rank). A daemon that
  // cannot (momentum held in device memory, an older daemon) ends the
  // stream with FAILED_PRECONDITION, which the next wait returns.
  virtual absl::Status Rewind() = 0;

  virtual absl::StatusOr<State> GetState() = 0;
  virtual absl::Status SetState(const State& state) = 0;
  // Asks dmuond to keep the momentum of the job's completed step `step` (0:
  // the step the job is at) as a mark, so that a later OpenSession with
  // resume_step = that step, at any world size, continues from exactly it
  // (protocol minor 5, docs/protocol.md "Marks"). Between steps, from any
  // rank: a step other than the job's, or one whose successor is already
  // being computed, is FAILED_PRECONDITION naming the job's step; marking a
  // marked step again answers as the first time. A negative step:
  // INVALID_ARGUMENT, nothing sent. A daemon older than minor 5 (it does
  // not know Mark): FAILED_PRECONDITION naming both versions, nothing sent.
  // A pool session marks on every daemon; `marks` are the steps every one
  // holds, `mark_bytes` their sum.
  virtual absl::StatusOr<MarkInfo> Mark(int64_t step) = 0;
  // The protocol minor of the daemon that opened this session
  // (Capabilities.protocol_minor); a pool session's: its oldest daemon's.
  virtual uint32_t daemon_protocol_minor() const = 0;
  // Ends the session: CloseSession (a step in progress breaks the job), then
  // the Step stream. The daemon answers once it has released the session's
  // region (region_released()), waiting up to the deadline for a step
  // computation that still uses it. Only the first call talks to the
  // daemon; later ones return OK.
  virtual absl::Status Close() = 0;
  // After Close(): whether the daemon confirmed that it released the
  // session's region (CloseSessionResponse.region_released: no computation
  // uses it and it is unmapped), or no longer knew the session (released
  // before). False before Close() and when Close() failed or the daemon's
  // wait ran out. Until it is true the daemon may still read and write a
  // cuda_ipc region: free the exported memory only then
  // (client/cuda/device_region.h does).
  virtual bool region_released() const = 0;
};

class Client {
 public:
  // Fails with INVALID_ARGUMENT when `address` is not a daemon address
  // (CheckAddress), UNAVAILABLE naming it if no daemon answers within
  // options.connect_deadline (else options.deadline).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, ClientOptions options = {});
  // Several daemons as one pool (e.g. one per node). Each matrix goes to one
  // daemon: SessionSpec::pool_owner when set, else the plan
  // PlanPool(spec, DeviceCounts()), the counts fetched from the daemons (in
  // address order) when the pool session opens. A pool session is used
  // exactly like a single daemon's.
  //
  // Ranks that plan separately agree as long as they see the same device
  // counts. If an executor's health changes between two ranks' opens, they
  // split the table differently and a daemon refuses the rank that opens
  // second with its table-mismatch error (INVALID_ARGUMENT "... does not
  // match rank R's ...", naming the pool member, with a hint to pass
  // pool_owner); with a table smaller than the pool's devices it may
  // instead show as the other ranks' deadline. Setting pool_owner on every
  // rank from one plan avoids both.
  static absl::StatusOr<std::unique_ptr<Client>> ConnectPool(
      const std::vector<std::string>& addresses, ClientOptions options = {});
  // Which daemon (index into devices_per_daemon) owns each parameter:
  // planner/planner.h PlanBest over the cost model's flops (LPT spreading
  // each layer, local search, an exact search for small tables) on every
  // (daemon, device) slot, slots numbered daemon by daemon (daemon 0's
  // devices first); a matrix's daemon is its slot's. So a daemon of 8
  // devices gets about twice the work of one of 4. Counts < 1 count as 1.
  // Deterministic: the same table (names aside; each matrix's whole shape,
  // group and layer) and counts give the same plan in every process.
  static std::vector<int> PlanPool(const SessionSpec& spec,
                                   const std::vector<int>& devices_per_daemon);
  // `daemons` daemons of one device each: PlanPool(spec, {1, 1, ...}).
  // (Beware PlanPool(spec, {3}): that is this overload, three daemons.)
  static std::vector<int> PlanPool(const SessionSpec& spec, int daemons);
  // Whether `address` ("host:port", "[v6]:port", "unix:path") is this host:
  // a unix socket, a loopback or wildcard address, localhost, this host's
  // name, or a name resolving to one of the addresses this host's name
  // resolves to. kAuto picks shm for such a daemon; DMuon picks cuda_ipc.
  static bool IsLocalAddress(const std::string& address);
  // OK when `address` is "host:port", "[v6]:port" (port in [1, 65535]),
  // "unix:path", or a gRPC target with an explicit resolver ("dns:",
  // "ipv4:", "ipv6:", "unix-abstract:"); INVALID_ARGUMENT naming it
  // otherwise (no port: gRPC would try 443; a URL's scheme).
  static absl::Status CheckAddress(const std::string& address);
  // The region layout the daemon will use for `spec` (transport.h
  // ComputeLayout over this rank's view of each parameter: its rows for
  // kRows), so a caller can allocate and export GPU memory before
  // OpenSession. INVALID_ARGUMENT naming the parameter for a non-positive
  // dimension, a row range outside the matrix, or an overflow.
  static absl::StatusOr<RegionLayout> ComputeRegionLayout(
      const SessionSpec& spec);

  virtual ~Client() = default;
  // Opens rank spec.rank's session over spec.transport. GPU transports on a
  // daemon that does not serve them (a CPU dmuond): UNIMPLEMENTED naming the
  // transport and the address. kCudaIpc with an export that cannot hold the
  // layout: INVALID_ARGUMENT before any call. A daemon whose layout differs
  // from ComputeRegionLayout(spec): INTERNAL naming both sizes.
  virtual absl::StatusOr<std::unique_ptr<Session>> OpenSession(
      const SessionSpec& spec) = 0;
  virtual const std::string& address() const = 0;
  // Each daemon's device count, as PlanPool takes it: its healthy executors
  // in its Status RPC (at least 1). One entry for a single daemon; a pool's
  // in address order. Errors name the daemon's address.
  virtual absl::StatusOr<std::vector<int>> DeviceCounts() = 0;
};

}  // namespace dmuon

#endif  // DMUON_CLIENT_CLIENT_H_
