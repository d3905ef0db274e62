// GetState and SetState as streams (StateReader, StateWriter): GetState
// holds its job at the step boundary and copies one chunk at a time out of
// the job's state (never the whole state); SetState checks its header
// before taking any momentum and never takes more than the header declared.

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kParams = {{"a", 64, 64, v1::SHARDING_REPLICATED},
                                    {"b", 32, 48, v1::SHARDING_REPLICATED},
                                    {"c", 100, 10, v1::SHARDING_REPLICATED}};

// A random state of kParams at `completed` steps, as SetState's chunks.
std::vector<v1::StateChunk> RandomState(const std::string& session,
                                        int64_t completed, uint64_t seed,
                                        std::vector<std::string>* bytes) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<v1::StateChunk> out(1);
  out[0].set_session_id(session);
  out[0].mutable_header()->set_completed_steps(completed);
  bytes->clear();
  for (size_t i = 0; i < kParams.size(); ++i) {
    auto* p = out[0].mutable_header()->add_parameters();
    p->set_name(kParams[i].name);
    p->add_shape(kParams[i].rows);
    p->add_shape(kParams[i].cols);
    std::vector<float> m(kParams[i].rows * kParams[i].cols);
    for (float& x : m) x = d(rng);
    bytes->emplace_back(reinterpret_cast<const char*>(m.data()),
                        m.size() * sizeof(float));
    v1::StateChunk c;
    c.mutable_momentum()->set_param_id(static_cast<int>(i));
    c.mutable_momentum()->set_total_bytes(bytes->back().size());
    c.mutable_momentum()->set_data(bytes->back());
    out.push_back(std::move(c));
  }
  return out;
}

int64_t CompletedSteps(OptimizerService& svc) {
  const auto s = svc.Status();
  return s.jobs_size() == 1 ? s.jobs(0).completed_steps() : -1;
}

std::vector<std::vector<float>> Grads(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> g;
  for (const auto& p : kParams) {
    g.emplace_back(p.rows * p.cols);
    for (float& x : g.back()) x = d(rng);
  }
  return g;
}

TEST(StreamState, GetStateIsChunkByChunkBitIdenticalAndHoldsTheStepBoundary) {
  ServiceOptions o;
  o.max_message_bytes = 8192;  // many chunks per parameter
  const uint64_t max_chunk = transport::MaxChunkPayload(o.max_message_bytes);
  auto svc = NewService(o);
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kParams)).ok());
  std::vector<std::string> want;
  const uint64_t seed = std::random_device{}();
  ASSERT_TRUE(
      SetState(*svc, RandomState(r.open.session_id(), 5, seed, &want)).ok());

  auto reader = svc->ReadState(r.open.session_id());
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto head = (*reader)->Next();
  ASSERT_TRUE(head.ok() && head->has_value());
  ASSERT_TRUE((*head)->has_header());
  EXPECT_EQ((*head)->header().completed_steps(), 5);

  std::vector<std::string> got(kParams.size());
  int chunks = 0;
  auto read_one = [&]() -> bool {
    auto c = (*reader)->Next();
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok() || !c->has_value()) return false;
    const v1::MomentumChunk& m = (*c)->momentum();
    EXPECT_LE(m.data().size(), max_chunk);
    EXPECT_EQ(m.offset(), got[m.param_id()].size());
    EXPECT_EQ(m.total_bytes(), want[m.param_id()].size());
    EXPECT_EQ(m.name(), kParams[m.param_id()].name);
    got[m.param_id()] += m.data();
    // The reader holds nothing of the state between chunks (host momentum).
    EXPECT_EQ((*reader)->buffered_bytes(), 0u);
    ++chunks;
    return true;
  };
  ASSERT_TRUE(read_one());

  // Nothing else may change it meanwhile: SetState is refused.
  std::vector<std::string> other;
  auto set = SetState(*svc, RandomState(r.open.session_id(), 9, 1, &other));
  EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(set.status().message().find("GetState"), std::string::npos)
      << set.status();
  // A whole step arrives while the reader is open: accepted, but it does
  // not run (the momentum being read stays that of step 5).
  ASSERT_TRUE(r.Send(*svc, 6, Grads(seed + 1)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(CompletedSteps(*svc), 5);
  // A second reader would see the job mid-step (the step's gradients are
  // in): refused as before.
  EXPECT_EQ(svc->ReadState(r.open.session_id()).status().code(),
            absl::StatusCode::kFailedPrecondition);

  while (read_one()) {
  }
  uint64_t total = 0;
  for (size_t i = 0; i < kParams.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << kParams[i].name;
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].size()), 0)
        << kParams[i].name << ": not bit-identical";
    total += want[i].size();
  }
  EXPECT_GE(chunks, static_cast<int>(total / max_chunk));
  EXPECT_EQ(CompletedSteps(*svc), 5);

  // The reader gone, the step that waited runs.
  reader->reset();
  auto msgs = r.sink->WaitStep(6);
  ASSERT_FALSE(msgs.empty());
  EXPECT_TRUE(msgs.back().has_step_complete());
  EXPECT_EQ(CompletedSteps(*svc), 6);
  // And the state read now is step 6's.
  auto after = GetState(*svc, r.open.session_id());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ((*after)[0].header().completed_steps(), 6);
  EXPECT_NE((*after)[1].momentum().data(), want[0].substr(0, max_chunk));
}

// --max-state-read-bytes: the readers together never lease more; a reader
// short of it gets smaller chunks, one with nothing free waits, then gets
// RESOURCE_EXHAUSTED naming the flag, and reads on once bytes are back.
TEST(StreamState, ReadersTogetherHoldNoMoreThanTheReadBudget) {
  const std::vector<Param> big = {{"big", 1024, 1024, v1::SHARDING_REPLICATED}};
  ServiceOptions o;  // chunks of up to ~64 MiB: the budget decides
  o.max_state_read_bytes = 3 << 20;
  o.state_read_wait = absl::Milliseconds(200);
  auto svc = NewService(o);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, big)).ok());
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  std::vector<float> m(1024 * 1024);
  for (float& x : m) x = d(rng);
  const std::string want(reinterpret_cast<const char*>(m.data()),
                         m.size() * sizeof(float));
  std::vector<v1::StateChunk> set(2);
  set[0].set_session_id(r.open.session_id());
  set[0].mutable_header()->set_completed_steps(3);
  auto* p = set[0].mutable_header()->add_parameters();
  p->set_name("big");
  p->add_shape(1024);
  p->add_shape(1024);
  set[1].mutable_momentum()->set_total_bytes(want.size());
  set[1].mutable_momentum()->set_data(want);
  ASSERT_TRUE(SetState(*svc, set).ok());

  auto a = svc->ReadState(r.open.session_id());
  auto b = svc->ReadState(r.open.session_id());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Next().ok() && (*b)->Next().ok());  // the headers
  auto first = (*a)->Next();  // 3 MiB leased: a chunk of 1.5 MiB, not 4
  ASSERT_TRUE(first.ok() && first->has_value()) << first.status();
  EXPECT_EQ((*first)->momentum().data().size(), uint64_t{3} << 19);
  auto refused = (*b)->Next();  // nothing free
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max-state-read-bytes=3145728"),
            std::string::npos)
      << refused.status();

  auto read_rest = [&](StateReader& reader, std::string got) {
    for (;;) {
      auto c = reader.Next();
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok() || !c->has_value()) return got;
      EXPECT_EQ((*c)->momentum().offset(), got.size());
      EXPECT_GE((*c)->momentum().data().size(),
                std::min<uint64_t>(kMinStateChunk, want.size() - got.size()));
      got += (*c)->momentum().data();
    }
  };
  const std::string got_a = read_rest(**a, (*first)->momentum().data());
  a->reset();
  const std::string got_b = read_rest(**b, "");  // its bytes are back
  EXPECT_TRUE(got_a == want) << "reader a: not bit-identical";
  EXPECT_TRUE(got_b == want) << "reader b: not bit-identical";
}

TEST(StreamState, TwoReadersAtOnceTheStepWaitsForTheLast) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kParams)).ok());
  auto a = svc->ReadState(r.open.session_id());
  auto b = svc->ReadState(r.open.session_id());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(r.Send(*svc, 1, Grads(3)).ok());
  a->reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(CompletedSteps(*svc), 0) << "b still reads";
  b->reset();
  auto msgs = r.sink->WaitStep(1);
  ASSERT_FALSE(msgs.empty());
  EXPECT_TRUE(msgs.back().has_step_complete());
}

TEST(StreamState, ARankLeavingWhileTheStepWaitsRollsBackCleanly) {
  auto svc = NewService();
  std::vector<Rank> r(2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        r[i].Open(*svc, Request("j", i, 2, v1::TRANSPORT_SHM, kParams)).ok());
  }
  auto reader = svc->ReadState(r[0].open.session_id());
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(r[0].Send(*svc, 1, Grads(4)).ok());
  ASSERT_TRUE(r[1].Send(*svc, 1, Grads(4)).ok());  // every parameter waits
  EXPECT_TRUE(svc->Detach(r[1].open.session_id(), absl::CancelledError("x")));
  absl::Status why;
  ASSERT_TRUE(r[0].sink->WaitAbort(&why));
  EXPECT_EQ(why.code(), absl::StatusCode::kAborted) << why;
  // The rest of the stream: the job was dropped from its ranks (no longer
  // open) but its momentum is still that of step 0, or the reader says why.
  for (;;) {
    auto c = (*reader)->Next();
    if (!c.ok() || !c->has_value()) break;
  }
  reader->reset();  // the waiting parameters end without running
  EXPECT_EQ(CompletedSteps(*svc), 0);
}

TEST(StreamState, SetStateChecksItsHeaderFirstAndTakesNoMoreThanDeclared) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kParams)).ok());
  std::vector<std::string> bytes;
  auto state = RandomState(r.open.session_id(), 3, 7, &bytes);

  // Refused at the first message: unknown session, no header, a table
  // that differs, another job's header.
  auto first = state[0];
  first.set_session_id("nope");
  EXPECT_EQ(svc->WriteState(first).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(svc->WriteState(state[1]).status().code(),
            absl::StatusCode::kInvalidArgument);
  first = state[0];
  first.mutable_header()->mutable_parameters(2)->set_shape(0, 101);
  auto w = svc->WriteState(first);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("'c'"), std::string::npos) << w.status();
  first = state[0];
  first.mutable_header()->set_job_id("another");
  EXPECT_EQ(svc->WriteState(first).status().code(),
            absl::StatusCode::kInvalidArgument);

  // More bytes for a parameter than its header declared: refused naming it,
  // and what was taken is at most the declared tensors.
  w = svc->WriteState(state[0]);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Add(state[1]).ok());
  EXPECT_EQ((*w)->buffered_bytes(), bytes[0].size());
  v1::StateChunk more;
  more.mutable_momentum()->set_param_id(1);
  more.mutable_momentum()->set_data(bytes[1] + std::string(4, '\0'));
  absl::Status st = (*w)->Add(more);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'b'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("declared"), std::string::npos) << st;
  // A parameter complete already takes nothing more either.
  v1::StateChunk again = state[1];
  again.mutable_momentum()->set_offset(bytes[0].size());
  again.mutable_momentum()->set_data("abcd");
  st = (*w)->Add(again);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'a'"), std::string::npos) << st;
  // total_bytes that is not the header's.
  v1::StateChunk lie = state[2];
  lie.mutable_momentum()->set_total_bytes(bytes[1].size() + 4);
  EXPECT_EQ((*w)->Add(lie).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LE((*w)->buffered_bytes(), bytes[0].size() + bytes[1].size());
  // Incomplete: nothing changes.
  EXPECT_EQ((*w)->Commit().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompletedSteps(*svc), 0);

  // The whole state in order: set.
  auto ok = SetState(*svc, state);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 3);
  auto back = GetState(*svc, r.open.session_id());
  ASSERT_TRUE(back.ok());
  std::vector<std::string> read(kParams.size());
  for (size_t k = 1; k < back->size(); ++k)
    read[(*back)[k].momentum().param_id()] += (*back)[k].momentum().data();
  EXPECT_EQ(read, bytes);
}

}  // namespace
}  // namespace dmuon::server::testing
