// The GPU transports' rules for Python trainers (dmuon/_gpu.py), bound from
// the C++ client's own plain-C++ logic so that one implementation, tested
// once (client/cuda/*_test.cc, tests/gpu_transport_test.cc), serves both
// the C++ trainers (client/cuda/) and the Python ones:
//   ReleaseGate (client/cuda/release_gate.h): when exported cuda_ipc memory
//     may be freed;
//   NcclOrder (client/cuda/nccl_order.h): which NCCL groups a trainer rank
//     posts, in what order (the warm-up, one send group per hand-over, one
//     receive group per announcement, empty slots left out).
// The CUDA and NCCL calls themselves stay in Python (ctypes on torch's own
// libraries), so the extension links neither: NcclOrder calls back into
// Python with each group's transfers.

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/cuda/nccl_order.h"
#include "client/cuda/release_gate.h"
#include "client/python/bindings.h"

namespace py = pybind11;

namespace dmuon::python {
namespace {

// An absl::Status of the code named `code` ("DEADLINE_EXCEEDED", as
// _dmuon.Error.code carries it); an unknown name is INVALID_ARGUMENT.
absl::Status StatusNamed(const std::string& code, const std::string& message) {
  for (int c = 0; c <= static_cast<int>(absl::StatusCode::kUnauthenticated);
       ++c) {
    const auto sc = static_cast<absl::StatusCode>(c);
    if (absl::StatusCodeToString(sc) == code) return absl::Status(sc, message);
  }
  Throw(absl::InvalidArgumentError(
      absl::StrCat("ReleaseGate.open_failed: '", code,
                   "' is not a status code name (e.g. 'DEADLINE_EXCEEDED')")));
}

// The layout dict of region_layout() as the C++ RegionLayout.
RegionLayout LayoutFromDict(const py::dict& d) {
  RegionLayout l;
  l.total_bytes = d["total_bytes"].cast<uint64_t>();
  for (const auto& h : d["slots"].cast<py::list>()) {
    const auto s = h.cast<py::dict>();
    RegionSlot slot;
    slot.rows = s["rows"].cast<int64_t>();
    slot.cols = s["cols"].cast<int64_t>();
    slot.gradient_offset = s["gradient_offset"].cast<uint64_t>();
    slot.update_offset = s["update_offset"].cast<uint64_t>();
    // Each tensor's bytes follow from its shape (client.h RegionSlot).
    if (slot.rows < 0 || slot.cols < 0) {
      Throw(absl::InvalidArgumentError(
          absl::StrCat("layout slot ", l.slots.size(), " has a negative shape ",
                       slot.rows, "x", slot.cols)));
    }
    slot.bytes = static_cast<uint64_t>(slot.rows * slot.cols) * 4;
    if (s.contains("bytes") && s["bytes"].cast<uint64_t>() != slot.bytes) {
      Throw(absl::InvalidArgumentError(
          absl::StrCat("layout slot ", l.slots.size(), ": bytes ",
                       s["bytes"].cast<uint64_t>(),
                       " is not rows x cols x 4 = ", slot.bytes)));
    }
    l.slots.push_back(slot);
  }
  return l;
}

// NcclGroups over a Python callable group(transfers, stream): transfers a
// list of (send: bool, peer: int, address: int, count: int fp32), stream a
// cudaStream_t as an int. A Python exception in it propagates unchanged.
class PyGroups final : public gpu::NcclGroups {
 public:
  explicit PyGroups(py::function group) : group_(std::move(group)) {}
  absl::Status Group(const std::vector<transport::NcclTransfer>& transfers,
                     void* stream) override {
    py::list ops;
    for (const auto& t : transfers) {
      const auto address = reinterpret_cast<uintptr_t>(t.base) + t.offset;
      ops.append(py::make_tuple(t.send, t.peer, address, t.bytes / 4));
    }
    group_(ops, reinterpret_cast<uintptr_t>(stream));
    return absl::OkStatus();
  }

 private:
  py::function group_;
};

// NcclOrder with its Python communicator and its region's layout.
class PyNcclOrder {
 public:
  PyNcclOrder(py::function group, int daemon_rank, const py::dict& layout)
      : groups_(std::move(group)),
        order_(groups_, daemon_rank),
        layout_(LayoutFromDict(layout)) {}

  void WarmUp(uintptr_t scratch, uintptr_t stream) {
    Check(order_.WarmUp(Ptr(scratch), reinterpret_cast<void*>(stream)));
  }
  void Send(uintptr_t base, const std::vector<int>& ids, uintptr_t stream) {
    Check(order_.SendGradients(layout_, Ptr(base), ids,
                               reinterpret_cast<void*>(stream)));
  }
  void Receive(uintptr_t base, const std::vector<int>& ids, uintptr_t stream) {
    Check(order_.ReceiveUpdates(layout_, Ptr(base), ids,
                                reinterpret_cast<void*>(stream)));
  }

 private:
  static std::byte* Ptr(uintptr_t p) { return reinterpret_cast<std::byte*>(p); }
  static void Check(const absl::Status& st) {
    if (!st.ok()) Throw(st);
  }
  PyGroups groups_;
  gpu::NcclOrder order_;
  const RegionLayout layout_;
};

void RegisterReleaseGate(py::module_& m) {
  py::class_<gpu::ReleaseGate>(
      m, "ReleaseGate",
      "When exported cuda_ipc memory may be freed (client/cuda/"
      "release_gate.h): only once the daemon confirmed it released the "
      "session's region, or when it never mapped it.")
      .def(py::init<>())
      .def("exported", &gpu::ReleaseGate::Exported,
           "The memory is about to be exported (before open_session).")
      .def(
          "open_failed",
          [](gpu::ReleaseGate& g, const std::optional<std::string>& code) {
            // None: the call failed in this process, before any request.
            g.OpenFailed(code ? StatusNamed(*code, "open_session failed")
                              : absl::InternalError("failed before a request"));
          },
          py::arg("code"),
          "open_session failed with the status code named `code` "
          "(_dmuon.Error.code; None: before any request reached a daemon). "
          "DEADLINE_EXCEEDED, CANCELLED and UNKNOWN leave it open whether "
          "the daemon mapped the memory: it stays held.")
      .def("opened", &gpu::ReleaseGate::Opened,
           "A session over the memory opened.")
      .def("closed", &gpu::ReleaseGate::Closed, py::arg("released"),
           "The session was closed; `released`: the daemon confirmed it "
           "released the region (Session.region_released).")
      .def_property_readonly("may_free", &gpu::ReleaseGate::may_free)
      .def_property_readonly("why_not", &gpu::ReleaseGate::why_not);
}

void RegisterNcclOrder(py::module_& m) {
  py::class_<PyNcclOrder>(
      m, "NcclOrder",
      "A trainer rank's NCCL groups in the protocol's order (client/cuda/"
      "nccl_order.h, transport/nccl.h): group(transfers, stream) posts one "
      "ncclGroupStart/End group of (send, peer, address, count) fp32 "
      "transfers on `stream`; the region is `layout` (region_layout()).")
      .def(py::init<py::function, int, const py::dict&>(), py::arg("group"),
           py::arg("daemon_rank"), py::arg("layout"))
      .def("warm_up", &PyNcclOrder::WarmUp, py::arg("scratch"),
           py::arg("stream"),
           "The communicator's first group: one fp32 sent from scratch, one "
           "received into scratch + 4 (8 bytes of device memory).")
      .def("send_gradients", &PyNcclOrder::Send, py::arg("base"),
           py::arg("ids"), py::arg("stream"),
           "One group of sends of `ids`' gradient slots of the region at "
           "`base`, in order; empty slots move nothing.")
      .def("receive_updates", &PyNcclOrder::Receive, py::arg("base"),
           py::arg("ids"), py::arg("stream"),
           "One group of receives of `ids`' update slots, in order.");
}

}  // namespace

void RegisterGpu(py::module_& m) {
  RegisterReleaseGate(m);
  RegisterNcclOrder(m);
}

}  // namespace dmuon::python
