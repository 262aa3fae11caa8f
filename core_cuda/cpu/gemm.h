// One dense GEMM on the CPU through a real library:
//   C[m, n] (+)= op(A)[m, k] @ op(B)[k, n] (+ bias[n])
// A and B are row-major; a "transposed" operand X[r, c] is stored as [c, r].
// float32 and bfloat16 go to oneDNN (AVX-512 / AMX kernels, fp32 accumulation; on a CPU
// where its bfloat16 kernels are missing or slower, bfloat16 is widened to float32 here),
// float64 to OpenBLAS. float16 is widened by the caller (oneDNN 3.2 has no fast f16
// matmul with run-time shapes). Callers never pass m, n or k == 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "groupgemm/types.h"

namespace groupgemm {
namespace cpu {

struct PackedB;

struct GemmCall {
  DType in_dtype;   // A, B and bias
  DType out_dtype;  // C
  int64_t m, n, k;
  const void* a;
  bool a_transposed;
  const void* b;
  bool b_transposed;
  const void* bias;  // [n] or null
  void* c;
  bool accumulate;  // C += ... instead of C = ...
  const PackedB* packed_b = nullptr;  // b as pack_b left it for calls of this shape, or null
};

// A call's B in the layout the library's kernel reads, with the kernel. oneDNN's AMX
// kernel otherwise copies a row-major or transposed B into that layout inside every call,
// and again for each block of rows a thread takes: measured here on one thread, bfloat16
// GEMMs of 256 to 16384 rows took 13-30% less time on a packed B, with the same bits.
struct PackedB {
  std::shared_ptr<const void> kernel;  // the library's primitive for this layout
  const void* data = nullptr;          // B in it
};

// B of `call` packed into `storage` (kept by the caller and reused), for calls that
// differ from `call` only in m, a and c; nullopt where the call's kernel reads B as it is
// (every call but a bfloat16 one with a row-major A, and every call on a CPU without AMX:
// on an AVX-512 BF16 CPU, grouped bfloat16 GEMMs of 256 to 4096 rows per group ran at
// 0.94-1.16x of their time with B packed once, so there it is not). On a CPU that widens
// bfloat16 (cpu_widens_bf16) the packed B is B widened to float32 (row-major on AVX-512
// CPUs), once for all the calls;
// on an AVX-512 CPU a float32 B stored transposed is B copied row-major (gemm_onednn.cpp:
// the kernel's transposed read has other bits on one thread than on several).
std::optional<PackedB> pack_b(const GemmCall& call, std::vector<char>& storage);

// Whether pack_b packs a bfloat16 B on this CPU (with AMX, or widening bfloat16).
bool cpu_packs_b();

// Whether bfloat16 calls run widened to float32 on this CPU, the float32 kernel's sums
// rounded once: where oneDNN has no bfloat16 kernel (before AVX-512) or its bfloat16
// kernels are the slower (gemm_onednn.cpp: Intel's AVX-512 CPUs without AMX).
bool cpu_widens_bf16();

// Where the CPU has bfloat16 kernels, a call of fewer rows than this (m, or k for a weight
// gradient) still runs on them, unless B comes widened (pack_b): widening its B costs more
// than the float32 kernel saves. Measured on the Emerald Rapids VM without AMX (grouped
// GEMMs of 8192 rows, K = N = 1024, 2 threads), bfloat16 kernels against widened: 92
// against 82 GFLOP/s forward and 85 against 67 weight gradient at 16 rows a group, 104
// against 132 and 100 against 114 at 32, 141 against 235 from 256.
constexpr int64_t kMinWidenedRows = 32;

// Whether gemm runs this bfloat16 call widened to float32.
bool runs_widened(const GemmCall& call);

// bfloat16 weight-gradient GEMMs run their contraction in chunks of a multiple of this
// many rows (the AMX kernel's K blocking); a chunk of another length is copied, padded with
// zero rows.
constexpr int64_t kContractionStep = 64;

// gemm packs B itself (unless the call brings it packed) from this many rows on, where one
// packing costs less than the kernel's copies. Measured on one thread with a [1536, 1024]
// bfloat16 B: packing it took 0.29 ms, what a GEMM of 64 to 256 rows saves by reading it
// packed; at 512 rows the packing paid for itself and saved 0.3 ms more, at 4096 rows
// 6.4 ms more (of 22 ms).
constexpr int64_t kMinPackedRows = 256;

Status gemm(const GemmCall& call);

// How gemm(call) may be threaded and keep the bits it has on one thread.
enum class Threading {
  own,  // float64 (OpenBLAS, a test dtype): one GEMM after another, on the calling thread
  any,  // side by side with others on one thread each, or alone on all threads
  one,  // one thread only, side by side with others
};
Threading gemm_threading(const GemmCall& call);

// The float32 / bfloat16 path of gemm (gemm_onednn.cpp).
Status gemm_onednn(const GemmCall& call);

// Whether oneDNN's kernel for the call may give other bits on several threads than on one
// (both bfloat16 weight-gradient kernels split their contraction; on AVX2 CPUs every kernel
// may). Its other kernels keep one thread's bits on all.
bool onednn_bits_depend_on_threads(const GemmCall& call);

// gemm_onednn keeps the oneDNN primitives it created, the least recently used evicted
// past this many.
constexpr size_t kOnednnCacheCapacity = 256;

// How many primitives it holds now.
size_t onednn_cached_primitives();

// For the tests: bfloat16 weight gradients in padded fixed-length chunks (true), as one
// all-run-time GEMM (false), or as the CPU suits (nullopt: see gemm_onednn.cpp). Not
// thread-safe: set it while no GEMM runs.
void force_bf16_wgrad_chunks(std::optional<bool> chunks);

// For the tests: bfloat16 calls widened to float32 (true: as on a CPU without bfloat16
// kernels), run by oneDNN's bfloat16 kernels (false), or as the CPU allows (nullopt). Not
// thread-safe, as above.
void force_bf16_widened(std::optional<bool> widened);

}  // namespace cpu
}  // namespace groupgemm
