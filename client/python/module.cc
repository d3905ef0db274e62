// The _dmuon Python extension: orthogonalize() over the kernels library and
// Client/Session over the C++ client, and the GPU transports' rules. The dmuon
// package (dmuon/) wraps it.

#include <pybind11/pybind11.h>

#include "base/protocol.h"
#include "client/python/bindings.h"

PYBIND11_MODULE(_dmuon, m) {
  m.doc() = "dmuon's native extension (use the dmuon package).";
  m.attr("__version__") = dmuon::kDmuonVersion;  // the build's, one place
  dmuon::python::RegisterErrors(m);
  dmuon::python::RegisterKernels(m);
  dmuon::python::RegisterBuffers(m);
  dmuon::python::RegisterUpdates(m);
  dmuon::python::RegisterClient(m);
  dmuon::python::RegisterGpu(m);
}
