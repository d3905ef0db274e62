#include "kernels/cuda/lt_matmul.h"

#include <limits>

#include "absl/strings/str_cat.h"
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
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  DMUON_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulAlgoGetHeuristic(handle, mm->desc_, mm->a_, mm->b_, mm->cd_,
                                     mm->cd_, pref, 1, &result, &found));
  if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuBLASLt has no algorithm for ", mm->description_,
                     " (alignments ", alignment[0], "/", alignment[1], "/",
                     alignment[2], "/", alignment[3], " bytes)"));
  }
  mm->algo_ = result.algo;
  mm->workspace_needed_ = result.workspaceSize;
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
                           cudaStream_t stream) const {
  if (workspace_needed_ > workspace_bytes) {
    return absl::InternalError(
        absl::StrCat(description_, " needs ", workspace_needed_,
                     " workspace bytes, have ", workspace_bytes));
  }
  DMUON_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmul(handle, desc_, &alpha, a, a_, b, b_, &beta, c, cd_, d, cd_,
                     &algo_, workspace, workspace_bytes, stream));
  return absl::OkStatus();
}

}  // namespace dmuon::kernels::cuda
