// Test oracles for Newton–Schulz (test-only).
//
// NS with scalar polynomial steps acts on singular values: for G = U S V^T,
// NS(G) = U f(S) V^T with f = p_k o ... o p_1 applied to the normalized
// singular values, p(s) = a s + b s^3 + c s^5. This computes that exactly in
// fp64 from an SVD (LAPACK dgesvd), independently of the implementation.

#ifndef DMUON_KERNELS_TESTING_ORACLE_H_
#define DMUON_KERNELS_TESTING_ORACLE_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/kernels.h"

namespace dmuon::kernels::testing {

// NS(g) via the SVD, row-major rows x cols, fp64.
std::vector<double> SvdOracle(const std::vector<double>& g, Shape shape,
                              const NsOptions& options);

// Singular values of a row-major matrix, descending.
std::vector<double> SingularValues(const std::vector<double>& g, Shape shape);

// i.i.d. standard normal entries.
std::vector<double> RandomNormal(Shape shape, std::mt19937_64& rng);

// U diag(s) V^T with Haar-random orthogonal factors and singular values
// log-spaced over [lo, hi] (min(rows, cols) of them).
std::vector<double> RandomWithSpectrum(Shape shape, double lo, double hi,
                                       std::mt19937_64& rng);

// ||a - b||_F / ||b||_F.
double RelativeError(const std::vector<double>& a,
                     const std::vector<double>& b);

std::vector<float> ToFloat(const std::vector<double>& v);
std::vector<double> ToDouble(const std::vector<float>& v);

}  // namespace dmuon::kernels::testing

#endif  // DMUON_KERNELS_TESTING_ORACLE_H_
