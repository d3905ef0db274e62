// dmuon.Client / dmuon.Session: the C++ client library for Python. Tensor
// buffers are numpy views over the session's memory (the shm segment the
// daemon also maps, or the inline transport's heap region): zero-copy.
// GPU transports ("cuda_ipc", "nccl"; client.h) have no host memory: the
// caller's GPU tensors sit at layout() offsets of its own region (sized by
// region_layout() before open_session) and move as client.h prescribes.
// Blocking calls release the GIL.

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/python/bindings.h"
#include "client/python/py_session.h"

namespace py = pybind11;

namespace dmuon::python {
namespace {

std::chrono::milliseconds Millis(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    Throw(absl::InvalidArgumentError(absl::StrCat(
        "a deadline must be a positive number of seconds, got ", seconds)));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000 + 0.5));
}

[[noreturn]] void UnknownKey(const char* what, const std::string& key) {
  Throw(absl::InvalidArgumentError(
      absl::StrCat(what, ": unknown key '", key, "'")));
}

Sharding ParseSharding(const std::string& s) {
  if (s == "replicated") return Sharding::kReplicated;
  if (s == "rows") return Sharding::kRows;
  if (s == "unreduced") return Sharding::kUnreduced;
  if (s == "blocks") return Sharding::kBlocks;
  Throw(absl::InvalidArgumentError(absl::StrCat(
      "sharding '", s, "' is not one of replicated, rows, unreduced, blocks")));
}

// Runs [(begin, end), ...] (sharding='blocks': row_runs, col_runs).
std::vector<std::pair<int64_t, int64_t>> ToRuns(const py::handle& v,
                                                const std::string& name,
                                                const char* key) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& h : v) {
    py::sequence t;
    try {
      t = h.cast<py::sequence>();
    } catch (const py::cast_error&) {
      t = py::sequence();
    }
    if (t.size() != 2) {
      Throw(absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "': ", key,
                       " is a list of (begin, end) pairs, got ",
                       py::repr(h).cast<std::string>())));
    }
    runs.emplace_back(t[0].cast<int64_t>(), t[1].cast<int64_t>());
  }
  return runs;
}

// A parameter: (name, rows, cols) or a dict with name, rows, cols and
// optionally sharding, row_begin, row_end, row_runs, col_runs,
// forward_order, group, layer (an int >= 0, or None / absent for no
// layer).
ParamSpec ToParam(const py::handle& h, int index) {
  ParamSpec p;
  p.forward_order = index;
  if (py::isinstance<py::dict>(h)) {
    for (const auto& kv : h.cast<py::dict>()) {
      const std::string k = kv.first.cast<std::string>();
      const py::handle v = kv.second;
      if (k == "name")
        p.name = v.cast<std::string>();
      else if (k == "rows")
        p.rows = v.cast<int64_t>();
      else if (k == "cols")
        p.cols = v.cast<int64_t>();
      else if (k == "sharding")
        p.sharding = ParseSharding(v.cast<std::string>());
      else if (k == "row_begin")
        p.row_begin = v.cast<int64_t>();
      else if (k == "row_end")
        p.row_end = v.cast<int64_t>();
      else if (k == "row_runs")
        p.row_runs = ToRuns(v, p.name, "row_runs");
      else if (k == "col_runs")
        p.col_runs = ToRuns(v, p.name, "col_runs");
      else if (k == "forward_order")
        p.forward_order = v.cast<int>();
      else if (k == "group")
        p.group = v.cast<int>();
      else if (k == "layer")
        p.layer = v.is_none() ? -1 : v.cast<int>();
      else
        UnknownKey("parameter", k);
    }
  } else {
    auto t = h.cast<py::tuple>();
    if (t.size() != 3) {
      Throw(absl::InvalidArgumentError(
          "a parameter is (name, rows, cols) or a dict"));
    }
    p.name = t[0].cast<std::string>();
    p.rows = t[1].cast<int64_t>();
    p.cols = t[2].cast<int64_t>();
  }
  return p;
}

// A group: a dict with any of momentum, nesterov, ns_steps, schedule,
// coefficients (list of (a, b, c)), method, adjust_lr_fn, eps.
GroupSpec ToGroup(const py::handle& h) {
  GroupSpec g;
  for (const auto& kv : h.cast<py::dict>()) {
    const std::string k = kv.first.cast<std::string>();
    const py::handle v = kv.second;
    if (k == "momentum")
      g.momentum = v.cast<double>();
    else if (k == "nesterov")
      g.nesterov = v.cast<bool>();
    else if (k == "ns_steps")
      g.ns_steps = v.cast<int>();
    else if (k == "schedule")
      g.schedule = v.cast<std::string>();
    else if (k == "method")
      g.method = v.cast<std::string>();
    else if (k == "adjust_lr_fn")
      g.adjust_lr_fn = v.cast<std::string>();
    else if (k == "eps")
      g.eps = v.cast<double>();
    else if (k == "coefficients") {
      for (const auto& c : v) {
        auto x = c.cast<std::vector<double>>();
        if (x.size() != 3) {
          Throw(absl::InvalidArgumentError(
              "group coefficients: expected (a, b, c) triples"));
        }
        g.coefficients.push_back({x[0], x[1], x[2]});
      }
    } else {
      UnknownKey("group", k);
    }
  }
  return g;
}

TransportChoice ParseTransport(const std::string& t) {
  if (t == "auto") return TransportChoice::kAuto;
  if (t == "shm") return TransportChoice::kShm;
  if (t == "inline") return TransportChoice::kInline;
  if (t == "cuda_ipc") return TransportChoice::kCudaIpc;
  if (t == "nccl") return TransportChoice::kNccl;
  Throw(absl::InvalidArgumentError(absl::StrCat(
      "transport '", t, "' is not one of auto, shm, inline, cuda_ipc, nccl")));
}

// open_session(resume=...): the proto's Resume (client.h Resume).
Resume ParseResume(const std::string& r) {
  if (r == "auto") return Resume::kAuto;
  if (r == "fresh") return Resume::kFresh;
  if (r == "continue") return Resume::kContinue;
  if (r == "replace") return Resume::kReplace;
  Throw(absl::InvalidArgumentError(absl::StrCat(
      "resume '", r, "' is not one of auto, fresh, continue, replace")));
}

// cuda_ipc: a dict with mem_handle (bytes), offset, bytes, event_handle
// (bytes), device_uuid (bytes).
CudaIpcRegion ToCudaIpc(const py::handle& h) {
  CudaIpcRegion r;
  for (const auto& kv : h.cast<py::dict>()) {
    const std::string k = kv.first.cast<std::string>();
    const py::handle v = kv.second;
    if (k == "mem_handle")
      r.mem_handle = v.cast<std::string>();
    else if (k == "offset")
      r.offset = v.cast<uint64_t>();
    else if (k == "bytes")
      r.bytes = v.cast<uint64_t>();
    else if (k == "event_handle")
      r.event_handle = v.cast<std::string>();
    else if (k == "device_uuid")
      r.device_uuid = v.cast<std::string>();
    else
      UnknownKey("cuda_ipc", k);
  }
  return r;
}

std::vector<ParamSpec> ToParams(const py::list& params) {
  std::vector<ParamSpec> out;
  int i = 0;
  for (const auto& h : params) out.push_back(ToParam(h, i++));
  return out;
}

// dict(total_bytes=..., slots=[dict(rows, cols, gradient_offset,
// update_offset, bytes), ...]).
py::dict LayoutToDict(const RegionLayout& l) {
  py::list slots;
  for (const RegionSlot& s : l.slots) {
    py::dict d;
    d["rows"] = s.rows;
    d["cols"] = s.cols;
    d["gradient_offset"] = s.gradient_offset;
    d["update_offset"] = s.update_offset;
    d["bytes"] = s.bytes;
    slots.append(std::move(d));
  }
  py::dict d;
  d["total_bytes"] = l.total_bytes;
  d["slots"] = slots;
  return d;
}

py::array View(py::object self, int i, bool gradient, bool writable) {
  PySession& ps = self.cast<PySession&>();
  const auto [rows, cols] = ps.local_shape(i);
  if (rows == 0 || cols == 0) {  // this rank holds nothing of it (blocks)
    py::array_t<float> a(std::vector<py::ssize_t>{rows, cols});
    if (!writable) a.attr("setflags")(py::arg("write") = false);
    return std::move(a);
  }
  float* data = gradient ? ps.s().gradient(i).data()
                         : const_cast<float*>(ps.s().update(i).data());
  if (data == nullptr) {
    Throw(absl::FailedPreconditionError(absl::StrCat(
        "a ", ps.s().transport(), " session has no host memory: parameter ", i,
        "'s ", gradient ? "gradient" : "update",
        " lives in your GPU region at layout()['slots'][", i, "]")));
  }
  py::array_t<float> a({rows, cols},
                       {cols * static_cast<int64_t>(sizeof(float)),
                        static_cast<int64_t>(sizeof(float))},
                       data, self);
  if (!writable) a.attr("setflags")(py::arg("write") = false);
  return std::move(a);
}

py::dict StateToDict(const State& s) {
  py::dict d;
  d["completed_steps"] = s.completed_steps;
  d["names"] = s.names;
  d["shapes"] = s.shapes;
  py::list m;
  for (size_t i = 0; i < s.momentum.size(); ++i) {
    std::vector<py::ssize_t> dims(s.shapes[i].begin(), s.shapes[i].end());
    py::array_t<float> a(dims);
    std::copy(s.momentum[i].begin(), s.momentum[i].end(), a.mutable_data());
    m.append(std::move(a));
  }
  d["momentum"] = m;
  return d;
}

State DictToState(const py::dict& d) {
  State s;
  s.completed_steps = d["completed_steps"].cast<int64_t>();
  s.names = d["names"].cast<std::vector<std::string>>();
  py::list m = d["momentum"];
  if (m.size() != s.names.size()) {
    Throw(absl::InvalidArgumentError(absl::StrCat("state: ", s.names.size(),
                                                  " names but ", m.size(),
                                                  " momentum tensors")));
  }
  for (const auto& h : m) {
    auto a =
        py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(
            h);
    if (!a || a.ndim() != 2) {
      Throw(absl::InvalidArgumentError(
          "state: every momentum tensor must be a 2-D float array"));
    }
    s.shapes.push_back({a.shape(0), a.shape(1)});
    s.momentum.emplace_back(a.data(), a.data() + a.size());
  }
  return s;
}

// Credentials (docs/security.md): each one given (not None) is used, the
// others come from the environment (dmuon._auth.from_env: DMUON_TOKEN,
// DMUON_TOKEN_FILE, DMUON_TLS_*).
void SetCredentials(ClientOptions& o, const py::object& token,
                    const py::object& ca, const py::object& cert,
                    const py::object& key, const py::object& server_name) {
  py::dict env = py::module_::import("dmuon._auth").attr("from_env")();
  auto pick = [&](const py::object& given, const char* name) {
    return given.is_none() ? env[name].cast<std::string>()
                           : given.cast<std::string>();
  };
  o.token = pick(token, "token");
  o.tls_ca_file = pick(ca, "tls_ca_file");
  o.tls_cert_file = pick(cert, "tls_cert_file");
  o.tls_key_file = pick(key, "tls_key_file");
  o.tls_server_name = pick(server_name, "tls_server_name");
}

// Client(address, ...): one daemon (a str) or a pool (a list of them).
std::shared_ptr<Client> Connect(const py::object& address, double deadline,
                                int retries, double backoff, uint64_t max_bytes,
                                const py::object& token, const py::object& ca,
                                const py::object& cert, const py::object& key,
                                const py::object& server_name,
                                const py::object& connect_deadline,
                                bool doorbell) {
  ClientOptions o;
  SetCredentials(o, token, ca, cert, key, server_name);
  o.deadline = Millis(deadline);
  if (!connect_deadline.is_none())
    o.connect_deadline = Millis(connect_deadline.cast<double>());
  o.retries = retries;
  o.backoff = Millis(backoff);
  o.max_message_bytes = max_bytes;
  o.doorbell = doorbell;
  const bool pool = !py::isinstance<py::str>(address);
  std::vector<std::string> addresses;
  if (pool) {
    addresses = address.cast<std::vector<std::string>>();
  } else {
    addresses = {address.cast<std::string>()};
  }
  absl::StatusOr<std::unique_ptr<Client>> c;
  {
    py::gil_scoped_release release;
    c = pool ? Client::ConnectPool(addresses, o)
             : Client::Connect(addresses[0], o);
  }
  if (!c.ok()) Throw(c.status());
  return std::shared_ptr<Client>(std::move(*c));
}

// Client.open_session(...).
std::unique_ptr<PySession> OpenSession(
    Client& c, const std::string& job_id, const py::list& params,
    const py::object& groups, int rank, int world_size,
    const std::string& transport, const py::object& cuda_ipc,
    const py::object& pool_owner, const py::object& resume) {
  SessionSpec spec;
  spec.job_id = job_id;
  // An int (not a bool): continue from exactly that completed step.
  if (!py::isinstance<py::bool_>(resume) && !py::isinstance<py::str>(resume) &&
      PyIndex_Check(resume.ptr())) {  // an int, numpy's too
    spec.resume = Resume::kContinue;
    spec.resume_step = py::int_(resume).cast<int64_t>();
    if (spec.resume_step < 1) {
      Throw(absl::InvalidArgumentError(absl::StrCat(
          "resume step ", spec.resume_step,
          " is not a completed step (>= 1): use resume='fresh' to start")));
    }
  } else {
    spec.resume = ParseResume(resume.cast<std::string>());
  }
  spec.rank = rank;
  spec.world_size = world_size;
  spec.params = ToParams(params);
  if (!groups.is_none())
    for (const auto& h : groups) spec.groups.push_back(ToGroup(h));
  spec.transport = ParseTransport(transport);
  if (!cuda_ipc.is_none()) spec.cuda_ipc = ToCudaIpc(cuda_ipc);
  if (!pool_owner.is_none())
    spec.pool_owner = pool_owner.cast<std::vector<int>>();
  absl::StatusOr<std::unique_ptr<Session>> s;
  {
    py::gil_scoped_release release;
    s = c.OpenSession(spec);
  }
  if (!s.ok()) Throw(s.status());
  return std::make_unique<PySession>(std::move(*s), std::move(spec.params));
}

// region_layout, check_address, is_local_address, plan_pool: the client's
// static helpers.
void RegisterLayoutAndPlan(py::module_& m) {
  m.def(
      "region_layout",
      [](const py::list& params, int rank, int world_size) {
        if (world_size < 1 || rank < 0 || rank >= world_size) {
          Throw(absl::InvalidArgumentError(
              absl::StrCat("region_layout: rank ", rank,
                           " is outside [0, world_size=", world_size, ")")));
        }
        SessionSpec spec;
        spec.rank = rank;
        spec.world_size = world_size;
        spec.params = ToParams(params);
        auto l = Client::ComputeRegionLayout(spec);
        if (!l.ok()) Throw(l.status());
        return LayoutToDict(*l);
      },
      py::arg("params"), py::arg("rank") = 0, py::arg("world_size") = 1,
      "The region layout dmuond will use for `rank`'s parameter table "
      "`params` (as open_session takes it; this rank's rows for row-sharded "
      "ones, from their row_begin/row_end; its runs' lengths for blocks ones, "
      "0x0 when it holds nothing): "
      "dict(total_bytes, slots=[dict(rows, cols, gradient_offset, "
      "update_offset, bytes)]), fp32, all gradients then all updates, "
      "64-byte aligned. Size and export a GPU region with it before "
      "open_session(transport='cuda_ipc').");
  m.def(
      "check_address",
      [](const std::string& address) {
        if (absl::Status st = Client::CheckAddress(address); !st.ok())
          Throw(st);
      },
      py::arg("address"),
      "Raises InvalidArgumentError (a ValueError) naming `address` when it "
      "is not host:port, [v6]:port, unix:path or a gRPC target with its "
      "resolver (Client::CheckAddress).");
  m.def("is_local_address", &Client::IsLocalAddress, py::arg("address"),
        "Whether `address` is this host (Client::IsLocalAddress: a unix "
        "socket, loopback, this host's name or one of its addresses).");
  m.def(
      "plan_pool",
      [](const py::list& params, const std::vector<int>& devices_per_daemon,
         const py::object& groups) {
        SessionSpec spec;
        spec.params = ToParams(params);
        if (!groups.is_none())
          for (const auto& h : groups) spec.groups.push_back(ToGroup(h));
        return Client::PlanPool(spec, devices_per_daemon);
      },
      py::arg("params"), py::arg("devices_per_daemon"),
      py::arg("groups") = py::none(),
      "The daemon (index into the pool's addresses) of each parameter of "
      "the table `params` (as open_session takes it) with the Muon groups "
      "`groups`, planned over every (daemon, device) slot "
      "(Client::PlanPool): devices_per_daemon as Client.device_counts() "
      "reports them. Deterministic: pass the result to every rank's "
      "open_session(pool_owner=...) so all ranks split the table alike.");
}

// dmuon.Client: connecting (one daemon or a pool) and opening sessions.
void RegisterClientClass(py::module_& m) {
  py::class_<Client, std::shared_ptr<Client>>(
      m, "Client",
      "A connection to dmuond. Client(address, deadline=10.0, retries=3, "
      "backoff=0.1, max_message_bytes=64 MiB, token=None, tls_ca_file=None, "
      "tls_cert_file=None, tls_key_file=None, tls_server_name=None, "
      "connect_deadline=None, doorbell=True); deadlines in seconds "
      "(connect_deadline: the wait for a daemon that does not answer yet; "
      "None: deadline). doorbell: shm sessions declare gradients and learn "
      "of updates through words in the segment and futex wakes "
      "(docs/protocol.md \"Doorbell\"); False: Step messages. An "
      "address that is not host:port, [v6]:port or unix:path is a "
      "ValueError naming it. A list of addresses is a pool: each matrix goes "
      "to one daemon of it. Credentials left None come from the environment "
      "(DMUON_TOKEN, DMUON_TOKEN_FILE, DMUON_TLS_CA_FILE, "
      "DMUON_TLS_CERT_FILE, DMUON_TLS_KEY_FILE; dmuon/_auth.py).")
      .def(py::init(&Connect), py::arg("address"), py::arg("deadline") = 10.0,
           py::arg("retries") = 3, py::arg("backoff") = 0.1,
           py::arg("max_message_bytes") = uint64_t{64} << 20,
           py::arg("token") = py::none(), py::arg("tls_ca_file") = py::none(),
           py::arg("tls_cert_file") = py::none(),
           py::arg("tls_key_file") = py::none(),
           py::arg("tls_server_name") = py::none(),
           py::arg("connect_deadline") = py::none(), py::arg("doorbell") = true)
      .def_property_readonly("address", &Client::address)
      .def(
          "device_counts",
          [](Client& c) {
            absl::StatusOr<std::vector<int>> n;
            {
              py::gil_scoped_release release;
              n = c.DeviceCounts();
            }
            if (!n.ok()) Throw(n.status());
            return *n;
          },
          "Each daemon's healthy executors (at least 1) from its Status RPC: "
          "one entry, or a pool's in address order (plan_pool's "
          "devices_per_daemon).")
      .def("open_session", &OpenSession, py::arg("job_id"), py::arg("params"),
           py::arg("groups") = py::none(), py::arg("rank") = 0,
           py::arg("world_size") = 1, py::arg("transport") = "auto",
           py::arg("cuda_ipc") = py::none(), py::arg("pool_owner") = py::none(),
           py::arg("resume") = "auto",
           "Opens a session of job `job_id` as `rank` of `world_size` with "
           "the parameter table `params` (each (name, rows, cols) or a dict "
           "with name, rows, cols, "
           "sharding='replicated'|'rows'|'unreduced'|'blocks', row_begin, "
           "row_end (rows), row_runs=[(begin, end), ...], col_runs=[...] "
           "(blocks: this rank's local tensor is those rows by those columns, "
           "row-major; both empty: it holds nothing; needs a daemon of "
           "protocol 1.3), forward_order, group, layer: matrices the next "
           "forward needs together share a layer >= 0, which the planner "
           "spreads over devices) and the Muon groups "
           "(dicts: momentum, nesterov, ns_steps, schedule, coefficients, "
           "method, adjust_lr_fn, eps). transport: 'auto' (shm on this host, "
           "else inline; never a GPU transport), 'shm', 'inline', 'cuda_ipc' "
           "(with cuda_ipc=dict(mem_handle=bytes, offset=int, bytes=int, "
           "event_handle=bytes, device_uuid=bytes): the exported GPU region "
           "laid out by region_layout(params)) or 'nccl' (then join "
           "Session.nccl()'s communicator). pool_owner (a pool only): the "
           "daemon of each parameter, e.g. plan_pool()'s, used as is; None: "
           "the pool plans from its daemons' device_counts(). resume: what "
           "the job's existing momentum must be (docs/protocol.md "
           "\"Resume\"): 'auto' (continue it if any, else start), 'fresh' "
           "(start at step 1; ALREADY_EXISTS if the job has completed a "
           "step), 'continue' (NOT_FOUND if it has not) or 'replace' "
           "(discard it and start at step 1); all but 'auto' need dmuond of "
           "protocol 1.1 or newer. An int N >= 1: continue from exactly "
           "completed step N (the trainer's checkpoint's), which dmuond holds "
           "for the step the job is at and, with --state-dir, the previous "
           "snapshotted step; FAILED_PRECONDITION naming the steps it holds "
           "otherwise (protocol 1.4).");
}

// Session: what it is (names, layout, nccl, ...) and its memory (views).
void AddSessionInfo(py::class_<PySession>& cls) {
  cls.def("__len__", &PySession::size)
      .def_property_readonly("names", &PySession::names)
      .def_property_readonly("step", [](PySession& s) { return s.s().step(); })
      .def_property_readonly("transport",
                             [](PySession& s) { return s.s().transport(); })
      .def_property_readonly(
          "doorbell", [](PySession& s) { return s.s().doorbell(); },
          "Whether this session declares gradients and learns of updates "
          "through the shm segment's doorbell (docs/protocol.md) rather than "
          "messages on the Step stream.")
      .def_property_readonly(
          "notice", [](PySession& s) { return s.s().notice(); },
          "Empty, or what dmuond said at open that is not an error: the job "
          "starts from zero momentum although a snapshot of its id was "
          "found, which could not be used and was moved aside (where to).")
      .def_property_readonly(
          "not_durable", [](PySession& s) { return s.s().not_durable(); },
          "Empty, or why the step finish_step() last completed is not "
          "durable: dmuond's --snapshot-every snapshot of it could not be "
          "written, so a restarted dmuond would resume from an older step.")
      .def_property_readonly(
          "region_released",
          [](PySession& s) { return s.s().region_released(); },
          "After close(): whether dmuond confirmed it released the "
          "session's region (no computation uses it, its mapping is "
          "closed). A cuda_ipc client frees the GPU memory it exported only "
          "then.")
      .def(
          "layout", [](PySession& s) { return LayoutToDict(s.s().layout()); },
          "The region layout the daemon answered (as region_layout()).")
      .def(
          "nccl",
          [](PySession& s) {
            const NcclInfo& n = s.s().nccl();
            py::dict d;
            d["unique_id"] = py::bytes(n.unique_id);
            d["nranks"] = n.nranks;
            d["daemon_rank"] = n.daemon_rank;
            return d;
          },
          "transport 'nccl': dict(unique_id=bytes (ncclUniqueId), nranks, "
          "daemon_rank); this rank joins as NCCL rank `rank`. Otherwise "
          "nranks is 0.")
      .def(
          "next_announced",
          [](PySession& s) {
            absl::StatusOr<std::vector<int>> ids;
            {
              py::gil_scoped_release release;
              ids = s.s().NextAnnounced();
            }
            if (!ids.ok()) Throw(ids.status());
            return *ids;
          },
          "The parameter ids of the current step's next UpdatesReady "
          "message, in arrival order, each message once; blocks up to the "
          "deadline; [] once every update of the step has been returned. "
          "nccl: post one ncclRecv group per list, in this order, after "
          "declaring every gradient of the step.");
}

// Session: the step protocol, state and closing; blocking calls release the
// GIL.
// A session's step: its tensors, declarations, updates and rewind.
void AddSessionCalls(py::class_<PySession>& cls) {
  cls.def("local_shape", &PySession::local_shape, py::arg("i"))
      .def(
          "gradient",
          [](py::object self, int i) { return View(self, i, true, true); },
          py::arg("i"),
          "Where parameter i's gradient goes (this rank's rows), a writable "
          "float32 numpy view over the session's memory.")
      .def(
          "update",
          [](py::object self, int i, bool writable) {
            return View(self, i, false, writable);
          },
          py::arg("i"), py::arg("writable") = false,
          "Parameter i's update lr_scale * NS(momentum step), valid after "
          "wait_update(i) until the next step's update lands.")
      .def(
          "gradient_ready",
          [](PySession& s, int i) {
            s.param(i);
            Released([&] { return s.s().GradientReady(i); });
          },
          py::arg("i"))
      .def(
          "gradients_ready",
          [](PySession& s, std::vector<int> ids,
             std::optional<std::vector<double>> momentum) {
            Released([&] {
              return momentum ? s.s().GradientsReadyWithMomentum(ids, *momentum)
                              : s.s().GradientsReady(ids);
            });
          },
          py::arg("ids"), py::arg("momentum") = py::none(),
          "Declares the gradients of `ids` ready. momentum: None, or this "
          "step's momentum (beta) for each of `ids` (same order) instead of "
          "its group's, as torch's OneCycleLR/CyclicLR with "
          "cycle_momentum=True set it (protocol minor 2: an older dmuond is "
          "refused, naming its version).")
      .def(
          "gradients_absent",
          [](PySession& s, std::vector<int> ids) {
            for (int i : ids) s.param(i);
            Released([&] { return s.s().GradientsAbsent(ids); });
          },
          py::arg("ids"),
          "Declares parameters with no gradient this step (torch: .grad is "
          "None; protocol minor 1): dmuond computes nothing for them and "
          "leaves their momentum untouched; wait_update(i) returns at once "
          "and absent(i) is True.")
      .def(
          "wait_update",
          [](PySession& s, int i) {
            s.param(i);
            Released([&] { return s.s().WaitUpdate(i); });
          },
          py::arg("i"))
      .def(
          "try_update", [](PySession& s, int i) { return s.s().TryUpdate(i); },
          py::arg("i"))
      .def(
          "update_received_ns",
          [](PySession& s, int i) { return s.s().update_received_ns(i); },
          py::arg("i"),
          "When the session saw update i of the current step: read off the "
          "stream, or with the doorbell taken from it by the first wait or "
          "try_update after it landed (time.monotonic_ns()'s clock, "
          "CLOCK_MONOTONIC); 0 before that.")
      .def(
          "skipped", [](PySession& s, int i) { return s.s().skipped(i); },
          py::arg("i"))
      .def(
          "absent", [](PySession& s, int i) { return s.s().absent(i); },
          py::arg("i"))
      .def("finish_step",
           [](PySession& s) { Released([&] { return s.s().FinishStep(); }); })
      .def(
          "rewind",
          [](PySession& s) { Released([&] { return s.s().Rewind(); }); },
          "Undoes the step finish_step() just completed (protocol minor 1): "
          "dmuond puts the momentum back to before it and step goes back by "
          "one, so its gradients can be declared again.");
}

// A session's state (GetState/SetState) and its closing.
void AddSessionStateCalls(py::class_<PySession>& cls) {
  cls.def("get_state",
          [](PySession& s) {
            absl::StatusOr<State> st;
            {
              py::gil_scoped_release release;
              st = s.s().GetState();
            }
            if (!st.ok()) Throw(st.status());
            return StateToDict(*st);
          })
      .def(
          "set_state",
          [](PySession& s, const py::dict& d) {
            State state = DictToState(d);
            Released([&] { return s.s().SetState(state); });
          },
          py::arg("state"))
      .def(
          "mark",
          [](PySession& s, int64_t step) {
            absl::StatusOr<MarkInfo> m;
            {
              py::gil_scoped_release release;
              m = s.s().Mark(step);
            }
            if (!m.ok()) Throw(m.status());
            py::dict d;
            d["step"] = m->step;
            d["marks"] = m->marks;
            d["mark_bytes"] = m->mark_bytes;
            d["not_durable"] = m->not_durable;
            return d;
          },
          py::arg("step") = 0,
          "Asks dmuond to keep the momentum of the job's completed step "
          "`step` (0: the step the job is at) as a mark, so that a later "
          "open_session(resume=step), at any world size, continues from "
          "exactly it (protocol 1.5). Between steps. Returns dict(step, "
          "marks=[the job's marked steps, oldest first], mark_bytes, "
          "not_durable='' or why the mark is not on disk). "
          "FailedPreconditionError naming the job's step for another step, "
          "or naming both versions on a daemon older than protocol 1.5.")
      .def_property_readonly(
          "protocol_minor",
          [](PySession& s) { return s.s().daemon_protocol_minor(); },
          "The protocol minor of the dmuond that opened this session (a "
          "pool's: its oldest); mark() needs 5.")
      .def("close",
           [](PySession& s) { Released([&] { return s.s().Close(); }); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PySession& s, py::args) {
        py::gil_scoped_release release;
        (void)s.s().Close();
      });
}

}  // namespace

void RegisterClient(py::module_& m) {
  RegisterLayoutAndPlan(m);
  RegisterClientClass(m);
  py::class_<PySession> session(
      m, "Session", "One rank's session of a job (see Client.open_session).");
  AddSessionInfo(session);
  AddSessionCalls(session);
  AddStepCalls(session);
  AddSessionStateCalls(session);
}

}  // namespace dmuon::python
