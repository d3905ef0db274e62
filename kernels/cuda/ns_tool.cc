// ns_tool: Newton–Schulz of a raw fp32 file on the GPU, for device checks.
//
//   ns_tool --rows R --cols C [--batch B] --in FILE --out FILE
//           [--method direct|gram|auto] [--dtype bf16|fp16|f32]
//           [--io_dtype f32|bf16|fp16] [--steps N]
//           [--schedule classic|polar_express|you] [--restart K]
//           [--symmetric 0|1] [--graphs 0|1] [--repeat N] [--device D]
//
// FILE holds batch x rows x cols little-endian fp32 values, row-major. The
// input is uploaded as --io_dtype (default f32), orthogonalized with
// products in --dtype (default bf16; Gram, asked or chosen by auto, computes
// in fp16 when bf16 is asked: CudaNsOptions::compute), and the output
// downloaded and written as fp32. With --repeat N > 1 the call is timed N more
// times (after the first) and the median per call printed. Exit status 0 on
// success, 1 on any error (with the message on stderr), 2 for bad usage.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/resolve_logic.h"
#include "kernels/kernels.h"

namespace {

namespace cu = dmuon::kernels::cuda;
namespace k = dmuon::kernels;

int Usage(const char* why) {
  std::fprintf(stderr,
               "ns_tool: %s\nusage: ns_tool --rows R --cols C [--batch B] "
               "--in FILE --out FILE [--method direct|gram|auto] "
               "[--dtype bf16|fp16|f32] [--io_dtype f32|bf16|fp16] "
               "[--steps N] [--schedule classic|polar_express|you] "
               "[--restart K] [--symmetric 0|1] [--graphs 0|1] [--repeat N] "
               "[--device D]\n",
               why);
  return 2;
}

bool ParseDType(const std::string& s, cu::DType* t) {
  if (s == "bf16") {
    *t = cu::DType::kBF16;
  } else if (s == "fp16" || s == "f16") {
    *t = cu::DType::kF16;
  } else if (s == "f32" || s == "fp32") {
    *t = cu::DType::kF32;
  } else {
    return false;
  }
  return true;
}

bool ParseInt(const std::string& s, long long* v) {
  char* end = nullptr;
  *v = std::strtoll(s.c_str(), &end, 10);
  return !s.empty() && end != nullptr && *end == '\0';
}

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "ns_tool: %s: %s\n", what.c_str(),
               st.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"batch", "1"},      {"method", "direct"}, {"dtype", "bf16"},
      {"io_dtype", "f32"}, {"steps", "5"},       {"schedule", "classic"},
      {"restart", "2"},    {"symmetric", "1"},   {"graphs", "1"},
      {"repeat", "1"},     {"device", "0"},      {"rows", ""},
      {"cols", ""},        {"in", ""},           {"out", ""}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0)
      return Usage(("unexpected argument " + a).c_str());
    a = a.substr(2);
    std::string value;
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Usage(("missing value for --" + a).c_str());
    }
    if (flags.count(a) == 0) return Usage(("unknown flag --" + a).c_str());
    flags[a] = value;
  }
  long long rows = 0, cols = 0, batch = 0, steps = 0, restart = 0, repeat = 0,
            device = 0;
  if (!ParseInt(flags["rows"], &rows) || !ParseInt(flags["cols"], &cols) ||
      !ParseInt(flags["batch"], &batch) || !ParseInt(flags["steps"], &steps) ||
      !ParseInt(flags["restart"], &restart) ||
      !ParseInt(flags["repeat"], &repeat) ||
      !ParseInt(flags["device"], &device) || rows <= 0 || cols <= 0 ||
      batch <= 0 || steps <= 0 || restart < 0 || repeat < 1) {
    return Usage(
        "--rows, --cols, --batch, --steps, --repeat must be positive "
        "integers, --restart >= 0");
  }
  if (flags["in"].empty() || flags["out"].empty()) {
    return Usage("--in and --out are required");
  }
  cu::CudaNsOptions o;
  cu::DType io = cu::DType::kF32;
  if (!ParseDType(flags["dtype"], &o.compute) ||
      !ParseDType(flags["io_dtype"], &io)) {
    return Usage("--dtype / --io_dtype must be bf16, fp16 or f32");
  }
  auto method = k::ParseMethod(flags["method"]);
  if (!method.ok())
    return Usage(std::string(method.status().message()).c_str());
  auto schedule = k::ScheduleByName(flags["schedule"], static_cast<int>(steps));
  if (!schedule.ok()) {
    return Usage(std::string(schedule.status().message()).c_str());
  }
  o.ns.method = *method;
  o.ns.schedule = *schedule;
  o.ns.gram_restart_after = static_cast<int>(restart);
  o.symmetric = flags["symmetric"] != "0";
  o.use_graphs = flags["graphs"] != "0";

  const k::Shape shape{rows, cols};
  const size_t n = static_cast<size_t>(batch * rows * cols);
  std::vector<float> host(n);
  FILE* f = std::fopen(flags["in"].c_str(), "rb");
  if (f == nullptr || std::fread(host.data(), sizeof(float), n, f) != n) {
    std::fprintf(stderr, "ns_tool: cannot read %zu floats from %s\n", n,
                 flags["in"].c_str());
    if (f != nullptr) std::fclose(f);
    return 1;
  }
  std::fclose(f);

  auto count = cu::DeviceCount();
  if (!count.ok()) return Fail("no CUDA device", count.status());
  auto ctx = cu::Context::Create(static_cast<int>(device));
  if (!ctx.ok()) return Fail("Context::Create", ctx.status());
  cu::Context& c = **ctx;
  const size_t bytes = n * cu::DTypeBytes(io);
  auto in = c.Allocate(bytes);
  if (!in.ok()) return Fail("Allocate", in.status());
  auto out = c.Allocate(bytes);
  if (!out.ok()) return Fail("Allocate", out.status());
  if (auto st = c.Upload(host.data(), n, *in, io); !st.ok()) {
    return Fail("Upload", st);
  }
  const cu::DeviceBatch din{*in, io, shape, batch, bytes};
  const cu::DeviceBatch dout{*out, io, shape, batch, bytes};
  std::vector<double> ms;
  for (long long r = 0; r < repeat + (repeat > 1 ? 1 : 0); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto st = c.Orthogonalize(din, dout, o); !st.ok()) {
      return Fail("Orthogonalize", st);
    }
    if (auto st = c.Synchronize(); !st.ok()) return Fail("Synchronize", st);
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0 || repeat == 1) {
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  if (auto st = c.Download(*out, io, n, host.data()); !st.ok()) {
    return Fail("Download", st);
  }
  f = std::fopen(flags["out"].c_str(), "wb");
  if (f == nullptr || std::fwrite(host.data(), sizeof(float), n, f) != n) {
    std::fprintf(stderr, "ns_tool: cannot write %s\n", flags["out"].c_str());
    if (f != nullptr) std::fclose(f);
    return 1;
  }
  std::fclose(f);
  std::sort(ms.begin(), ms.end());
  const cu::ResolvedNs ran = cu::ResolveNs(shape, o);  // what was run
  std::printf(
      "ns_tool: %s %lldx%lld batch %lld method %s (ran %s) dtype %s (ran %s) "
      "io %s steps %lld schedule %s: median %.3f ms over %zu call(s)\n",
      c.DeviceDescription().c_str(), rows, cols, batch, flags["method"].c_str(),
      std::string(k::MethodName(ran.method)).c_str(), flags["dtype"].c_str(),
      std::string(cu::DTypeName(ran.compute)).c_str(),
      flags["io_dtype"].c_str(), steps, flags["schedule"].c_str(),
      ms[ms.size() / 2], ms.size());
  (void)c.Free(*in);
  (void)c.Free(*out);
  return 0;
}
