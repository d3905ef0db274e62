// The per-matrix calls of a training step's hot path, which DMuon makes
// from backward's hooks and the forward's pre-hooks (dmuon/_handoff.py):
// Session.hand_off (a gradient copied in and declared, one call) and
// apply_update() (an update written by torch's in-place ops with no Python
// code between them).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/bindings.h"
#include "client/python/py_session.h"

namespace py = pybind11;

namespace dmuon::python {
namespace {

// torch.optim.Muon's update of a parameter, in its order and with its ops
// (the same bits): p.mul_(decay) when decay is given, then p.add_(u,
// alpha=alpha); then applied[i] = True. `p` is the parameter's detached
// alias (in-place ops on it bump the parameter's version counter), `u` a
// tensor of p's shape, dtype and device.
//
// Why native: the three must happen together or not at all. A Ctrl-C
// raises KeyboardInterrupt only between Python bytecodes, and none runs
// here (torch's methods are C functions called through the C API), so
// the interrupt lands before the first or after the last: what a
// deferred_sigint around three Python statements guarantees, without its
// two signal-handler swaps, which cost about 14 µs a matrix in the
// trainer's hooks (issue 25).
void ApplyUpdate(const py::object& p, const py::object& u,
                 std::optional<double> decay, double alpha,
                 const py::list& applied, int i) {
  if (i < 0 || i >= static_cast<int>(applied.size())) {
    throw py::index_error("apply_update: index outside `applied`");
  }
  if (decay) p.attr("mul_")(*decay);
  p.attr("add_")(u, py::arg("alpha") = alpha);
  applied[i] = py::bool_(true);
}

// Session.hand_off: checks `grad` (naming the parameter) before anything
// is written, then Session::HandOff without the GIL; marks handed[i].
int64_t HandOff(PySession& s, int i, const py::buffer& grad,
                std::optional<double> momentum,
                std::optional<py::list> handed) {
  const ParamSpec& p = s.param(i);
  const py::buffer_info g =
      Contiguous(grad, absl::StrCat("hand_off: ", p.name, "'s gradient"));
  if (g.format != py::format_descriptor<float>::format()) {
    Throw(absl::InvalidArgumentError(absl::StrCat("hand_off: ", p.name,
                                                  "'s gradient is of format '",
                                                  g.format, "', not float32")));
  }
  const absl::Span<const float> data(static_cast<const float*>(g.ptr),
                                     static_cast<size_t>(g.size));
  const std::string t = s.s().transport();
  if (const size_t want = s.s().gradient(i).size();
      data.size() != want && t != "cuda_ipc" && t != "nccl") {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("hand_off: ", p.name, "'s gradient has ", data.size(),
                     " elements; its buffer on this rank holds ", want)));
  }
  if (handed && static_cast<int>(handed->size()) <= i) {
    throw py::index_error("hand_off: index outside `handed`");
  }
  std::vector<double> beta;
  if (momentum) beta.push_back(*momentum);
  int64_t copied_ns = 0;
  Released([&] { return s.s().HandOff(i, data, beta, &copied_ns); });
  if (handed) (*handed)[i] = py::bool_(true);
  return copied_ns;
}

}  // namespace

void AddStepCalls(py::class_<PySession>& cls) {
  cls.def("hand_off", &HandOff, py::arg("i"), py::arg("grad"),
          py::arg("momentum") = py::none(), py::arg("handed") = py::none(),
          "Copies parameter i's gradient (a C-contiguous float32 buffer of "
          "this rank's rows, e.g. a CPU tensor's .numpy()) into the "
          "session's memory and declares it ready, with this step's momentum "
          "if given (as gradients_ready): a host hand-off in one call, the "
          "GIL released. handed: a list whose [i] is set True once it is "
          "declared, in the same call (no Python code runs between the two, "
          "so a Ctrl-C lands before both or after both). A buffer of another "
          "size or format, or a GPU transport's session, is an error before "
          "anything is written. Returns when the copy was done and the "
          "declaration began (time.monotonic_ns()'s clock), for the step "
          "timeline.");
}

void RegisterUpdates(py::module_& m) {
  m.def("apply_update", &ApplyUpdate, py::arg("p"), py::arg("u"),
        py::arg("decay"), py::arg("alpha"), py::arg("applied"), py::arg("i"),
        "p.mul_(decay) (unless decay is None), p.add_(u, alpha=alpha), "
        "applied[i] = True, with no Python code in between: a "
        "KeyboardInterrupt comes before all or after all. p: the parameter "
        "detached (its version counter moves); u: its update, same shape, "
        "dtype and device.");
}

}  // namespace dmuon::python
