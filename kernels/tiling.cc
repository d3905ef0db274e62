#include "kernels/tiling.h"

#include <algorithm>

namespace dmuon::kernels {

std::vector<Panel> UpperTrianglePanels(int64_t m, int64_t panel_rows) {
  std::vector<Panel> panels;
  if (m <= 0) return panels;
  if (panel_rows <= 0 || panel_rows >= m) panel_rows = m;
  for (int64_t r = 0; r < m; r += panel_rows) {
    Panel p;
    p.row0 = r;
    p.rows = std::min(panel_rows, m - r);
    p.col0 = r;
    p.cols = m - r;
    panels.push_back(p);
  }
  return panels;
}

int64_t ChoosePanelRows(int64_t m, int64_t min_rows) {
  // Up to 8 panels: with k panels the GEMMs execute (k + 1) / (2k) of the
  // full product; past 8 the saving grows little while launches multiply.
  if (min_rows <= 0) min_rows = 1;
  int64_t k = std::min<int64_t>(8, m / min_rows);
  if (k <= 1) return m;
  return (m + k - 1) / k;
}

double PanelFlops(const std::vector<Panel>& panels, int64_t k) {
  double flops = 0;
  for (const Panel& p : panels) {
    flops += 2.0 * static_cast<double>(p.rows) * static_cast<double>(p.cols) *
             static_cast<double>(k);
  }
  return flops;
}

}  // namespace dmuon::kernels
