// The defaults of dmuond's limits, each written once (docs/security.md
// "Limits"). ServiceOptions (service.h), the gRPC adapter's GrpcOptions
// (daemon/grpc_service.h), DaemonConfig (daemon/config.h) and dmuond's flags
// (daemon/config.cc) all take their defaults from here;
// daemon/config_test.cc checks that they agree.

#ifndef DMUON_SERVER_LIMITS_H_
#define DMUON_SERVER_LIMITS_H_

#include <cstdint>

#include "absl/time/time.h"

namespace dmuon::server {

// Each is the default of the dmuond flag of its name (kDefaultMaxSessions:
// --max-sessions).

inline constexpr int kDefaultMaxSessions = 64;
inline constexpr int64_t kDefaultMaxMessageBytes = int64_t{64} << 20;
inline constexpr int kDefaultSnapshotEvery = 0;
inline constexpr int kDefaultJobRetentionSeconds = 600;
inline constexpr int kDefaultMaxWorldSize = 4096;
inline constexpr int kDefaultMaxJobParameters = 16384;
inline constexpr int64_t kDefaultMaxJobElements = int64_t{1} << 34;
// --max-state-bytes: 0. In ServiceOptions 0 is "no limit"; dmuond's 0 is
// "derived from the memory that holds the state" (DefaultStateBytes,
// daemon/config.h), which it passes to the service.
inline constexpr int64_t kDefaultMaxStateBytes = 0;
inline constexpr int kDefaultMaxNsSteps = 100;
// Every GetState stream together: 4 readers of maximum-size chunks (each
// twice its chunk: the copy and its serialized message).
inline constexpr int64_t kDefaultMaxStateReadBytes = int64_t{512} << 20;
inline constexpr int kDefaultMaxJobIdBytes = 256;
inline constexpr int kDefaultMaxIdleJobs = 64;
inline constexpr int kDefaultAttachTimeoutSeconds = 60;
// Marks (mark_store.h): per job, and the momentum bytes of every job's
// marks in memory together.
inline constexpr int kDefaultMarksPerJob = 4;
inline constexpr int64_t kDefaultMarkBytes = int64_t{4} << 30;
// The gRPC adapter's (GrpcOptions): a session's Step responses queued for
// its client.
inline constexpr int64_t kDefaultMaxStepQueueBytes = int64_t{64} << 20;
// The gRPC adapter's too: the Step, GetState and SetState streams one peer
// host (its address without the port) may have open at once.
inline constexpr int kDefaultMaxStreamsPerPeer = 256;

// Not flags: a GetState chunk is never cut below 1 MiB to fit
// --max-state-read-bytes (a reader waits instead), and waits 10 s at most.
inline constexpr uint64_t kMinStateChunk = uint64_t{1} << 20;
inline constexpr absl::Duration kStateReadWait = absl::Seconds(10);

// Not a flag: the most completed steps a job may be set to (SetState, a
// snapshot file): steps then count up by one each, so step numbers (int64)
// never overflow.
inline constexpr int64_t kMaxCompletedSteps = int64_t{1} << 62;

}  // namespace dmuon::server

#endif  // DMUON_SERVER_LIMITS_H_
