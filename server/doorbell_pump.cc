#include "server/doorbell_pump.h"

#include <chrono>
#include <map>
#include <utility>

namespace dmuon::server {
namespace {

// One step's new declarations, by kind.
struct StepDeclarations {
  v1::StepRequest plain;  // param_ids without a momentum, absent_param_ids
  v1::StepRequest with_momentum;
};

// Whether serial `a` was written before serial `b` (both mod 2^bits, less
// than half the range apart: a client writes far fewer words between a
// declaration and a rewind, about one per parameter).
bool SerialBefore(uint32_t a, uint32_t b) {
  constexpr uint32_t kRange = uint32_t{1} << transport::kDoorbellSerialBits;
  const uint32_t ahead = (b - a) & (kRange - 1);
  return ahead != 0 && ahead < kRange / 2;
}

// `by_step`'s messages, steps ascending, appended to `out`.
void Append(std::map<int64_t, StepDeclarations>& by_step,
            std::vector<v1::StepRequest>* out) {
  for (auto& [step, d] : by_step) {
    for (v1::StepRequest* m : {&d.plain, &d.with_momentum}) {
      if (!m->has_gradients_ready()) continue;
      m->mutable_gradients_ready()->set_step(step);
      out->push_back(std::move(*m));
    }
  }
}

void Add(const transport::DoorbellWord& w, int id, double momentum,
         StepDeclarations* d) {
  if (w.flag_b) {  // absent
    d->plain.mutable_gradients_ready()->add_absent_param_ids(id);
  } else if (w.flag_a) {  // with this step's momentum
    d->with_momentum.mutable_gradients_ready()->add_param_ids(id);
    d->with_momentum.mutable_gradients_ready()->add_momentum(momentum);
  } else {
    d->plain.mutable_gradients_ready()->add_param_ids(id);
  }
}

}  // namespace

std::vector<v1::StepRequest> NewDeclarations(
    const transport::Doorbell::Declarations& now, DeclarationsSeen* seen) {
  const bool rewound = now.rewind != seen->rewind;
  const transport::DoorbellWord rewind = transport::DecodeWord(now.rewind);
  seen->rewind = now.rewind;
  std::map<int64_t, StepDeclarations> before, after;  // the rewind
  const size_t n = std::min(now.params.size(), now.words.size());
  for (size_t k = 0; k < n; ++k) {
    const int p = now.params[k];
    if (p < 0 || static_cast<size_t>(p) >= seen->words.size() ||
        now.words[k] == seen->words[p]) {
      continue;
    }
    seen->words[p] = now.words[k];
    const transport::DoorbellWord w = transport::DecodeWord(now.words[k]);
    auto& side =
        rewound && SerialBefore(w.serial, rewind.serial) ? before : after;
    Add(w, p, k < now.momentum.size() ? now.momentum[k] : 0, &side[w.step]);
  }
  std::vector<v1::StepRequest> out;
  Append(before, &out);
  if (rewound) out.emplace_back().mutable_rewind()->set_step(rewind.step);
  Append(after, &out);
  return out;
}

DoorbellPump::DoorbellPump(std::shared_ptr<transport::Doorbell> bell, Post post)
    : bell_(std::move(bell)),
      post_(std::move(post)),
      seen_(bell_->num_params()) {
  thread_ = std::thread([this] { Run(); });
}

DoorbellPump::~DoorbellPump() { Stop(); }

void DoorbellPump::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  bell_->WakeDeclared();
  thread_.join();
}

void DoorbellPump::Taken() {
  // The last one out wakes a pump that waits for it (seq_cst: either this
  // sees its flag or it sees the count at 0 and does not wait).
  if (outstanding_.fetch_sub(1) == 1 && waiting_for_taken_.load())
    bell_->WakeDeclared();
}

void DoorbellPump::StopAndFlush() {
  Stop();
  (void)LoadAndPost();
}

bool DoorbellPump::LoadAndPost() {
  if (absl::Status st = bell_->Take(&now_); !st.ok()) {
    post_(st);
    return false;
  }
  std::vector<v1::StepRequest> msgs = NewDeclarations(now_, &seen_);
  outstanding_.fetch_add(static_cast<int64_t>(msgs.size()));
  for (v1::StepRequest& m : msgs) post_(std::move(m));
  return true;
}

void DoorbellPump::Run() {
  constexpr auto kLook = std::chrono::milliseconds(100);
  while (!stop_.load()) {
    const uint32_t counter = bell_->declare_counter();
    if (outstanding_.load() > 0) {  // the last load's messages wait
      waiting_for_taken_.store(true);
      if (outstanding_.load() > 0) bell_->WaitDeclared(counter, kLook);
      waiting_for_taken_.store(false);
      continue;
    }
    if (!LoadAndPost()) return;
    bell_->WaitDeclared(counter, kLook);
  }
}

}  // namespace dmuon::server
