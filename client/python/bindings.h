// The pieces of the _dmuon Python extension (client/python/module.cc).

#ifndef DMUON_CLIENT_PYTHON_BINDINGS_H_
#define DMUON_CLIENT_PYTHON_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <string>

#include "absl/status/status.h"

namespace dmuon::python {

// Exception classes, one per family of absl::StatusCode, all subclasses of
// _dmuon.Error (itself a RuntimeError) with a `code` attribute naming the
// status code ("UNAVAILABLE", ...):
//   InvalidArgumentError (also a ValueError)     INVALID_ARGUMENT, OUT_OF_RANGE
//   UnavailableError (also a ConnectionError)    UNAVAILABLE
//   DeadlineExceededError (also a TimeoutError)  DEADLINE_EXCEEDED
//   FailedPreconditionError                      FAILED_PRECONDITION, ABORTED
void RegisterErrors(pybind11::module_& m);

// Throws a C++ exception that the registered translator turns into the
// Python exception for `status` (which must not be OK), message unchanged.
[[noreturn]] void Throw(const absl::Status& status);

// orthogonalize(): the kernels library on numpy arrays.
void RegisterKernels(pybind11::module_& m);

// The request of a C-contiguous buffer (a numpy array, a memoryview);
// InvalidArgumentError "<what> is not C-contiguous" for another.
pybind11::buffer_info Contiguous(const pybind11::buffer& b,
                                 const std::string& what);

// same_bytes(): host buffers compared bit for bit (the hand-off's edit check).
void RegisterBuffers(pybind11::module_& m);

// apply_update(): a Muon update applied by torch's in-place ops, whole
// (DMuon's apply).
void RegisterUpdates(pybind11::module_& m);

// Client and Session: the C++ client library.
void RegisterClient(pybind11::module_& m);

// ReleaseGate and NcclOrder: the GPU transports' rules (client/cuda/),
// which dmuon/_gpu.py drives with torch's CUDA and NCCL.
void RegisterGpu(pybind11::module_& m);

}  // namespace dmuon::python

#endif  // DMUON_CLIENT_PYTHON_BINDINGS_H_
