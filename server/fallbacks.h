// Fallbacks: every place where dmuond takes a slower or different path than
// the one asked for, counted by kind (docs/design.md "Fallbacks"), so that
// none is silent. The kinds are a fixed set, named here; Status
// (`StatusResponse.fallbacks`) and /metrics (`dmuon_fallbacks_total{kind}`)
// list each of them, at 0 until it happens. Each kind is logged once per
// daemon process, at its first occurrence, with its reason: a fallback that
// happens every step must not flood the log, and the counter says how often.
//
// Strict mode (dmuond --strict) refuses a fallback instead of taking it:
// Take() then returns FAILED_PRECONDITION naming the kind, the reason and
// what to change, and counts nothing (the refusal is an error, counted by
// its code). What "refuse" means for each kind is the caller's (see the
// kinds below). Thread-safe; a leaf lock.

#ifndef DMUON_SERVER_FALLBACKS_H_
#define DMUON_SERVER_FALLBACKS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace dmuon::server {

// A kernel plan whose CUDA graph failed (capture, instantiation or replay)
// runs eagerly from then on (gpu_logic.h GraphFallback; counted per plan
// key). Strict: that batch fails with FAILED_PRECONDITION, nothing computed
// eagerly (its job breaks, as on any failed batch), and the executor stays
// healthy.
inline constexpr std::string_view kFallbackGraphEager = "graph_eager";
// A new job planned on fewer executors than the daemon has, around the
// ones that lost their device (service_open.cc BuildJob). Strict: that
// OpenSession fails with FAILED_PRECONDITION naming the unhealthy executors;
// no job is made.
inline constexpr std::string_view kFallbackUnhealthyExecutor =
    "unhealthy_executor";
// A completed step undone at a client's request (Rewind: gradients edited
// after their hand-off, a second backward, or a step voided by an error),
// so that step is computed twice. Counted once per job step rewound, never
// refused by --strict: the client asks for it, and refusing it would leave
// the trainer's weights and dmuond's momentum a step apart; DMuon(strict=
// True) refuses it on the trainer's side, before anything is handed off.
inline constexpr std::string_view kFallbackRewind = "rewind";

// Every daemon kind, in the order Status and /metrics list them.
const std::vector<std::string>& DaemonFallbackKinds();

class FallbackCounter {
 public:
  // `log(kind, reason)` is called once per kind, at its first occurrence
  // (Take or Add), outside the counter's lock; may be empty.
  using Log =
      std::function<void(std::string_view kind, const std::string& reason)>;
  explicit FallbackCounter(bool strict = false, Log log = nullptr);

  bool strict() const { return strict_; }

  // A fallback of `kind` about to be taken for `reason`. Not strict: counts
  // it and returns OK (the caller takes the fallback). Strict: counts
  // nothing and returns FAILED_PRECONDITION "--strict refuses the fallback
  // '<kind>': <reason>; <remedy>" (the caller refuses).
  absl::Status Take(std::string_view kind, const std::string& reason,
                    const std::string& remedy);
  // Counts a fallback that strict mode does not refuse (kFallbackRewind).
  void Add(std::string_view kind, const std::string& reason);

  // Every daemon kind's count (0 for those never taken).
  std::map<std::string, uint64_t> Counts() const;

 private:
  const bool strict_;
  const Log log_;
  mutable absl::Mutex mu_;
  std::map<std::string, uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> logged_ ABSL_GUARDED_BY(mu_);
};

// The message of a --strict refusal of `kind` (what Take returns, for the
// callers that refuse without a counter: GraphFallback).
absl::Status StrictRefusal(std::string_view kind, const std::string& reason,
                           const std::string& remedy);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_FALLBACKS_H_
