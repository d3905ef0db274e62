// Where a session's Step responses go: the service's only way out to a
// trainer's stream.

#ifndef DMUON_SERVER_STEP_SINK_H_
#define DMUON_SERVER_STEP_SINK_H_

#include "absl/status/status.h"
#include "proto/dmuon.pb.h"

namespace dmuon::server {

// The gRPC adapter (daemon/grpc_service.cc) queues the responses for a
// writer thread; tests record them (testing/recording_sink.h). Called with
// the job's lock held: Send and Abort must not block on the network nor call
// back into the service.
class StepSink {
 public:
  virtual ~StepSink() = default;
  virtual void Send(v1::StepResponse msg) = 0;
  // Ends the stream with `status` after what was already sent.
  virtual void Abort(absl::Status status) = 0;
  // A message the service sends later: a durable step's step_complete, held
  // until its snapshot is written (step_pipeline.cc, Deliver). The stream
  // does not end before SendHeld delivers it, even when Abort comes first
  // (the client half-closed right after its last gradients_ready: the step
  // was taken, and its stream must say so, never end OK without it). Each
  // HoldEnd is followed by exactly one SendHeld.
  virtual void HoldEnd() {}
  virtual void SendHeld(v1::StepResponse msg) { Send(std::move(msg)); }
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_SINK_H_
