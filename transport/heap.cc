// The inline transport's region: plain zero-filled heap memory.

#include <cstdlib>
#include <memory>
#include <new>
#include <string>

#include "absl/types/span.h"
#include "transport/transport.h"

namespace dmuon::transport {
namespace {

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

std::unique_ptr<Region> NewHeapRegion(uint64_t bytes) {
  // calloc: large blocks come from fresh zero pages, so nothing is touched
  // (or committed) until the tensors are written.
  void* data = std::calloc(bytes == 0 ? 1 : bytes, 1);
  if (data == nullptr) throw std::bad_alloc();
  return std::make_unique<HeapRegion>(static_cast<std::byte*>(data), bytes);
}

}  // namespace dmuon::transport
