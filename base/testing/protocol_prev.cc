// Linked into //daemon:dmuond_prev only (testonly): the strong definition of
// ProtocolMinor() overrides base/protocol.cc's weak one, so that binary speaks
// the minor before this tree's, as the previous release's dmuond would
// (tests/version_skew_test.cc, a rolling upgrade).

#include "base/protocol.h"

namespace dmuon {

static_assert(kProtocolMinor >= 1, "there is no minor before 0");

uint32_t ProtocolMinor() { return kProtocolMinor - 1; }

}  // namespace dmuon
