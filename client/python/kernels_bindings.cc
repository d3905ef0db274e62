// orthogonalize(): the kernels library's Newton–Schulz on numpy arrays.

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/bindings.h"
#include "kernels/kernels.h"

namespace py = pybind11;

namespace dmuon::python {
namespace {

// coefficients: None (classic), a schedule name, one (a, b, c) triple used
// for every step (torch.optim.Muon's ns_coefficients), or a list of triples
// per step (a list shorter than `steps` repeats its last triple; a longer one
// is cut at `steps`).
kernels::Schedule ScheduleOf(const py::object& coefficients, int steps) {
  if (steps <= 0) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("steps must be positive, got ", steps)));
  }
  absl::StatusOr<kernels::Schedule> s;
  if (coefficients.is_none()) {
    s = kernels::ClassicSchedule(steps);
  } else if (py::isinstance<py::str>(coefficients)) {
    s = kernels::ScheduleByName(coefficients.cast<std::string>(), steps);
  } else {
    std::vector<kernels::StepCoefficients> list;
    auto triple = [](const py::handle& h) {
      auto v = h.cast<std::vector<double>>();
      if (v.size() != 3) {
        Throw(absl::InvalidArgumentError(
            absl::StrCat("coefficients: expected (a, b, c) triples, got ",
                         v.size(), " numbers")));
      }
      return kernels::StepCoefficients{v[0], v[1], v[2]};
    };
    py::sequence seq = coefficients.cast<py::sequence>();
    if (seq.size() == 3 && !py::isinstance<py::sequence>(seq[0])) {
      list.assign(steps, triple(coefficients));
    } else {
      for (const auto& h : seq) list.push_back(triple(h));
      if (list.empty()) {
        Throw(absl::InvalidArgumentError("coefficients: the list is empty"));
      }
      list.resize(steps, list.back());
    }
    s = kernels::CustomSchedule(std::move(list));
  }
  if (!s.ok()) Throw(absl::InvalidArgumentError(s.status().message()));
  return *s;
}

template <typename T>
py::array Run(py::array input, const kernels::NsOptions& options) {
  auto in =
      py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(input);
  if (!in) throw py::error_already_set();
  const bool batched = in.ndim() == 3;
  const int64_t batch = batched ? in.shape(0) : 1;
  const kernels::Shape shape{in.shape(batched ? 1 : 0),
                             in.shape(batched ? 2 : 1)};
  std::vector<py::ssize_t> dims(in.shape(), in.shape() + in.ndim());
  py::array_t<T> out(dims);
  const T* src = in.data();
  T* dst = out.mutable_data();
  absl::Status st;
  {
    py::gil_scoped_release release;
    const int64_t n = shape.elements();
    std::vector<kernels::MatrixRef<const T>> ins;
    std::vector<kernels::MatrixRef<T>> outs;
    for (int64_t b = 0; b < batch; ++b) {
      ins.push_back({shape, absl::MakeConstSpan(src + b * n, n)});
      outs.push_back({shape, absl::MakeSpan(dst + b * n, n)});
    }
    st = batched ? kernels::OrthogonalizeBatch(ins, outs, options)
                 : kernels::Orthogonalize(ins[0], outs[0], options);
  }
  if (!st.ok()) Throw(absl::InvalidArgumentError(st.message()));
  return std::move(out);
}

py::array Orthogonalize(py::array input, int steps, py::object coefficients,
                        const std::string& method, double eps) {
  if (input.ndim() != 2 && input.ndim() != 3) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("orthogonalize: expected a 2-D matrix or a 3-D batch of "
                     "matrices, got ",
                     input.ndim(), " dimensions")));
  }
  kernels::NsOptions options;
  options.schedule = ScheduleOf(coefficients, steps);
  options.eps = eps;
  auto m = kernels::ParseMethod(method);
  if (!m.ok()) Throw(absl::InvalidArgumentError(m.status().message()));
  options.method = *m;
  if (auto st = kernels::ValidateOptions(options); !st.ok()) {
    Throw(absl::InvalidArgumentError(st.message()));
  }
  if (py::isinstance<py::array_t<float>>(input))
    return Run<float>(input, options);
  if (py::isinstance<py::array_t<double>>(input))
    return Run<double>(input, options);
  Throw(absl::InvalidArgumentError(
      absl::StrCat("orthogonalize: expected float32 or float64, got ",
                   py::str(input.dtype()).cast<std::string>())));
}

}  // namespace

void RegisterKernels(py::module_& m) {
  m.def("orthogonalize", &Orthogonalize, py::arg("array"), py::arg("steps") = 5,
        py::arg("coefficients") = py::none(), py::arg("method") = "auto",
        py::arg("eps") = 1e-7,
        R"(Approximate polar factor of a matrix (2-D) or of each matrix of a
batch (3-D) by Newton-Schulz, as Muon uses it. Returns a new array of the
input's shape and dtype (float32 or float64).

coefficients: None ("classic": 3.4445, -4.7750, 2.0315), "classic",
  "polar_express", "you", one (a, b, c) triple for every step, or a list of
  per-step triples (the last repeats when shorter than `steps`).
method: "auto" (the cost model picks), "direct" or "gram".
Errors (bad shapes, non-finite input, bad options) raise ValueError.)");
}

}  // namespace dmuon::python
