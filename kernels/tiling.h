// Tile schedules for products whose result is symmetric.
//
// X X^T, A A (A symmetric) and, in Gram mode, every product of two commuting
// symmetric matrices have a symmetric result, so only the upper triangle
// needs computing: the m x m result is cut into row panels, and panel p
// computes rows [row0, row0 + rows) x columns [row0, m) with one GEMM. A
// mirror pass then copies the upper triangle to the lower. The CPU and CUDA
// implementations share this schedule; it is plain C++ so it is tested here.

#ifndef DMUON_KERNELS_TILING_H_
#define DMUON_KERNELS_TILING_H_

#include <cstdint>
#include <vector>

namespace dmuon::kernels {

// One GEMM of a triangle-only product: C[row0 : row0+rows, col0 : col0+cols].
struct Panel {
  int64_t row0 = 0;
  int64_t rows = 0;
  int64_t col0 = 0;
  int64_t cols = 0;
};

// Row panels covering the upper triangle (diagonal included) of an m x m
// result, each `panel_rows` tall (the last may be shorter), col0 == row0 and
// cols == m - row0. Every upper element is covered exactly once; elements
// below the diagonal are computed only inside diagonal blocks.
// panel_rows <= 0 or >= m gives one panel: the full product.
std::vector<Panel> UpperTrianglePanels(int64_t m, int64_t panel_rows);

// A panel height for an m x m triangle product: small enough that the
// triangle saves work, large enough that every GEMM stays efficient.
// `min_rows` is the smallest GEMM edge the backend runs at full rate.
int64_t ChoosePanelRows(int64_t m, int64_t min_rows);

// Multiply-adds of an m x m x k triangle product over `panels`, counted as
// 2 * rows * cols * k each (what the GEMMs execute).
double PanelFlops(const std::vector<Panel>& panels, int64_t k);

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_TILING_H_
