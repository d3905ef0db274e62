// A complete C++ trainer on dmuon, to copy: fits a two-layer linear model
// y = W2 W1 x to a fixed random teacher by Muon through a running dmuond.
//
//   bazel build //client/examples:linear_trainer //daemon:dmuond
//   bazel-bin/daemon/dmuond --listen=127.0.0.1:50051 &
//   bazel-bin/client/examples/linear_trainer --server=127.0.0.1:50051
//
// Per step: compute each matrix's gradient straight into the session's
// gradient buffer, declare it ready as soon as it exists (backward order:
// W2 first), then wait for each update in forward order and apply
//   W <- W * (1 - lr * wd) - lr * update       (torch.optim.Muon's step;
// the daemon's update already carries lr_scale). The momentum lives in the
// daemon; GetState() fetches it for a checkpoint.

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "dmuond address");
ABSL_FLAG(int, steps, 60, "training steps");
ABSL_FLAG(double, lr, 0.02, "learning rate");
ABSL_FLAG(double, weight_decay, 0.0, "decoupled weight decay");
ABSL_FLAG(int, batch, 64, "examples per step");

namespace {

constexpr int kIn = 32, kHidden = 48, kOut = 16;

using Matrix = std::vector<float>;  // row-major

// c[m x n] = a[m x k] * b[k x n] (a transposed when ta: a is [k x m]; b
// transposed when tb: b is [n x k]).
void MatMul(const float* a, const float* b, float* c, int m, int n, int k,
            bool ta = false, bool tb = false) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        s += double(ta ? a[p * m + i] : a[i * k + p]) *
             (tb ? b[j * k + p] : b[p * n + j]);
      }
      c[i * n + j] = static_cast<float>(s);
    }
  }
}

Matrix Random(int rows, int cols, double scale, std::mt19937* rng) {
  std::normal_distribution<float> d(0.0f, static_cast<float>(scale));
  Matrix m(rows * cols);
  for (float& x : m) x = d(*rng);
  return m;
}

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "linear_trainer: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int batch = absl::GetFlag(FLAGS_batch);
  const double lr = absl::GetFlag(FLAGS_lr),
               wd = absl::GetFlag(FLAGS_weight_decay);
  std::mt19937 rng(7);
  const Matrix teacher = Random(kOut, kIn, 1.0 / std::sqrt(kIn), &rng);
  Matrix w1 = Random(kHidden, kIn, 1.0 / std::sqrt(kIn), &rng);
  Matrix w2 = Random(kOut, kHidden, 1.0 / std::sqrt(kHidden), &rng);

  // 1. Connect and open a session with the parameter table (the whole
  //    matrices; one rank, replicated) and torch.optim.Muon's defaults.
  dmuon::ClientOptions options;
  options.deadline = std::chrono::seconds(30);
  auto client = dmuon::Client::Connect(absl::GetFlag(FLAGS_server), options);
  if (!client.ok()) return Fail(client.status());
  dmuon::SessionSpec spec;
  spec.job_id = "linear-trainer-example";
  spec.params = {{"w1", kHidden, kIn}, {"w2", kOut, kHidden}};
  spec.params[0].forward_order = 0;  // needed first by the next forward
  spec.params[1].forward_order = 1;
  spec.groups = {dmuon::GroupSpec{}};  // momentum 0.95, Nesterov, 5 NS steps
  auto session = (*client)->OpenSession(spec);
  if (!session.ok()) return Fail(session.status());
  dmuon::Session& s = **session;
  std::printf("session on %s (%s transport), starting at step %lld\n",
              absl::GetFlag(FLAGS_server).c_str(), s.transport().c_str(),
              static_cast<long long>(s.step()));

  Matrix x(kIn * batch), h(kHidden * batch), y(kOut * batch), t(kOut * batch);
  Matrix dy(kOut * batch), dh(kHidden * batch);
  double first = 0, last = 0;
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    // Forward: columns are examples. h = W1 x, y = W2 h; loss = mean sq err.
    x = Random(kIn, batch, 1.0, &rng);
    MatMul(teacher.data(), x.data(), t.data(), kOut, batch, kIn);
    MatMul(w1.data(), x.data(), h.data(), kHidden, batch, kIn);
    MatMul(w2.data(), h.data(), y.data(), kOut, batch, kHidden);
    double loss = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      dy[i] = 2.0f * (y[i] - t[i]) / static_cast<float>(batch);
      loss += (y[i] - t[i]) * (y[i] - t[i]);
    }
    loss /= batch;
    if (step == 1) first = loss;
    last = loss;

    // 2. Backward, writing each gradient into the session and handing it off
    //    at once: the daemon works on W2 while W1's gradient is computed.
    MatMul(dy.data(), h.data(), s.gradient(1).data(), kOut, kHidden, batch,
           false, true);  // dW2 = dy h^T
    if (auto st = s.GradientReady(1); !st.ok()) return Fail(st);
    MatMul(w2.data(), dy.data(), dh.data(), kHidden, batch, kOut, true);
    MatMul(dh.data(), x.data(), s.gradient(0).data(), kHidden, kIn, batch,
           false, true);  // dW1 = dh x^T
    if (auto st = s.GradientReady(0); !st.ok()) return Fail(st);

    // 3. Apply the updates in forward order as they come back.
    Matrix* weights[] = {&w1, &w2};
    for (int p = 0; p < 2; ++p) {
      if (auto st = s.WaitUpdate(p); !st.ok()) return Fail(st);
      auto u = s.update(p);
      Matrix& w = *weights[p];
      for (size_t i = 0; i < w.size(); ++i) {
        w[i] = static_cast<float>(w[i] * (1.0 - lr * wd) - lr * u[i]);
      }
    }
    if (auto st = s.FinishStep(); !st.ok()) return Fail(st);
    if (step % 10 == 0 || step == 1) {
      std::printf("step %3d  loss %.5f\n", step, loss);
    }
  }

  // 4. The daemon-held state, e.g. for a checkpoint (SetState restores it).
  auto state = s.GetState();
  if (!state.ok()) return Fail(state.status());
  std::printf(
      "done: loss %.4f -> %.4f; the daemon holds %zu momentum "
      "matrices after %lld steps\n",
      first, last, state->momentum.size(),
      static_cast<long long>(state->completed_steps));
  if (auto st = s.Close(); !st.ok()) return Fail(st);
  return last < 0.5 * first ? 0 : 2;
}
