// The inline transport's region: plain zero-filled heap memory; and
// Region's default Read/Write, which copy through bytes().

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace dmuon::transport {
namespace {

absl::Status CheckRange(uint64_t offset, uint64_t n, uint64_t size) {
  if (offset <= size && n <= size - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset,
                                            " + ", n, ") are outside the ",
                                            size, "-byte region"));
}

class HeapRegion final : public Region {
 public:
  HeapRegion(std::byte* data, uint64_t size) : data_(data), size_(size) {}
  ~HeapRegion() override { std::free(data_); }
  HeapRegion(const HeapRegion&) = delete;
  HeapRegion& operator=(const HeapRegion&) = delete;

  absl::Span<std::byte> bytes() override { return {data_, size_}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }

 private:
  std::byte* data_;  // owned; from calloc
  size_t size_;
  const std::string name_;  // always empty
};

}  // namespace

absl::Status Region::Read(uint64_t offset, void* out, uint64_t n) {
  const absl::Span<std::byte> b = bytes();
  if (auto st = CheckRange(offset, n, b.size()); !st.ok()) return st;
  if (n > 0) std::memcpy(out, b.data() + offset, n);
  return absl::OkStatus();
}

absl::Status Region::Write(uint64_t offset, const void* in, uint64_t n) {
  const absl::Span<std::byte> b = bytes();
  if (auto st = CheckRange(offset, n, b.size()); !st.ok()) return st;
  if (n > 0) std::memcpy(b.data() + offset, in, n);
  return absl::OkStatus();
}

std::unique_ptr<Region> NewHeapRegion(uint64_t bytes) {
  // calloc: large blocks come from fresh zero pages, so nothing is touched
  // (or committed) until the tensors are written.
  void* data = std::calloc(bytes == 0 ? 1 : bytes, 1);
  if (data == nullptr) throw std::bad_alloc();
  return std::make_unique<HeapRegion>(static_cast<std::byte*>(data), bytes);
}

}  // namespace dmuon::transport
