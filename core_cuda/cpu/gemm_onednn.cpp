// float32 / bfloat16 GEMM through oneDNN matmul primitives.
//
// Group sizes change every training step, so the dimension that follows them is a
// run-time value (DNNL_RUNTIME_DIM_VAL) wherever oneDNN keeps its fast kernel that way,
// and no call pays oneDNN's JIT cost after the first for its primitive. Which
// dimensions are fixed decides the kernel:
//  - bfloat16 forward / dgrad (rows vary, K and N are the layer's): only M is run-time,
//    one primitive per (K, N). On AMX CPUs oneDNN 3.2 then picks its AMX brgemm kernel,
//    generated for the known K and N, rather than the GEMM-based one it picks when every
//    dimension is run-time (on AVX-512 CPUs both choices give its GEMM-based kernel).
//  - bfloat16 weight gradients (the contraction is the group's rows): oneDNN 3.2 picks
//    brgemm only when every dimension is fixed, so the contraction runs in chunks whose
//    length is rounded up to a multiple of kContractionStep with zero rows, one
//    primitive per (M, N, chunk length): copying a chunk to pad it costs far less than
//    brgemm saves over the all-run-time kernel on AMX CPUs, and there are at most
//    kMaxChunk / kContractionStep lengths per layer. Without AMX (AVX-512 bf16) brgemm
//    only matches the all-run-time GEMM kernel, and padding costs (3x the work at 16
//    rows; a copy of the group), so groups under kMinChunkedRows rows run all-run-time
//    there. Both kernels may split a contraction across threads, which changes the order
//    of its sums: the all-run-time one on a long contraction with a small output, brgemm
//    too (measured: 4096 rows into a 1024 x 64 gradient, a router's 8192 rows into
//    512 x 8, two experts' 32 x 32 of 2048 rows each, alone). So every bfloat16 weight
//    gradient runs on one thread (gemm_threading), side by side with others.
//    On AMX CPUs, a forward / dgrad call of kMinPackedRows rows or more first packs its B
//    into the kernel's own layout (pack_b, gemm.h), with a second primitive per (K, N)
//    that reads B that way; a caller with several calls on one B packs it once for all.
//  - float32: every dimension and stride is run-time, one primitive per layout; oneDNN
//    has no faster choice there (packing its B measured no faster).
//  - bfloat16 where oneDNN's bfloat16 kernels are missing or slower than its float32 one
//    (bf16_kernels_pay): float32's primitives on the operands widened (execute_widened).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "convert.h"
#include "float_mode.h"
#include "gemm.h"
#include "lru_cache.h"
#include "onednn.h"

namespace groupgemm {
namespace cpu {
namespace {

using dnnl::memory;
constexpr auto kRuntime = DNNL_RUNTIME_DIM_VAL;

memory::data_type onednn_type(DType t) {
  return t == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// Strides of X[r, c]: row-major, or stored as [c, r] when transposed.
memory::dims strides(bool transposed, int64_t rows, int64_t cols) {
  return transposed ? memory::dims{1, rows} : memory::dims{cols, 1};
}

// oneDNN keeps a primitive cache of its own (1024 primitives by default), which would hold
// on to every primitive primitive_cache() below evicts and so defeat its bound. That cache
// is the one this file relies on: oneDNN's is turned off, unless the environment sets its
// capacity.
void turn_off_onednn_primitive_cache() {
  if (!std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") && !std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY"))
    dnnl::set_primitive_cache_capacity(0);
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine = [] {
    turn_off_onednn_primitive_cache();  // before any primitive is created
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return engine;
}

std::optional<bool> forced_bf16_wgrad_chunks;

bool cpu_has_amx() {
  static const bool amx = [] {
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx512_core_amx || isa == dnnl::cpu_isa::avx512_core_amx_fp16;
  }();
  return amx;
}

bool cpu_has_avx512() {
  static const bool avx512 = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto core = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);  // a bit mask of the ISA's features
    return (isa & core) == core;
  }();
  return avx512;
}

// Which dimensions of a call's primitive are fixed (see the top of the file).
bool fixed_k_and_n(const GemmCall& c) { return c.in_dtype == DType::bf16 && !c.a_transposed; }
constexpr int64_t kMinChunkedRows = 512;
bool fixed_contraction(const GemmCall& c) {
  return c.in_dtype == DType::bf16 && c.a_transposed &&
         forced_bf16_wgrad_chunks.value_or(cpu_has_amx() || c.k >= kMinChunkedRows);
}

constexpr int64_t kMaxChunk = 2048;
// Padding a chunk copies it; this bounds that scratch for very wide layers.
constexpr int64_t kMaxPaddedBytes = int64_t(16) << 20;

int64_t round_up(int64_t v, int64_t step) { return (v + step - 1) / step * step; }

// Rows of the contraction per chunk for a fixed_contraction call.
int64_t contraction_chunk(const GemmCall& c) {
  const int64_t fits = kMaxPaddedBytes / ((c.m + c.n) * int64_t(sizeof(bf16_t)));
  return std::clamp(fits / kContractionStep * kContractionStep, kContractionStep, kMaxChunk);
}

// dtypes, layout, bias, accumulate, and M, N, K when they are fixed (else 0); and whether
// B is packed (pack_b).
using Key = std::tuple<DType, DType, bool, bool, bool, bool, int64_t, int64_t, int64_t, bool>;

struct Primitive {
  dnnl::matmul matmul;
  // Bytes of scratch memory one execution needs. The scratchpad is the caller's (user
  // mode): with oneDNN's own, concurrent executions of one brgemm primitive share it
  // and corrupt each other's results.
  size_t scratchpad_bytes;
  Key key;
  // A packed-B primitive's B layout, and the reorder that packs a B into it.
  std::optional<dnnl::memory::desc> packed_b;
  std::optional<dnnl::reorder> pack;
};

// The primitives calls created, the least recently used evicted past kOnednnCacheCapacity.
// One expert MLP shape (two weights) needs up to about 140 bfloat16 training primitives,
// most of them its weight gradients' tail chunk lengths, so the capacity keeps those
// resident; and it bounds the memory: a primitive holds its generated kernel code and
// descriptors, at most a few hundred KB, so the cache stays under about 100 MB however
// many shapes a process sees.
LruCache<Key, Primitive>& primitive_cache() {
  static LruCache<Key, Primitive> cache(kOnednnCacheCapacity);
  return cache;
}

Key key_of(const GemmCall& c, bool packed) {
  const bool all_fixed = fixed_contraction(c), fixed = all_fixed || fixed_k_and_n(c);
  return {c.in_dtype,   c.out_dtype,         c.a_transposed,  c.b_transposed, c.bias != nullptr,
          c.accumulate, all_fixed ? c.m : 0, fixed ? c.k : 0, fixed ? c.n : 0, packed};
}

// A packed B's calls: bfloat16 with only M run-time (K and N fix the layout), on an AMX CPU
// (the kernel measured; without AMX oneDNN picks another, unmeasured there).
bool packable(const GemmCall& c) { return fixed_k_and_n(c) && !fixed_contraction(c) && cpu_has_amx(); }

Primitive create_primitive(const GemmCall& c, bool packed) {
  const bool all_fixed = fixed_contraction(c), fixed = all_fixed || fixed_k_and_n(c);
  // Run-time sizes and leading dimensions; which stride is 1 is fixed at creation (with
  // both strides unknown oneDNN 3.2 falls back to its reference kernel).
  const memory::dim m = all_fixed ? c.m : kRuntime, k = fixed ? c.k : kRuntime, n = fixed ? c.n : kRuntime;
  const memory::desc a({m, k}, onednn_type(c.in_dtype),
                       c.a_transposed ? memory::dims{1, m} : memory::dims{k, 1});
  const memory::desc given_layout({k, n}, onednn_type(c.in_dtype),
                                  c.b_transposed ? memory::dims{1, k} : memory::dims{n, 1});
  const memory::desc b =
      packed ? memory::desc({k, n}, onednn_type(c.in_dtype), memory::format_tag::any) : given_layout;
  const memory::desc out({m, n}, onednn_type(c.out_dtype), memory::dims{n, 1});
  const memory::desc bias =
      c.bias ? memory::desc({1, n}, onednn_type(c.in_dtype), memory::dims{n, 1}) : memory::desc();
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (c.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd(cpu_engine(), a, b, bias, out, attr);
  // The reference kernel is orders of magnitude slower: treat picking it as a bug.
  const std::string impl = pd.impl_info_str();
  if (impl.rfind("ref", 0) == 0) throw std::runtime_error("oneDNN chose its reference kernel: " + impl);
  Primitive made{dnnl::matmul(pd), pd.scratchpad_desc().get_size(), key_of(c, packed), std::nullopt, std::nullopt};
  if (packed) {
    made.packed_b = pd.weights_desc();
    dnnl::primitive_attr user_scratchpad;
    user_scratchpad.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::reorder::primitive_desc pack(cpu_engine(), given_layout, cpu_engine(), *made.packed_b, user_scratchpad);
    // Threads pack at once with one reorder, so it must need no scratchpad (those measured
    // need none); else pack_b declines and the calls read B as given.
    if (pack.scratchpad_desc().get_size() != 0) throw std::runtime_error("oneDNN's packing of B needs a scratchpad");
    made.pack = dnnl::reorder(pack);
  }
  return made;
}

// Held by the caller while it executes, so an eviction by another thread cannot free it.
std::shared_ptr<const Primitive> cached_primitive(const GemmCall& c, bool packed) {
  const Key key = key_of(c, packed);
  return primitive_cache().get(key, [&] { return create_primitive(c, packed); });
}

// `bytes` of `storage` (grown as needed, kept by the caller) from a page boundary: the
// library's packed weights live there, and AMX tile loads want them aligned.
void* page_aligned(std::vector<char>& storage, size_t bytes) {
  constexpr size_t kPage = 4096;
  if (storage.size() < bytes + kPage) storage.resize(bytes + kPage);
  return storage.data() + (kPage - reinterpret_cast<uintptr_t>(storage.data()) % kPage) % kPage;
}

// The call's B as it lies in memory (row-major or transposed).
memory b_as_given(const GemmCall& c) {
  return memory({{c.k, c.n}, onednn_type(c.in_dtype), strides(c.b_transposed, c.k, c.n)}, cpu_engine(),
                const_cast<void*>(c.b));
}

// A CPU stream runs synchronously in the calling thread; one per thread keeps concurrent
// callers independent.
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

// Runs one call on its cached primitive, or on its packed B's.
Status execute(const GemmCall& c) {
  try {
    const std::shared_ptr<const Primitive> held =
        c.packed_b ? std::static_pointer_cast<const Primitive>(c.packed_b->kernel) : cached_primitive(c, false);
    const Primitive& prim = *held;
    if (c.packed_b && prim.key != key_of(c, true))
      return Status::Internal("a GEMM's packed B was packed for another shape of call");
    const auto in = onednn_type(c.in_dtype);
    auto& engine = cpu_engine();
    memory a({{c.m, c.k}, in, strides(c.a_transposed, c.m, c.k)}, engine, const_cast<void*>(c.a));
    memory b = c.packed_b ? memory(*prim.packed_b, engine, const_cast<void*>(c.packed_b->data))
                          : b_as_given(c);
    memory out({{c.m, c.n}, onednn_type(c.out_dtype), {c.n, 1}}, engine, c.c);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, out}};
    if (c.bias)
      args.emplace(DNNL_ARG_BIAS, memory({{1, c.n}, in, {c.n, 1}}, engine, const_cast<void*>(c.bias)));
    dnnl::stream& stream = thread_stream();
    thread_local std::vector<char> scratchpad;  // per thread, as the stream
    void* aligned = page_aligned(scratchpad, prim.scratchpad_bytes);  // a plain B is packed here
    args.emplace(DNNL_ARG_SCRATCHPAD,
                 memory({{static_cast<memory::dim>(prim.scratchpad_bytes)}, memory::data_type::u8, {1}},
                        engine, aligned));
    before_parallel_work();  // oneDNN's threads are OpenMP's: the core's floating-point mode
    prim.matmul.execute(stream, args);
    stream.wait();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("oneDNN matmul failed: ") + e.what());
  }
  return Status::Ok();
}

// A chunk of the contraction whose length is not a multiple of kContractionStep, copied
// with zero rows after it: they add exact zeros to every sum. Per thread and kept (at
// most kMaxPaddedBytes), so steady-state training allocates nothing here.
GemmCall padded(const GemmCall& c) {
  thread_local std::vector<bf16_t> scratch;
  const int64_t k = round_up(c.k, kContractionStep);
  if (scratch.size() < size_t(k * (c.m + c.n))) scratch.resize(k * (c.m + c.n));
  // A is stored [k, m] (transposed), B is [k, n]: both are rows of the contraction.
  bf16_t* a = scratch.data();
  bf16_t* b = a + k * c.m;
  std::memcpy(a, c.a, c.k * c.m * sizeof(bf16_t));
  std::memset(a + c.k * c.m, 0, (k - c.k) * c.m * sizeof(bf16_t));
  std::memcpy(b, c.b, c.k * c.n * sizeof(bf16_t));
  std::memset(b + c.k * c.n, 0, (k - c.k) * c.n * sizeof(bf16_t));
  GemmCall p = c;
  p.k = k;
  p.a = a;
  p.b = b;
  return p;
}

// A fixed_contraction call, chunk by chunk. Several chunks of a bfloat16 output add up in
// a float32 scratch that is rounded once at the end.
Status execute_in_chunks(const GemmCall& c) {
  const int64_t chunk = contraction_chunk(c);
  std::vector<float> sum(c.k > chunk && c.out_dtype != DType::f32 ? c.m * c.n : 0);
  const auto* a = static_cast<const bf16_t*>(c.a);
  const auto* b = static_cast<const bf16_t*>(c.b);
  for (int64_t k0 = 0; k0 < c.k; k0 += chunk) {
    GemmCall part = c;
    part.k = std::min(chunk, c.k - k0);
    part.a = a + k0 * c.m;
    part.b = b + k0 * c.n;
    part.accumulate = c.accumulate || k0 > 0;
    if (!sum.empty()) part.out_dtype = DType::f32, part.c = sum.data();
    Status s = execute(part.k % kContractionStep ? padded(part) : part);
    if (!s.ok()) return s;
  }
  if (!sum.empty()) convert(sum.data(), DType::f32, c.c, c.out_dtype, c.m * c.n);
  return Status::Ok();
}

// On AVX-512 CPUs oneDNN's float32 kernel gives a B stored transposed ([n, k], as nn.Linear
// holds a weight) other bits on one thread than on several (measured: 64 to 2048 rows with K
// of 900 to 4096 and N of 127 to 600, not every such shape), where a row-major B keeps one
// thread's bits on any count. So from kMinPackedRows rows on such a B is multiplied
// row-major: copied so once per call, or once for several calls by pack_b; a call of fewer
// rows, where the copy would cost more than the product, reads B as given, on one thread
// (onednn_bits_depend_on_threads). Both took less time than the transposed read on two
// threads (K = 1024, N = 768: 7.8 against 9.4 ms at 1024 rows, 0.76 against 1.2 ms at 16).
bool transposed_f32_b(const GemmCall& c) {
  return c.in_dtype == DType::f32 && c.b_transposed && cpu_has_avx512() && c.k > 0 && c.n > 0;
}
bool multiplies_b_row_major(const GemmCall& c) { return transposed_f32_b(c) && c.m >= kMinPackedRows; }

// The call's B (stored [n, k], float32 or bfloat16) row-major into `out` ([k, n], float32):
// oneDNN's reorder, one per shape (a transposition, bfloat16 widened: exact, whatever its
// threads).
void b_row_major(const GemmCall& c, float* out) {
  static LruCache<std::tuple<DType, int64_t, int64_t>, dnnl::reorder> reorders(kOnednnCacheCapacity);
  const memory::desc given({c.k, c.n}, onednn_type(c.in_dtype), strides(true, c.k, c.n));
  const memory::desc row_major({c.k, c.n}, memory::data_type::f32, strides(false, c.k, c.n));
  const std::shared_ptr<const dnnl::reorder> reorder = reorders.get({c.in_dtype, c.k, c.n}, [&] {
    dnnl::primitive_attr user_scratchpad;
    user_scratchpad.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::reorder::primitive_desc pd(cpu_engine(), given, cpu_engine(), row_major, user_scratchpad);
    // Threads reorder at once with one primitive, so it must need no scratchpad (pack_b's rule).
    if (pd.scratchpad_desc().get_size() != 0) throw std::runtime_error("oneDNN's transposition needs a scratchpad");
    return dnnl::reorder(pd);
  });
  memory from(given, cpu_engine(), const_cast<void*>(c.b)), to(row_major, cpu_engine(), out);
  before_parallel_work();
  reorder->execute(thread_stream(), from, to);
  thread_stream().wait();
}

// Whether a bfloat16 call's B stored transposed stays so widened. On AVX-512 CPUs it is
// widened row-major (transposed_f32_b's reason); on AVX2 ones every GEMM runs on one thread
// and oneDNN's bfloat16 transposition is a slow generic one (with it, a widened GEMM of 512
// rows, K = 1024, N = 768, ran at 11 GFLOP/s, against 131 on B as given), so B keeps its
// layout.
bool widened_b_transposed(const GemmCall& c) { return c.b_transposed && !cpu_has_avx512(); }

// A bfloat16 call's B widened to float32 into `out`, transposed as widened_b_transposed says.
void widen_b(const GemmCall& c, float* out) {
  if (c.b_transposed && !widened_b_transposed(c))
    b_row_major(c, out);
  else
    convert(c.b, c.in_dtype, out, DType::f32, c.k * c.n);
}

Status execute_packing_b(const GemmCall& c);

// A multiplies_b_row_major call on B row-major: pack_b's copy, or one execute_packing_b
// makes for this call.
Status execute_row_major_b(const GemmCall& c) {
  if (!c.packed_b) return execute_packing_b(c);
  GemmCall row_major = c;
  row_major.b = c.packed_b->data, row_major.b_transposed = false, row_major.packed_b = nullptr;
  return execute(row_major);
}

}  // namespace

std::optional<PackedB> pack_b(const GemmCall& call, std::vector<char>& storage) try {
  if (call.in_dtype == DType::bf16 && !call.a_transposed && cpu_widens_bf16()) {
    // B widened to float32 once (execute_widened reads it so).
    void* data = page_aligned(storage, size_t(call.k * call.n) * sizeof(float));
    widen_b(call, static_cast<float*>(data));
    return PackedB{nullptr, data};
  }
  if (transposed_f32_b(call)) {  // B row-major once: execute_row_major_b reads it so
    void* data = page_aligned(storage, size_t(call.k * call.n) * sizeof(float));
    b_row_major(call, static_cast<float*>(data));
    return PackedB{nullptr, data};
  }
  if (!packable(call)) return std::nullopt;
  const std::shared_ptr<const Primitive> held = cached_primitive(call, true);
  void* data = page_aligned(storage, held->packed_b->get_size());
  memory given = b_as_given(call), packed(*held->packed_b, cpu_engine(), data);
  before_parallel_work();
  held->pack->execute(thread_stream(), given, packed);
  thread_stream().wait();
  return PackedB{held, data};
} catch (const std::exception&) {
  return std::nullopt;  // the calls read B as it is: slower, the same result
}

namespace {

// A thread keeps its packing storage for the next call up to this size (a layer's weight
// of one expert); a larger B is packed into memory freed after the call.
constexpr size_t kKeptPackedBytes = size_t(16) << 20;

// A call with B packed first (pack_b: for the kernel, or row-major), into memory of its
// thread's. Where pack_b declines, the call reads B as given, but a float32 B stored
// transposed, whose bits would then depend on the thread count.
Status execute_packing_b(const GemmCall& c) {
  thread_local std::vector<char> kept;
  std::vector<char> once;
  const bool keep = size_t(c.k) * size_t(c.n) * dtype_size(c.in_dtype) <= kKeptPackedBytes;
  const std::optional<PackedB> packed = pack_b(c, keep ? kept : once);
  if (!packed) return transposed_f32_b(c) ? Status::Internal("oneDNN could not copy B row-major") : execute(c);
  GemmCall on_packed = c;
  on_packed.packed_b = &*packed;
  return transposed_f32_b(c) ? execute_row_major_b(on_packed) : execute(on_packed);
}

std::optional<bool> forced_bf16_widened;

// Whether oneDNN has bfloat16 matmul kernels on this CPU: it has them from AVX-512 on, and
// none (not even its reference kernel, with run-time shapes) on an AVX2 CPU.
bool cpu_has_bf16_matmul() {
  static const bool has = [] {
    for (const bool a_transposed : {false, true}) {
      GemmCall probe{DType::bf16, DType::bf16, 64, 64, 64, nullptr, a_transposed, nullptr, false,
                     nullptr, nullptr, false};
      try {
        create_primitive(probe, false);
      } catch (const std::exception&) {
        return false;
      }
    }
    return true;
  }();
  return has;
}

// Whether oneDNN's bfloat16 kernels are faster than its float32 kernel on the operands
// widened: with AMX, and with AVX-512 BF16 short of AVX-512 FP16 (AMD's Zen 4: 177-203
// GFLOP/s a core against float32's 104-111; Zen 5's ISA is the same, unmeasured). Not on Intel's AVX-512 CPUs without AMX:
// bfloat16 grouped GEMMs (8192 rows, K = 1024, N = 768, 2 threads) on an Emerald Rapids VM
// that does not expose AMX ran at 140 GFLOP/s on its bfloat16 kernels against 230
// widened, and with oneDNN held to AVX-512 without BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE,
// as on Skylake to Ice Lake, where its bfloat16 kernels emulate the products) at 59
// against 224. Held to AVX512_CORE_BF16 there (Cooper Lake's ISA, unmeasured) they ran at
// 130 against 229, yet that ISA is Zen 4's too: it keeps the bfloat16 kernels.
bool bf16_kernels_pay() {
  return cpu_has_amx() || dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_bf16;
}

// A thread keeps its widening scratch up to this size; a larger call's is freed after it.
constexpr size_t kKeptWidenedBytes = size_t(64) << 20;

// A bfloat16 call on a CPU that widens bfloat16: its operands widened to float32
// (exactly; B by pack_b once for several calls, when it brings it so), the float32 kernel,
// and a bfloat16 output rounded once from float32 (with accumulate, from the old value
// widened plus the product): the bfloat16 kernels' float32 accumulation and single
// rounding, in the float32 kernel's order of sums.
Status execute_widened(const GemmCall& c) {
  thread_local std::vector<float> kept;
  std::vector<float> once;
  const bool wide_out = c.out_dtype != DType::f32;
  const int64_t a_count = c.m * c.k, b_count = c.packed_b ? 0 : c.k * c.n, bias_count = c.bias ? c.n : 0;
  const size_t count = size_t(a_count + b_count + bias_count + (wide_out ? c.m * c.n : 0));
  std::vector<float>& scratch = count * sizeof(float) <= kKeptWidenedBytes ? kept : once;
  if (scratch.size() < count) scratch.resize(count);
  float* a = scratch.data();
  float* b = a + a_count;
  float* bias = b + b_count;
  float* out = bias + bias_count;
  convert(c.a, c.in_dtype, a, DType::f32, a_count);  // dense in its layout
  if (!c.packed_b) widen_b(c, b);
  if (c.bias) convert(c.bias, c.in_dtype, bias, DType::f32, bias_count);
  if (wide_out && c.accumulate) convert(c.c, c.out_dtype, out, DType::f32, c.m * c.n);
  GemmCall wide = c;
  wide.in_dtype = DType::f32, wide.a = a, wide.bias = c.bias ? bias : nullptr, wide.packed_b = nullptr;
  wide.b = c.packed_b ? c.packed_b->data : b, wide.b_transposed = widened_b_transposed(c);
  if (wide_out) wide.out_dtype = DType::f32, wide.c = out;
  const Status s = execute(wide);
  if (s.ok() && wide_out) convert(out, DType::f32, c.c, c.out_dtype, c.m * c.n);
  return s;
}

}  // namespace

bool cpu_packs_b() { return cpu_has_amx() || cpu_widens_bf16(); }

bool cpu_widens_bf16() {
  if (forced_bf16_widened) return *forced_bf16_widened;
  static const bool widens = !cpu_has_bf16_matmul() || !bf16_kernels_pay();
  return widens;
}

bool runs_widened(const GemmCall& c) {
  if (c.in_dtype != DType::bf16 || !cpu_widens_bf16()) return false;
  const bool widened_b = c.packed_b && !c.packed_b->kernel;  // pack_b widened it
  const int64_t rows = c.a_transposed ? c.k : c.m;
  return rows >= kMinWidenedRows || widened_b || forced_bf16_widened || !cpu_has_bf16_matmul();
}

Status gemm_onednn(const GemmCall& c) {
  if (runs_widened(c)) return execute_widened(c);
  if (multiplies_b_row_major(c)) return execute_row_major_b(c);
  if (transposed_f32_b(c) && c.packed_b) {  // fewer rows: B as given (pack_b's row-major copy is for more)
    GemmCall given = c;
    given.packed_b = nullptr;
    return execute(given);
  }
  if (fixed_contraction(c)) return execute_in_chunks(c);
  if (!c.packed_b && packable(c) && c.m >= kMinPackedRows) return execute_packing_b(c);
  return execute(c);
}

// Measured: both bfloat16 weight-gradient kernels split their contraction (the top of the
// file). On AVX-512 CPUs the float32 kernels keep one thread's bits on all, but on a B
// stored transposed (transposed_f32_b: below kMinPackedRows rows it is read so); on AVX2 CPUs
// they do not (a forward of 400 rows, K = 32, N = 64, and weight gradients of 400 to 30000
// rows had other bits on two threads than on one), so there every call runs on one thread.
bool onednn_bits_depend_on_threads(const GemmCall& c) {
  return !cpu_has_avx512() || (c.in_dtype == DType::bf16 && c.a_transposed) ||
         (transposed_f32_b(c) && !multiplies_b_row_major(c));
}

size_t onednn_cached_primitives() { return primitive_cache().size(); }

void force_bf16_wgrad_chunks(std::optional<bool> chunks) { forced_bf16_wgrad_chunks = chunks; }

void force_bf16_widened(std::optional<bool> widened) { forced_bf16_widened = widened; }

}  // namespace cpu
}  // namespace groupgemm
