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

}  // namespace

std::vector<v1::StepRequest> NewDeclarations(
    const transport::Doorbell::Declarations& now, DeclarationsSeen* seen) {
  std::vector<v1::StepRequest> out;
  if (now.rewind != seen->rewind) {
    seen->rewind = now.rewind;
    out.emplace_back().mutable_rewind()->set_step(
        transport::DecodeWord(now.rewind).step);
  }
  std::map<int64_t, StepDeclarations> by_step;
  const size_t n = std::min(now.words.size(), seen->words.size());
  for (size_t i = 0; i < n; ++i) {
    if (now.words[i] == seen->words[i]) continue;
    seen->words[i] = now.words[i];
    const transport::DoorbellWord w = transport::DecodeWord(now.words[i]);
    StepDeclarations& d = by_step[w.step];
    const int id = static_cast<int>(i);
    if (w.flag_b) {  // absent
      d.plain.mutable_gradients_ready()->add_absent_param_ids(id);
    } else if (w.flag_a) {  // with this step's momentum
      d.with_momentum.mutable_gradients_ready()->add_param_ids(id);
      d.with_momentum.mutable_gradients_ready()->add_momentum(now.momentum[i]);
    } else {
      d.plain.mutable_gradients_ready()->add_param_ids(id);
    }
  }
  for (auto& [step, d] : by_step) {
    for (v1::StepRequest* m : {&d.plain, &d.with_momentum}) {
      if (!m->has_gradients_ready()) continue;
      m->mutable_gradients_ready()->set_step(step);
      out.push_back(std::move(*m));
    }
  }
  return out;
}

DoorbellPump::DoorbellPump(std::shared_ptr<transport::Doorbell> bell, Post post)
    : bell_(std::move(bell)), post_(std::move(post)) {
  thread_ = std::thread([this] { Run(); });
}

DoorbellPump::~DoorbellPump() {
  stop_.store(true);
  bell_->WakeDeclared();
  thread_.join();
}

void DoorbellPump::Run() {
  DeclarationsSeen seen(bell_->num_params());
  transport::Doorbell::Declarations now;
  while (!stop_.load()) {
    const uint32_t counter = bell_->declare_counter();
    if (absl::Status st = bell_->Load(&now); !st.ok()) {
      post_(st);
      return;
    }
    for (v1::StepRequest& m : NewDeclarations(now, &seen)) post_(std::move(m));
    bell_->WaitDeclared(counter, std::chrono::milliseconds(100));
  }
}

}  // namespace dmuon::server
