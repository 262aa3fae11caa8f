// float32 / bfloat16 GEMM through oneDNN matmul primitives with run-time shapes.
//
// Group sizes change every training step, so primitives are created with
// DNNL_RUNTIME_DIM_VAL for every dimension and stride: one primitive per
// (dtype, layout, bias, accumulate) combination serves every shape, and no call pays
// oneDNN's JIT cost after the first.
#include <map>
#include <stdexcept>
#include <string>
#include <mutex>
#include <tuple>

#include <oneapi/dnnl/dnnl.hpp>

#include "gemm.h"

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

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

using Key = std::tuple<DType, DType, bool, bool, bool, bool>;

struct Primitive {
  dnnl::matmul matmul;
  // oneDNN's GEMM-based kernel ("gemm:jit") keeps no per-primitive buffers, so
  // different threads may run it at the same time; its brgemm kernels may not.
  bool reentrant;
};

const Primitive& cached_primitive(const GemmCall& c) {
  static std::mutex mutex;
  static std::map<Key, Primitive> cache;
  const Key key{c.in_dtype, c.out_dtype, c.a_transposed, c.b_transposed, c.bias != nullptr,
                c.accumulate};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  // Shapes and leading dimensions are run-time values; which stride is 1 is fixed at
  // creation (with both strides unknown oneDNN 3.2 falls back to its reference kernel).
  const memory::dims any2{kRuntime, kRuntime};
  const memory::dims row_major{kRuntime, 1}, col_major{1, kRuntime};
  const memory::desc a(any2, onednn_type(c.in_dtype), c.a_transposed ? col_major : row_major);
  const memory::desc b(any2, onednn_type(c.in_dtype), c.b_transposed ? col_major : row_major);
  const memory::desc out(any2, onednn_type(c.out_dtype), row_major);
  const memory::desc bias = c.bias ? memory::desc({1, kRuntime}, onednn_type(c.in_dtype),
                                                  memory::dims{kRuntime, 1})
                                   : memory::desc();
  dnnl::primitive_attr attr;
  if (c.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd(cpu_engine(), a, b, bias, out, attr);
  // The reference kernel is orders of magnitude slower: treat picking it as a bug.
  const std::string impl = pd.impl_info_str();
  if (impl.rfind("ref", 0) == 0)
    throw std::runtime_error("oneDNN chose its reference kernel: " + impl);
  return cache.emplace(key, Primitive{dnnl::matmul(pd), impl.rfind("gemm:", 0) == 0}).first->second;
}

}  // namespace

bool gemm_onednn_reentrant(const GemmCall& c) {
  try {
    return cached_primitive(c).reentrant;
  } catch (const std::exception&) {
    return false;  // the call itself reports the error
  }
}

Status gemm_onednn(const GemmCall& c) {
  try {
    const dnnl::matmul& prim = cached_primitive(c).matmul;
    const auto in = onednn_type(c.in_dtype);
    auto& engine = cpu_engine();
    memory a({{c.m, c.k}, in, strides(c.a_transposed, c.m, c.k)}, engine, const_cast<void*>(c.a));
    memory b({{c.k, c.n}, in, strides(c.b_transposed, c.k, c.n)}, engine, const_cast<void*>(c.b));
    memory out({{c.m, c.n}, onednn_type(c.out_dtype), {c.n, 1}}, engine, c.c);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, out}};
    if (c.bias)
      args.emplace(DNNL_ARG_BIAS, memory({{1, c.n}, in, {c.n, 1}}, engine, const_cast<void*>(c.bias)));
    // A CPU stream runs synchronously in the calling thread; one per thread keeps
    // concurrent callers independent.
    thread_local dnnl::stream stream(engine);
    prim.execute(stream, args);
    stream.wait();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("oneDNN matmul failed: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace groupgemm
