// Device buffers and device-I/O gather/scatter (cuda_executor_io.h).

#include "server/cuda/cuda_executor_io.h"

#include "absl/status/statusor.h"
#include "base/cuda_status.h"
#include "kernels/cuda/elementwise_kernels.h"
#include "server/gpu_logic.h"

namespace dmuon::server::gpu {
namespace {

// dst (on `dst_device`) <- src (on `src_device`); negative: the executor's.
absl::Status Copy(void* dst, int dst_device, const void* src, int src_device,
                  size_t bytes, const IoContext& c) {
  if (dst_device < 0) dst_device = c.device;
  if (src_device < 0) src_device = c.device;
  if (dst_device == src_device) {
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c.stream));
  } else {
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, c.stream));
  }
  return absl::OkStatus();
}

// Every rectangle of `map` from `src` to `dst`, both on this executor's
// device: a local tensor into the matrix (`cols` columns) when `to_matrix`,
// else the matrix into a local tensor. One 2-D copy per rectangle.
absl::Status CopyBlocks(const ShardMap& map, int64_t cols, const float* src,
                        float* dst, bool to_matrix, const IoContext& c) {
  const size_t lpitch = map.local_cols() * sizeof(float);
  const size_t mpitch = cols * sizeof(float);
  for (const Block& b : map.Blocks()) {
    const int64_t m = b.row * cols + b.col;
    const int64_t l = b.local_row * map.local_cols() + b.local_col;
    DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        dst + (to_matrix ? m : l), to_matrix ? mpitch : lpitch,
        src + (to_matrix ? l : m), to_matrix ? lpitch : mpitch,
        b.width * sizeof(float), b.height, cudaMemcpyDeviceToDevice, c.stream));
  }
  return absl::OkStatus();
}

bool Elsewhere(const DevicePart& p, const IoContext& c) {
  return p.device >= 0 && p.device != c.device;
}

// p's gradient (`bytes` long) where this executor's device can read it: in
// place, or staged from a peer GPU into c.peer_temp (valid until the next
// staging).
absl::StatusOr<const float*> Readable(const DevicePart& p, size_t bytes,
                                      const IoContext& c) {
  if (!Elsewhere(p, c)) return p.grad;
  if (auto st = c.peer_temp->Ensure(bytes, c.stream); !st.ok()) return st;
  if (auto st = Copy(c.peer_temp->data(), c.device, p.grad, p.device, bytes, c);
      !st.ok()) {
    return st;
  }
  return c.peer_temp->floats();
}

}  // namespace

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

absl::Status DeviceBuffer::Ensure(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_) return absl::OkStatus();
  DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (data_ != nullptr) DMUON_CUDA_RETURN_IF_ERROR(cudaFree(data_));
  data_ = nullptr;
  bytes_ = 0;
  DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status GatherGradient(const ComputeTask& t, float* slot,
                            const IoContext& c) {
  const DeviceIo& io = *t.device_io;
  const int64_t n = t.shape.elements(), cols = t.shape.cols;
  const size_t bytes = n * sizeof(float);
  if (io.parts.empty()) return absl::InternalError("device task without parts");
  const DevicePart& first = io.parts[0];
  switch (io.gather) {
    case Gather::kFirst:
      return Copy(slot, c.device, first.grad, first.device, bytes, c);
    case Gather::kRows:
      for (const DevicePart& p : io.parts) {
        const RowBytes r = RowsOf(p.row_begin, p.row_end, cols);
        if (auto st = Copy(reinterpret_cast<char*>(slot) + r.offset, c.device,
                           p.grad, p.device, r.bytes, c);
            !st.ok()) {
          return st;
        }
      }
      return absl::OkStatus();
    case Gather::kBlocks: {
      // Each distinct map once, from its lowest holder (DistinctHolders),
      // highest first, so an element several parts hold (replicas) ends as
      // the lowest's. A part on another GPU is first copied whole into
      // peer_temp (stream order keeps the reuse safe).
      std::vector<const ShardMap*> maps;
      for (const DevicePart& p : io.parts) maps.push_back(&p.map);
      const std::vector<int> holders = DistinctHolders(maps);
      for (auto k = holders.rbegin(); k != holders.rend(); ++k) {
        const DevicePart& p = io.parts[*k];
        auto src = Readable(p, p.map.elements() * sizeof(float), c);
        if (!src.ok()) return src.status();
        if (auto st =
                CopyBlocks(p.map, cols, *src, slot, /*to_matrix=*/true, c);
            !st.ok()) {
          return st;
        }
      }
      return absl::OkStatus();
    }
    case Gather::kMean: {
      // The host's order and rounding: sum in part order, then * (1/W). A
      // part without a gradient (its rank declared the parameter absent)
      // adds zeros: it is left out of the sum, not out of W.
      size_t k0 = 0;
      while (k0 < io.parts.size() && io.parts[k0].grad == nullptr) ++k0;
      if (k0 == io.parts.size()) {
        DMUON_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(slot, 0, bytes, c.stream));
        return absl::OkStatus();
      }
      const DevicePart& p0 = io.parts[k0];
      if (auto st = Copy(slot, c.device, p0.grad, p0.device, bytes, c);
          !st.ok()) {
        return st;
      }
      for (size_t k = k0 + 1; k < io.parts.size(); ++k) {
        const DevicePart& p = io.parts[k];
        if (p.grad == nullptr) continue;
        auto src = Readable(p, bytes, c);
        if (!src.ok()) return src.status();
        DMUON_CUDA_RETURN_IF_ERROR(
            kernels::cuda::device::LaunchAccumulate(*src, slot, n, c.stream));
      }
      const float inv = 1.0f / static_cast<float>(io.parts.size());
      DMUON_CUDA_RETURN_IF_ERROR(
          kernels::cuda::device::LaunchScale(slot, slot, n, inv, c.stream));
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unknown gather mode");
}

absl::Status ScatterUpdate(const ComputeTask& t, const float* slot,
                           const IoContext& c) {
  const int64_t cols = t.shape.cols;
  for (const DevicePart& p : t.device_io->parts) {
    if (t.device_io->gather == Gather::kBlocks) {
      if (p.map.empty()) continue;
      if (!Elsewhere(p, c)) {
        if (auto st = CopyBlocks(p.map, cols, slot, p.update, false, c);
            !st.ok()) {
          return st;
        }
        continue;
      }
      const size_t local = p.map.elements() * sizeof(float);
      if (auto st = c.peer_temp->Ensure(local, c.stream); !st.ok()) return st;
      if (auto st =
              CopyBlocks(p.map, cols, slot, c.peer_temp->floats(), false, c);
          !st.ok()) {
        return st;
      }
      if (auto st =
              Copy(p.update, p.device, c.peer_temp->data(), c.device, local, c);
          !st.ok()) {
        return st;
      }
      continue;
    }
    const RowBytes r = t.device_io->gather == Gather::kRows
                           ? RowsOf(p.row_begin, p.row_end, cols)
                           : RowsOf(0, t.shape.rows, cols);
    if (auto st = Copy(p.update, p.device,
                       reinterpret_cast<const char*>(slot) + r.offset, c.device,
                       r.bytes, c);
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server::gpu
