#include "gemm.h"

#include <cblas.h>

#include <limits>

#include "run_time_libraries.h"

// OpenBLAS through run_time_libraries.h: the functions the core calls.
#define scipy_cblas_dgemm GG_RUN_TIME_FUNCTION(kOpenblasLibrary, scipy_cblas_dgemm)
#define scipy_openblas_set_num_threads GG_RUN_TIME_FUNCTION(kOpenblasLibrary, scipy_openblas_set_num_threads)

namespace groupgemm {
namespace cpu {
namespace {

// float64 (CPU-only, for numerical checks) through OpenBLAS; its 32-bit interface
// bounds every dimension. On the calling thread: OpenBLAS's own threads split a weight
// gradient's contraction (so its bits depended on their number), and they keep the float
// mode they started in, not the core's (float_mode.h). The core's copy of OpenBLAS is its
// own (loaded privately, groupgemm/_libs.py), so this touches no one else's.
Status gemm_openblas_f64(const GemmCall& c) {
  constexpr int64_t kMax = std::numeric_limits<blasint>::max();
  if (c.m > kMax || c.n > kMax || c.k > kMax)
    return Status::Invalid("float64 GEMM dimensions must fit in 32 bits");
  static const bool one_thread = [] {
    scipy_openblas_set_num_threads(1);
    return true;
  }();
  (void)one_thread;
  auto* out = static_cast<double*>(c.c);
  double beta = c.accumulate ? 1.0 : 0.0;
  if (c.bias) {  // C = bias + A @ B: seed C with the bias row
    const auto* bias = static_cast<const double*>(c.bias);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) out[i * c.n + j] = (c.accumulate ? out[i * c.n + j] : 0.0) + bias[j];
    beta = 1.0;
  }
  const blasint lda = static_cast<blasint>(c.a_transposed ? c.m : c.k);
  const blasint ldb = static_cast<blasint>(c.b_transposed ? c.k : c.n);
  scipy_cblas_dgemm(CblasRowMajor, c.a_transposed ? CblasTrans : CblasNoTrans,
                    c.b_transposed ? CblasTrans : CblasNoTrans, static_cast<blasint>(c.m),
                    static_cast<blasint>(c.n), static_cast<blasint>(c.k), 1.0,
                    static_cast<const double*>(c.a), lda, static_cast<const double*>(c.b), ldb, beta, out,
                    static_cast<blasint>(c.n));
  return Status::Ok();
}

}  // namespace

Status gemm(const GemmCall& c) {
  if (c.in_dtype == DType::f64) return gemm_openblas_f64(c);
  if (c.in_dtype == DType::f16) return Status::Internal("float16 must be widened before gemm");
  return gemm_onednn(c);
}

Threading gemm_threading(const GemmCall& c) {
  if (c.in_dtype == DType::f64) return Threading::own;  // OpenBLAS, a test dtype
  return onednn_bits_depend_on_threads(c) ? Threading::one : Threading::any;
}

}  // namespace cpu
}  // namespace groupgemm
