// Linked into //daemon:dmuond_minor0 only (testonly): the strong definition
// of ProtocolMinor() overrides base/protocol.cc's weak one, so that binary
// speaks minor 0, as a dmuond from before minor versions (1.0) would: what
// this client refuses against such a daemon (tests/version_skew_test.cc).

#include "base/protocol.h"

namespace dmuon {

uint32_t ProtocolMinor() { return 0; }

}  // namespace dmuon
