// The one error for a session id that names no open session (never
// opened, closed, or expired), whichever call or stage finds it: the
// service's calls and the step pipeline alike.

#ifndef DMUON_SERVER_SESSION_ERROR_H_
#define DMUON_SERVER_SESSION_ERROR_H_

#include "absl/status/status.h"

namespace dmuon::server {

// NOT_FOUND, in one wording.
inline absl::Status NoOpenSessionError() {
  return absl::NotFoundError(
      "no open session with this session_id (never opened, closed, or "
      "expired)");
}

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SESSION_ERROR_H_
