// Status -> Python exception translation for the _dmuon extension.

#include <Python.h>

#include <exception>
#include <string>

#include "absl/status/status.h"
#include "client/python/bindings.h"

namespace py = pybind11;

namespace dmuon::python {
namespace {

// Carries a Status from the binding code to the exception translator.
class StatusException : public std::exception {
 public:
  explicit StatusException(absl::Status s)
      : status_(std::move(s)), what_(status_.message()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

// Owned references, kept for the life of the process (never decremented, so
// nothing is torn down in the wrong order at interpreter exit).
PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_unavailable = nullptr;
PyObject* g_deadline = nullptr;
PyObject* g_precondition = nullptr;

PyObject* NewType(py::module_& m, const char* name, PyObject* bases,
                  const char* doc) {
  const std::string qualified = std::string("dmuon._dmuon.") + name;
  PyObject* t =
      PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (t == nullptr) throw py::error_already_set();
  Py_INCREF(t);  // one reference for the module attribute
  if (PyModule_AddObject(m.ptr(), name, t) != 0) throw py::error_already_set();
  return t;
}

PyObject* Bases(PyObject* a, PyObject* b) { return PyTuple_Pack(2, a, b); }

PyObject* TypeFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return g_invalid;
    case absl::StatusCode::kUnavailable:
      return g_unavailable;
    case absl::StatusCode::kDeadlineExceeded:
      return g_deadline;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
      return g_precondition;
    default:
      return g_error;
  }
}

}  // namespace

void RegisterErrors(py::module_& m) {
  g_error = NewType(m, "Error", PyExc_RuntimeError,
                    "An error from dmuon (dmuond, the client or the kernels); "
                    "`code` names the status code.");
  g_invalid =
      NewType(m, "InvalidArgumentError", Bases(g_error, PyExc_ValueError),
              "INVALID_ARGUMENT or OUT_OF_RANGE.");
  g_unavailable =
      NewType(m, "UnavailableError", Bases(g_error, PyExc_ConnectionError),
              "UNAVAILABLE: dmuond is not reachable or went away.");
  g_deadline =
      NewType(m, "DeadlineExceededError", Bases(g_error, PyExc_TimeoutError),
              "DEADLINE_EXCEEDED: no answer within the deadline.");
  g_precondition =
      NewType(m, "FailedPreconditionError", Bases(g_error, PyExc_RuntimeError),
              "FAILED_PRECONDITION or ABORTED.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      PyObject* type = TypeFor(e.status().code());
      py::object exc = py::reinterpret_borrow<py::object>(type)(
          std::string(e.status().message()));
      exc.attr("code") = absl::StatusCodeToString(e.status().code());
      PyErr_SetObject(type, exc.ptr());
    }
  });
}

void Throw(const absl::Status& status) { throw StatusException(status); }

}  // namespace dmuon::python
