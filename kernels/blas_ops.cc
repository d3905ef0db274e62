#include "kernels/blas_ops.h"

#include <cblas.h>

#include <algorithm>

#include "kernels/tiling.h"

namespace dmuon::kernels::blas {
namespace {

// Below this edge OpenBLAS's GEMM loses efficiency, so panels stay taller.
constexpr int64_t kMinPanelRows = 128;

// trans: a is k x m and c <- alpha a^T a + beta c; else a is m x k and
// c <- alpha a a^T + beta c.
void Syrk(CBLAS_TRANSPOSE trans, int64_t m, int64_t k, float alpha,
          const float* a, float beta, float* c) {
  cblas_ssyrk(CblasRowMajor, CblasUpper, trans, m, k, alpha, a,
              trans == CblasNoTrans ? k : m, beta, c, m);
}
void Syrk(CBLAS_TRANSPOSE trans, int64_t m, int64_t k, double alpha,
          const double* a, double beta, double* c) {
  cblas_dsyrk(CblasRowMajor, CblasUpper, trans, m, k, alpha, a,
              trans == CblasNoTrans ? k : m, beta, c, m);
}
void Gemm(CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}
void Gemm(CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb,
          double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, tb, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}

}  // namespace

template <typename T>
void MirrorUpper(T* c, int64_t m) {
  // Blocked so both the read (column walk) and the write stay in cache.
  constexpr int64_t kB = 64;
  for (int64_t ib = 0; ib < m; ib += kB) {
    for (int64_t jb = 0; jb <= ib; jb += kB) {
      const int64_t ie = std::min(ib + kB, m), je = std::min(jb + kB, m);
      for (int64_t i = ib; i < ie; ++i) {
        for (int64_t j = jb; j < std::min(je, i); ++j)
          c[i * m + j] = c[j * m + i];
      }
    }
  }
}

template <typename T>
void SymRankK(const T* a, int64_t m, int64_t k, T alpha, T beta, T* c) {
  Syrk(CblasNoTrans, m, k, alpha, a, beta, c);
  MirrorUpper(c, m);
}

template <typename T>
void SymRankKTransposed(const T* a, int64_t m, int64_t k, T alpha, T beta,
                        T* c) {
  Syrk(CblasTrans, m, k, alpha, a, beta, c);
  MirrorUpper(c, m);
}

template <typename T>
void SymProduct(const T* a, const T* b, int64_t m, T beta, T* c) {
  for (const Panel& p :
       UpperTrianglePanels(m, ChoosePanelRows(m, kMinPanelRows))) {
    Gemm(CblasNoTrans, p.rows, p.cols, m, T(1), a + p.row0 * m, m, b + p.col0,
         m, beta, c + p.row0 * m + p.col0, m);
  }
  MirrorUpper(c, m);
}

template <typename T>
void Gemm(const T* a, const T* x, int64_t m, int64_t n, T alpha, T beta, T* y) {
  Gemm(CblasNoTrans, m, n, m, alpha, a, m, x, n, beta, y, n);
}

template <typename T>
void GemmRight(const T* x, const T* a, int64_t n, int64_t m, T alpha, T beta,
               T* y) {
  Gemm(CblasNoTrans, n, m, m, alpha, x, m, a, m, beta, y, m);
}

template <typename T>
void GemmNT(const T* a, const T* b, int64_t m, int64_t n, int64_t k, T* c) {
  Gemm(CblasTrans, m, n, k, T(1), a, k, b, k, T(0), c, n);
}

#define DMUON_INSTANTIATE(T)                                                  \
  template void MirrorUpper<T>(T*, int64_t);                                  \
  template void SymRankK<T>(const T*, int64_t, int64_t, T, T, T*);            \
  template void SymRankKTransposed<T>(const T*, int64_t, int64_t, T, T, T*);  \
  template void SymProduct<T>(const T*, const T*, int64_t, T, T*);            \
  template void Gemm<T>(const T*, const T*, int64_t, int64_t, T, T, T*);      \
  template void GemmRight<T>(const T*, const T*, int64_t, int64_t, T, T, T*); \
  template void GemmNT<T>(const T*, const T*, int64_t, int64_t, int64_t, T*);
DMUON_INSTANTIATE(float)
DMUON_INSTANTIATE(double)
#undef DMUON_INSTANTIATE

}  // namespace dmuon::kernels::blas
