// Internal: the dense products Newton–Schulz needs, over OpenBLAS, for float
// and double. Row-major, dense (leading dimension == columns). Products whose
// result is symmetric compute the upper triangle only (syrk, or the row
// panels of kernels/tiling.h) and mirror it, so callers always get the full
// matrix.

#ifndef DMUON_KERNELS_BLAS_OPS_H_
#define DMUON_KERNELS_BLAS_OPS_H_

#include <cstdint>

namespace dmuon::kernels::blas {

// c (m x m) <- alpha * a a^T + beta * c, where a is m x k; c's input must be
// symmetric when beta != 0. Full result written.
template <typename T>
void SymRankK(const T* a, int64_t m, int64_t k, T alpha, T beta, T* c);

// The same product of a matrix stored transposed: c (m x m) <- alpha *
// a^T a + beta * c, where a is k x m (the m x k matrix in column-major
// order, as a tall matrix holds its wide transpose).
template <typename T>
void SymRankKTransposed(const T* a, int64_t m, int64_t k, T alpha, T beta,
                        T* c);

// c (m x m) <- a b + beta * c for m x m a, b whose product is known to be
// symmetric (commuting symmetric matrices); c must be symmetric when
// beta != 0. Computes the upper-triangle panels, then mirrors.
template <typename T>
void SymProduct(const T* a, const T* b, int64_t m, T beta, T* c);

// y (m x n) <- alpha * a x + beta * y, a m x m, x m x n. y must not alias x.
template <typename T>
void Gemm(const T* a, const T* x, int64_t m, int64_t n, T alpha, T beta, T* y);

// y (n x m) <- alpha * x a + beta * y, x n x m, a m x m. For a symmetric
// a this is Gemm's product on transposes (y^T = alpha * a x^T + beta *
// y^T), which is what Newton–Schulz uses it for. y must not alias x.
template <typename T>
void GemmRight(const T* x, const T* a, int64_t n, int64_t m, T alpha, T beta,
               T* y);

// General c (m x n) <- a (m x k) b^T (n x k): the benchmark's peak product.
template <typename T>
void GemmNT(const T* a, const T* b, int64_t m, int64_t n, int64_t k, T* c);

// Copies the upper triangle of c (m x m) onto the lower one.
template <typename T>
void MirrorUpper(T* c, int64_t m);

}  // namespace dmuon::kernels::blas

#endif  // DMUON_KERNELS_BLAS_OPS_H_
