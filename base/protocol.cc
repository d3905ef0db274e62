#include "base/protocol.h"

namespace dmuon {

// Weak: //base/testing:protocol_prev overrides it in dmuond_prev (protocol.h).
__attribute__((weak)) uint32_t ProtocolMinor() { return kProtocolMinor; }

}  // namespace dmuon
