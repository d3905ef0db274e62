// Region layout and inline-transport chunking. Pure arithmetic: every
// product and sum is checked, so a hostile or mistaken parameter table
// yields INVALID_ARGUMENT instead of a wrapped offset.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "transport/transport.h"

namespace dmuon::transport {
namespace {

// Room kept in a Step message for everything but the chunk's payload: the
// oneof tag, step, param_id and offset varints, the payload's length prefix
// and short strings such as a parameter name. Generous on purpose; the
// fixed fields take well under 64 bytes.
constexpr uint64_t kMessageOverheadBytes = 1024;

std::string Describe(size_t index, const TensorView& v) {
  return absl::StrCat("parameter ", index, " (shape ", v.rows, "x", v.cols,
                      ", ", v.element_bytes, "-byte elements)");
}

// Rounds `x` up to a multiple of kAlignment; false on overflow.
bool AlignUp(uint64_t x, uint64_t* out) {
  uint64_t sum;
  if (__builtin_add_overflow(x, kAlignment - 1, &sum)) return false;
  *out = sum / kAlignment * kAlignment;
  return true;
}

// Places a tensor of `bytes` at `*cursor` and advances the cursor past it to
// the next aligned offset; false on overflow.
bool Place(uint64_t bytes, uint64_t* cursor, uint64_t* offset) {
  *offset = *cursor;
  uint64_t end;
  if (__builtin_add_overflow(*cursor, bytes, &end)) return false;
  return AlignUp(end, cursor);
}

}  // namespace

absl::StatusOr<Layout> ComputeLayout(const std::vector<TensorView>& views) {
  Layout layout;
  layout.slots.reserve(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& v = views[i];
    // 0x0: a rank that holds nothing of the matrix (SHARDING_BLOCKS); its
    // slots take no bytes.
    const bool nothing = v.rows == 0 && v.cols == 0;
    if ((!nothing && (v.rows <= 0 || v.cols <= 0)) || v.element_bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(i, v), ": every dimension must be positive (or both 0)"));
    }
    Slot slot;
    slot.rows = v.rows;
    slot.cols = v.cols;
    slot.element_bytes = v.element_bytes;
    uint64_t elements;
    if (__builtin_mul_overflow(static_cast<uint64_t>(v.rows),
                               static_cast<uint64_t>(v.cols), &elements) ||
        __builtin_mul_overflow(elements, static_cast<uint64_t>(v.element_bytes),
                               &slot.bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(i, v), ": byte size overflows 64 bits"));
    }
    layout.slots.push_back(slot);
  }
  // The region is mapped with an off_t length, so it must also fit int64.
  constexpr uint64_t kMaxRegion = std::numeric_limits<int64_t>::max();
  uint64_t cursor = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < layout.slots.size(); ++i) {
      Slot& s = layout.slots[i];
      uint64_t* offset = pass == 0 ? &s.gradient_offset : &s.update_offset;
      if (!Place(s.bytes, &cursor, offset) || cursor > kMaxRegion) {
        return absl::InvalidArgumentError(absl::StrCat(
            Describe(i, views[i]), ": region size overflows ",
            "int64 when laying out its ", pass == 0 ? "gradient" : "update"));
      }
    }
  }
  layout.total_bytes = cursor;
  return layout;
}

std::vector<Chunk> SplitChunks(uint64_t bytes, uint64_t max_chunk) {
  std::vector<Chunk> chunks;
  if (max_chunk == 0 || bytes == 0) return chunks;
  chunks.reserve(bytes / max_chunk + 1);
  for (uint64_t offset = 0; offset < bytes;) {
    const uint64_t n = std::min(max_chunk, bytes - offset);
    chunks.push_back(Chunk{offset, n});
    offset += n;
  }
  return chunks;
}

uint64_t MaxChunkPayload(uint64_t max_message_bytes) {
  if (max_message_bytes <= kMessageOverheadBytes) return 1;
  return max_message_bytes - kMessageOverheadBytes;
}

}  // namespace dmuon::transport
