// PySession, the Python Session's C++ object, and the helpers its bindings
// share (client_bindings.cc, step_bindings.cc). Internal to the _dmuon
// extension.

#ifndef DMUON_CLIENT_PYTHON_PY_SESSION_H_
#define DMUON_CLIENT_PYTHON_PY_SESSION_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/python/bindings.h"

namespace dmuon::python {

// A session and its table (names and this rank's shapes), as Python sees it.
class PySession {
 public:
  PySession(std::unique_ptr<Session> s, std::vector<ParamSpec> params)
      : s_(std::move(s)), params_(std::move(params)) {}

  Session& s() { return *s_; }
  int size() const { return static_cast<int>(params_.size()); }
  const ParamSpec& param(int i) const {
    if (i < 0 || i >= size()) {
      throw pybind11::index_error(
          absl::StrCat("parameter index ", i, " is outside [0, ", size(), ")"));
    }
    return params_[i];
  }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& p : params_) n.push_back(p.name);
    return n;
  }
  // This rank's view: its rows for a row-sharded parameter, its runs'
  // lengths for a blocks one (0x0 when it holds nothing).
  std::pair<int64_t, int64_t> local_shape(int i) const {
    const ParamSpec& p = param(i);
    if (p.sharding == Sharding::kBlocks) {
      int64_t rows = 0, cols = 0;
      for (const auto& [b, e] : p.row_runs) rows += e - b;
      for (const auto& [b, e] : p.col_runs) cols += e - b;
      return {rows, cols};
    }
    return {p.sharding == Sharding::kRows ? p.row_end - p.row_begin : p.rows,
            p.cols};
  }

 private:
  std::unique_ptr<Session> s_;
  std::vector<ParamSpec> params_;
};

// Raises `st` (not OK) as its Python exception (bindings.h Throw).
inline void Check(const absl::Status& st) {
  if (!st.ok()) Throw(st);
}

// Runs `call` (returning an absl::Status) without the GIL, then raises its
// error as Check does.
template <typename F>
void Released(F&& call) {
  absl::Status st;
  {
    pybind11::gil_scoped_release release;
    st = call();
  }
  Check(st);
}

// Session.hand_off (step_bindings.cc).
void AddStepCalls(pybind11::class_<PySession>& cls);

}  // namespace dmuon::python

#endif  // DMUON_CLIENT_PYTHON_PY_SESSION_H_
