#include "kernels/cuda/lt_matmul.h"

#include <array>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/algo_fallback.h"
#include "kernels/cuda/check.h"

namespace dmuon::kernels::cuda {
namespace {

absl::Status MakeLayout(const plan::Operand& o, cudaDataType_t type,
                        int64_t batch, cublasLtMatrixLayout_t* layout) {
  DMUON_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(layout, type, static_cast<uint64_t>(o.rows),
                                 static_cast<uint64_t>(o.cols), o.ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    const int64_t stride = o.stride;
    DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
        sizeof(stride)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LtMatmul>> LtMatmul::Create(
    cublasLtHandle_t handle, const plan::Gemm& g, cudaDataType_t type,
    const std::array<int64_t, 4>& alignment, size_t workspace_bytes) {
  if (std::string err = plan::CheckGemm(g); !err.empty()) {
    return absl::InternalError(absl::StrCat("inconsistent GEMM: ", err));
  }
  if (g.batch > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch ", g.batch, " exceeds cuBLASLt's int32 count"));
  }
  std::unique_ptr<LtMatmul> mm(new LtMatmul());
  mm->description_ = plan::DescribeGemm(g);
  DMUON_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescCreate(&mm->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      mm->desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      mm->desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (auto st = MakeLayout(g.a, type, g.batch, &mm->a_); !st.ok()) return st;
  if (auto st = MakeLayout(g.b, type, g.batch, &mm->b_); !st.ok()) return st;
  if (auto st = MakeLayout(g.d, type, g.batch, &mm->cd_); !st.ok()) return st;

  cublasLtMatmulPreference_t pref = nullptr;
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  // Destroys the preference however this function returns.
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                  cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = workspace_bytes;
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const cublasLtMatmulPreferenceAttributes_t kAlignAttr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    const uint32_t bytes = static_cast<uint32_t>(alignment[i]);
    DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        pref, kAlignAttr[i], &bytes, sizeof(bytes)));
  }
  // Up to kHeuristicResults algorithms, best first; those that report an
  // error or need more workspace than there is are dropped here, the rest
  // are the run-time candidates (algo_fallback.h).
  std::array<cublasLtMatmulHeuristicResult_t, algo::kHeuristicResults>
      results{};
  int found = 0;
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
      handle, mm->desc_, mm->a_, mm->b_, mm->cd_, mm->cd_, pref,
      algo::kHeuristicResults, results.data(), &found));
  std::vector<algo::HeuristicResult> seen;
  for (int i = 0; i < found && i < algo::kHeuristicResults; ++i) {
    seen.push_back({results[i].state == CUBLAS_STATUS_SUCCESS,
                    static_cast<uint64_t>(results[i].workspaceSize)});
  }
  for (int i : algo::Usable(seen, workspace_bytes)) {
    mm->candidates_.push_back({results[i].algo, results[i].workspaceSize});
  }
  if (mm->candidates_.empty()) {
    return absl::InternalError(absl::StrCat(
        "cuBLASLt has no algorithm for ", mm->description_, " (alignments ",
        alignment[0], "/", alignment[1], "/", alignment[2], "/", alignment[3],
        " bytes; heuristic: ", algo::DescribeResults(seen, workspace_bytes),
        ")"));
  }
  mm->fallback_ = std::make_unique<algo::AlgoFallback>(
      static_cast<int>(mm->candidates_.size()), mm->description_);
  return mm;
}

LtMatmul::~LtMatmul() {
  // Destruction errors cannot be reported; the handles are released anyway.
  if (cd_ != nullptr) (void)cublasLtMatrixLayoutDestroy(cd_);
  if (b_ != nullptr) (void)cublasLtMatrixLayoutDestroy(b_);
  if (a_ != nullptr) (void)cublasLtMatrixLayoutDestroy(a_);
  if (desc_ != nullptr) (void)cublasLtMatmulDescDestroy(desc_);
}

absl::Status LtMatmul::Run(cublasLtHandle_t handle, float alpha, const void* a,
                           const void* b, float beta, const void* c, void* d,
                           void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  return fallback_->Run([&](int k) -> absl::Status {
    const Candidate& cand = candidates_[k];
    if (cand.workspace > workspace_bytes) {
      return absl::InternalError(absl::StrCat(
          description_, " algorithm candidate ", k, " needs ", cand.workspace,
          " workspace bytes, have ", workspace_bytes));
    }
    // NOT_SUPPORTED becomes UNIMPLEMENTED (check.h): the next candidate.
    DMUON_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmul(handle, desc_, &alpha, a, a_, b, b_, &beta, c, cd_, d,
                       cd_, &cand.algo, workspace, workspace_bytes, stream));
    return absl::OkStatus();
  });
}

}  // namespace dmuon::kernels::cuda
