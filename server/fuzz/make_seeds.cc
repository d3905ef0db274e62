// Writes the fuzz harnesses' seed corpora (server/fuzz/corpus/...): request
// sequences a well-behaved client sends, and snapshot files the service
// itself wrote, so that fuzzing starts from inputs that reach deep.
//   bazel run //server/fuzz:make_seeds -- $PWD/server/fuzz/corpus

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "proto/dmuon.pb.h"
#include "server/fuzz/fuzz_support.h"
#include "server/service.h"
#include "server/testing/open_request.h"

namespace dmuon::server::fuzz {
namespace {

class Recorder {
 public:
  void Add(uint8_t op, const std::string& payload) {
    out_ += static_cast<char>(op);
    out_ += static_cast<char>(payload.size() & 0xff);
    out_ += static_cast<char>(payload.size() >> 8);
    out_ += payload;
  }
  void Add(uint8_t op, uint8_t session, const std::string& payload = "") {
    Add(op, std::string(1, static_cast<char>(session)) + payload);
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

// Two small parameters, one replicated and one row-sharded.
v1::OpenSessionRequest Open(const std::string& job, int rank, int world,
                            v1::Transport t) {
  return testing::OpenRequest(
      job, rank, world, t,
      {{"w", 4, 3, v1::SHARDING_REPLICATED}, {"v", 6, 2, v1::SHARDING_ROWS}});
}

// The elements of parameter `p` a rank's request says it holds.
int64_t LocalElements(const v1::ParameterSpec& p) {
  if (p.sharding() == v1::SHARDING_ROWS)
    return (p.row_end() - p.row_begin()) * p.shape(1);
  if (p.sharding() != v1::SHARDING_BLOCKS) return p.shape(0) * p.shape(1);
  int64_t rows = 0, cols = 0;
  for (const auto& r : p.row_runs()) rows += r.end() - r.begin();
  for (const auto& c : p.col_runs()) cols += c.end() - c.begin();
  return rows * cols;
}

// Step with parameter `absent` declared absent (no gradient, protocol minor
// 1) and the others' inline gradients sent; absent < 0: none absent.
void StepAbsent(Recorder& rec, uint8_t session,
                const v1::OpenSessionRequest& open, int64_t step, int absent) {
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(step);
  for (int i = 0; i < open.parameters_size(); ++i) {
    if (i == absent) {
      ready.mutable_gradients_ready()->add_absent_param_ids(i);
      continue;
    }
    std::vector<float> g(LocalElements(open.parameters(i)), 0.5f * (i + 1));
    v1::StepRequest c;
    c.mutable_gradient()->set_step(step);
    c.mutable_gradient()->set_param_id(i);
    c.mutable_gradient()->set_data(g.data(), g.size() * sizeof(float));
    rec.Add(2, session, c.SerializeAsString());
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  rec.Add(2, session, ready.SerializeAsString());
}

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

void ServiceSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  for (v1::Transport t : {v1::TRANSPORT_INLINE, v1::TRANSPORT_SHM}) {
    for (int world : {1, 2}) {
      Recorder rec;
      std::vector<v1::OpenSessionRequest> opens;
      for (int r = 0; r < world; ++r) {
        opens.push_back(Open("job", r, world, v1::TRANSPORT_INLINE));
        opens.back().set_transport(t);
        rec.Add(0, opens.back().SerializeAsString());
        rec.Add(1, static_cast<uint8_t>(r));
      }
      for (int64_t step = 1; step <= 2; ++step) {
        for (int r = 0; r < world; ++r) StepAbsent(rec, r, opens[r], step, -1);
      }
      rec.Add(3, 0);
      rec.Add(8, "");
      rec.Add(7, 0);
      rec.Add(9, "");
      Write(dir / ("steps-" + std::string(v1::Transport_Name(t)) + "-world" +
                   std::to_string(world)),
            rec.bytes());
    }
  }
  {
    // Absent parameters: two ranks, one parameter absent at step 1 (on
    // every rank), the other at step 2, then both present.
    Recorder rec;
    std::vector<v1::OpenSessionRequest> opens;
    for (int r = 0; r < 2; ++r) {
      opens.push_back(Open("absent", r, 2, v1::TRANSPORT_INLINE));
      rec.Add(0, opens.back().SerializeAsString());
      rec.Add(1, static_cast<uint8_t>(r));
    }
    for (int64_t step = 1; step <= 3; ++step) {
      for (int r = 0; r < 2; ++r)
        StepAbsent(rec, r, opens[r], step, step == 3 ? -1 : int(step) - 1);
    }
    rec.Add(3, 0);
    Write(dir / "steps-absent-world2", rec.bytes());
  }
  {
    // SHARDING_BLOCKS (protocol minor 3): three ranks, rank 1 holding two
    // row runs that rank 0 partly holds too, rank 2 holding nothing.
    Recorder rec;
    std::vector<v1::OpenSessionRequest> opens;
    const std::vector<std::vector<std::pair<int64_t, int64_t>>> rows = {
        {{0, 4}}, {{4, 6}, {1, 3}}, {}};
    for (int r = 0; r < 3; ++r) {
      opens.push_back(Open("blocks", r, 3, v1::TRANSPORT_INLINE));
      auto* v = opens.back().mutable_parameters(1);
      v->set_sharding(v1::SHARDING_BLOCKS);
      v->clear_row_begin();
      v->clear_row_end();
      for (auto [b, e] : rows[r]) {
        auto* x = v->add_row_runs();
        x->set_begin(b);
        x->set_end(e);
      }
      if (!rows[r].empty()) v->add_col_runs()->set_end(2);
      rec.Add(0, opens.back().SerializeAsString());
      rec.Add(1, static_cast<uint8_t>(r));
    }
    for (int64_t step = 1; step <= 2; ++step) {
      for (int r = 0; r < 3; ++r) StepAbsent(rec, r, opens[r], step, -1);
    }
    rec.Add(3, 0);
    Write(dir / "steps-blocks-world3", rec.bytes());
  }
  // SetState: a header and a momentum chunk for a job of one rank.
  Recorder rec;
  const v1::OpenSessionRequest open = Open("state", 0, 1, v1::TRANSPORT_INLINE);
  rec.Add(0, open.SerializeAsString());
  rec.Add(1, 0);
  v1::StateChunk header;
  // No session_id: the harness gives it the last session opened.
  auto* h = header.mutable_header();
  h->set_job_id("state");
  h->set_completed_steps(3);
  *h->mutable_parameters() = open.parameters();
  *h->mutable_groups() = open.groups();
  rec.Add(4, header.SerializeAsString());
  v1::StateChunk m;
  std::vector<float> zeros(12, 0.5f);
  m.mutable_momentum()->set_param_id(0);
  m.mutable_momentum()->set_name("w");
  m.mutable_momentum()->set_total_bytes(48);
  m.mutable_momentum()->set_data(zeros.data(), 48);
  rec.Add(4, m.SerializeAsString());
  rec.Add(5, "");
  StepAbsent(rec, 0, open, 4, -1);
  rec.Add(3, 0);
  Write(dir / "set-state", rec.bytes());
}

class WaitSink final : public StepSink {
 public:
  void Send(v1::StepResponse m) override {
    if (m.has_step_complete()) done_ = true;
  }
  void Abort(absl::Status) override { done_ = true; }
  std::atomic<bool> done_{false};
};

void SnapshotSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  char tmpl[] = "/tmp/dmuon-seeds-XXXXXX";
  const std::string state = mkdtemp(tmpl);
  ServiceOptions o;
  o.state_dir = state;
  auto service = NewFastService(o, /*executors=*/1);
  OptimizerService& svc = *service;
  const v1::OpenSessionRequest open = Open("snap", 0, 1, v1::TRANSPORT_INLINE);
  auto r = svc.OpenSession(open);
  if (!r.ok()) std::abort();
  auto sink = std::make_shared<WaitSink>();
  if (!svc.Attach(r->session_id(), sink).ok()) std::abort();
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(1);
  for (int i = 0; i < open.parameters_size(); ++i) {
    const auto& p = open.parameters(i);
    std::vector<float> g(p.shape(0) * p.shape(1), 0.5f + i);
    v1::StepRequest c;
    c.mutable_gradient()->set_step(1);
    c.mutable_gradient()->set_param_id(i);
    c.mutable_gradient()->set_data(g.data(), g.size() * sizeof(float));
    if (!svc.OnStepRequest(r->session_id(), c).ok()) std::abort();
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  if (!svc.OnStepRequest(r->session_id(), ready).ok()) std::abort();
  while (!sink->done_)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!svc.SnapshotAll().ok()) std::abort();
  for (const auto& e : std::filesystem::directory_iterator(state)) {
    std::ifstream in(e.path(), std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    const std::string req = open.SerializeAsString();
    std::string seed;
    seed += '\1';  // recompute the CRC
    seed += static_cast<char>(req.size() & 0xff);
    seed += static_cast<char>(req.size() >> 8);
    seed += req;
    seed += file;
    Write(dir / "snapshot-crc", seed);
    seed[0] = '\0';  // keep the file's own CRC
    Write(dir / "snapshot-asis", seed);
  }
  std::filesystem::remove_all(state);
}

// doorbell_fuzzer's ops (its Op enum): a client declaring steps 1 and 2
// through its doorbell, with gradients, a momentum, an absent parameter, a
// rewind and step 2 again; then one that writes garbage words and marks;
// then one that cuts its segment.
void DoorbellSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  auto bytes = [](std::initializer_list<int> b) {
    std::string s;
    for (int x : b) s += static_cast<char>(x);
    return s;
  };
  enum : uint8_t { kBytes, kDeclare, kRewind, kGradient, kTake, kCut };
  Recorder steps;
  for (int step = 1; step <= 2; ++step) {  // delta 1: the job's step
    steps.Add(kGradient, bytes({0, 0, 0, 0, 128, 63, 0, 0, 0, 64}));
    steps.Add(kDeclare, bytes({2, 1, 0}));
    steps.Add(kDeclare, bytes({1, 1, 1, 200}));  // with a momentum
    steps.Add(kDeclare, bytes({0, 1, 2}));       // absent
    steps.Add(kTake, "");
  }
  steps.Add(kRewind, bytes({0}));  // the step just completed, again
  for (int param = 0; param < 3; ++param)
    steps.Add(kDeclare, bytes({param, 1, 0}));
  steps.Add(kTake, "");
  Write(dir / "steps", steps.bytes());
  Recorder garbage;
  garbage.Add(kBytes, bytes({192, 0, 255, 255, 255, 255, 255, 255, 255, 255}));
  garbage.Add(kDeclare, bytes({0, 1, 0}));
  garbage.Add(kTake, "");
  Write(dir / "garbage", garbage.bytes());
  Recorder cut;
  cut.Add(kDeclare, bytes({1, 1, 0}));
  cut.Add(kCut, bytes({1, 0}));
  Write(dir / "cut", cut.bytes());
}

}  // namespace
}  // namespace dmuon::server::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
    return 2;
  }
  const std::filesystem::path root = argv[1];
  dmuon::server::fuzz::ServiceSeeds(root / "service");
  dmuon::server::fuzz::SnapshotSeeds(root / "snapshot");
  dmuon::server::fuzz::DoorbellSeeds(root / "doorbell");
  return 0;
}
