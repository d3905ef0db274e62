// The protocol's minor version and the build's version: the one place both
// are defined (docs/protocol.md "Versions"). The daemon puts them in
// Capabilities and refuses a client whose minor is newer than its own; the
// client sends them in OpenSessionRequest and refuses a daemon whose minor is
// older than the features its request uses need.

#ifndef DMUON_BASE_PROTOCOL_H_
#define DMUON_BASE_PROTOCOL_H_

#include <cstdint>

namespace dmuon {

// Minor versions of protocol 1 (PROTOCOL_VERSION_1), each adding to the one
// before:
//   0: the protocol before minor versions (a request's protocol_minor 0).
//   1: OpenSessionRequest.resume (Resume), GradientsReady and UpdatesReady
//      absent_param_ids, OpenSessionRequest.protocol_minor/client_version,
//      Capabilities.protocol_minor, StepRequest.rewind (Rewind).
//   2: GradientsReady.momentum (a per-step momentum per parameter).
//   3: SHARDING_BLOCKS (ParameterSpec.row_runs/col_runs): a rank's local
//      tensor as any product of row and column runs (DTensor placements).
//   4: OpenSessionRequest.resume_step (resume at a given completed step).
//   5: Mark (MarkRequest, JobStatus.marks); resume_step may name a mark, and
//      a job with no open rank may be reopened at another world size.
inline constexpr uint32_t kProtocolMinor = 5;

// The minor version this binary speaks: kProtocolMinor. Defined weak, so that
// a test binary can link a strong definition that speaks an older minor
// (base/testing/: //base/testing:protocol_prev, linked into
// //daemon:dmuond_prev only) and play the previous release in a
// rolling-upgrade test. Everything reads the minor through this function,
// never kProtocolMinor directly.
uint32_t ProtocolMinor();

// Whether this binary speaks `minor` or newer: what a minor adds is gated on
// it, so that a build speaking an older minor (//daemon:dmuond_prev) behaves
// as that release did.
inline bool SpeaksMinor(uint32_t minor) { return ProtocolMinor() >= minor; }

// This build's version (dmuond's Capabilities.version and Status, the
// client's OpenSessionRequest.client_version).
inline constexpr char kDmuonVersion[] = "0.1.0";

}  // namespace dmuon

#endif  // DMUON_BASE_PROTOCOL_H_
