// Plain data types shared by the core API, the CPU backend and the CUDA backend.
// Nothing here knows about Python, JAX or PyTorch.
#pragma once

#include <cstdint>
#include <string>

namespace groupgemm {

// Every floating-point dtype the core knows, one row each: enum name, the name messages
// use, bytes per element. The enum values follow the rows (f32 = 0, bf16 = 1, ...), so a
// new dtype goes last.
#define GROUPGEMM_DTYPES(X) \
  X(f32, "float32", 4)      \
  X(bf16, "bfloat16", 2)    \
  X(f16, "float16", 2)      \
  X(f64, "float64", 8)

enum class DType : int {
#define GG_DTYPE_ENUMERATOR(id, name, bytes) id,
  GROUPGEMM_DTYPES(GG_DTYPE_ENUMERATOR)
#undef GG_DTYPE_ENUMERATOR
};
enum class IndexType : int { i32 = 0, i64 = 1 };
enum class Device : int { cpu = 0, cuda = 1 };

#define GG_DTYPE_COUNT(id, name, bytes) +1
constexpr int kNumDTypes = 0 GROUPGEMM_DTYPES(GG_DTYPE_COUNT);
#undef GG_DTYPE_COUNT

inline int64_t dtype_size(DType t) {
  switch (t) {
#define GG_DTYPE_SIZE(id, name, bytes) \
  case DType::id: return bytes;
    GROUPGEMM_DTYPES(GG_DTYPE_SIZE)
#undef GG_DTYPE_SIZE
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
#define GG_DTYPE_NAME(id, name, bytes) \
  case DType::id: return name;
    GROUPGEMM_DTYPES(GG_DTYPE_NAME)
#undef GG_DTYPE_NAME
  }
  return "unknown";
}

// Result of every core entry point: ok, or a message a frontend can show as is.
struct Status {
  enum class Code : int { ok = 0, invalid_argument = 1, unimplemented = 2, internal = 3 };
  Code code = Code::ok;
  std::string message;

  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {Code::invalid_argument, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {Code::unimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::internal, std::move(m)}; }
  bool ok() const { return code == Code::ok; }
};

#define GG_RETURN_IF_ERROR(expr) \
  do {                           \
    Status s_ = (expr);          \
    if (!s_.ok()) return s_;     \
  } while (0)

// A 1-D integer array (group_sizes) or a scalar (group_offset, count == 1) that lives
// on the same device as the operands. The core reads it there: never a host copy.
struct IndexArray {
  const void* data = nullptr;  // nullptr means "absent" (group_offset defaults to 0)
  IndexType type = IndexType::i32;
  int64_t count = 0;
};

// Where and how to run: device, its stream (cudaStream_t on CUDA, ignored on CPU),
// and a caller-provided workspace (an XLA output buffer or a framework tensor), so the
// core never allocates device memory at run time.
struct ExecContext {
  Device device = Device::cpu;
  int device_index = -1;  // CUDA device of the operands; -1: the current device
  void* stream = nullptr;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// out[M, N] = lhs[M, K] @ rhs[g] (+ bias[g]) for the rows of local group g; padding rows 0.
// rhs is [G, K, N], or [G, N, K] when transpose_rhs. bias is [G, N] in in_dtype, or null.
// The dgrad of a grouped matmul is this same call on (dout, rhs, !transpose_rhs).
struct MatmulArgs {
  DType in_dtype = DType::f32;   // lhs, rhs and bias
  DType out_dtype = DType::f32;  // in_dtype, or float32 for 16-bit inputs
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;  // G: local experts held in rhs
  bool transpose_rhs = false;
  IndexArray group_sizes;   // [G_total] raw sizes; negative counts as 0
  IndexArray group_offset;  // scalar; global index of local group 0
};

// out[g] (=|+=) lhs_g^T @ grad_g over the rows of local group g. out is [G, K, N].
// accumulate: out is a float32 (float64 for float64 inputs) buffer updated in place and
// an empty group leaves out[g] bit-for-bit unchanged; otherwise an empty group gives 0.
struct WgradArgs {
  DType in_dtype = DType::f32;  // lhs and grad
  DType out_dtype = DType::f32;
  const void* lhs = nullptr;   // [M, K]
  const void* grad = nullptr;  // [M, N]
  void* out = nullptr;         // [G, K, N]
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  bool accumulate = false;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// out[g] = sum of grad rows of local group g (float32 accumulation, fixed row order).
struct BiasGradArgs {
  DType in_dtype = DType::f32;
  DType out_dtype = DType::f32;
  const void* grad = nullptr;  // [M, N]
  void* out = nullptr;         // [G, N]
  int64_t m = 0, n = 0;
  int64_t num_groups = 0;
  IndexArray group_sizes;
  IndexArray group_offset;
};

}  // namespace groupgemm
