// XLA FFI handlers of the expert layer's ops: permute, unpermute and its backward, the
// activation and its backward, the router's softmax top-k, its backward and its tangent.
// Like the GEMMs' handlers: a CPU and a CUDA variant each, the CUDA one on XLA's stream
// (PlatformStream<void*>), command-buffer compatible (the core reads expert indices on the
// device and allocates nothing; the workspaces of permute and unpermute's backward are
// extra results). Shapes were checked in Python at trace time; they are checked again here
// because the core trusts its element counts.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_args.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace groupgemm {
namespace {

using namespace ffi_args;
using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

bool is_int32(const Buf& b) { return b.element_type() == ffi::DataType::S32; }

// permute: (tokens [T, H], expert_indices [T, k]) -> (permuted [T*k, H], group_sizes [E],
// row_map [T, k], workspace: permute_workspace_bytes(...) bytes, empty on CPU).
ffi::Error permute_op(Device device, void* stream, Buf tokens, Buf expert_indices, Out permuted,
                      Out group_sizes, Out row_map, Out workspace) {
  PermuteArgs a;
  if (!float_dtype(tokens.element_type(), &a.dtype) || permuted->element_type() != tokens.element_type())
    return dtype_error("permute (tokens and permuted)");
  if (!index_array(expert_indices, &a.expert_indices)) return dtype_error("permute's expert_indices");
  if (!is_int32(*group_sizes) || !is_int32(*row_map)) return invalid("group_sizes and row_map must be int32");
  const auto td = tokens.dimensions(), id = expert_indices.dimensions(), gd = group_sizes->dimensions();
  if (td.size() != 2) return shape_error("tokens");
  if (id.size() != 2 || id[0] != td[0]) return shape_error("expert_indices");
  if (gd.size() != 1) return shape_error("group_sizes");
  a.num_tokens = td[0], a.hidden = td[1], a.top_k = id[1], a.num_experts = gd[0];
  if (!shape_is(*permuted, {a.num_tokens * a.top_k, a.hidden})) return shape_error("permuted");
  if (!shape_is(*row_map, {a.num_tokens, a.top_k})) return shape_error("row_map");
  a.tokens = tokens.untyped_data(), a.permuted = permuted->untyped_data();
  a.group_sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  a.row_map = static_cast<int32_t*>(row_map->untyped_data());
  return to_ffi(permute(a, context(device, stream, &*workspace)));
}

// unpermute: (permuted [R, H], row_map [T, k], probs [T, k] or a size-0 placeholder) -> out [T, H].
ffi::Error unpermute_op(Device device, void* stream, Buf permuted, Buf row_map, Buf probs, Out out,
                        bool has_probs) {
  UnpermuteArgs a;
  if (!float_dtype(permuted.element_type(), &a.dtype) || out->element_type() != permuted.element_type())
    return dtype_error("unpermute (permuted and out)");
  if (!is_int32(row_map)) return invalid("row_map must be int32");
  const auto pd = permuted.dimensions(), rd = row_map.dimensions();
  if (pd.size() != 2) return shape_error("permuted");
  if (rd.size() != 2) return shape_error("row_map");
  a.num_rows = pd[0], a.hidden = pd[1], a.num_tokens = rd[0], a.top_k = rd[1];
  if (!shape_is(*out, {a.num_tokens, a.hidden})) return shape_error("out");
  if (has_probs) {
    if (!float_dtype(probs.element_type(), &a.probs_dtype)) return dtype_error("unpermute's probs");
    if (!shape_is(probs, {a.num_tokens, a.top_k})) return shape_error("probs");
    a.probs = probs.untyped_data();
  }
  a.permuted = permuted.untyped_data(), a.out = out->untyped_data();
  a.row_map = static_cast<const int32_t*>(row_map.untyped_data());
  return to_ffi(unpermute(a, plain_context(device, stream)));
}

// unpermute's backward: (dout [T, H], permuted [R, H] (read for dprobs only), row_map [T, k], probs) ->
// (dpermuted [R, H], dprobs [T, k], workspace: unpermute_backward_workspace_bytes(...) bytes, empty on
// CPU). An absent operand or an output not asked for is a size-0 placeholder; the flags say which.
ffi::Error unpermute_backward_op(Device device, void* stream, Buf dout, Buf permuted, Buf row_map, Buf probs,
                                 Out dpermuted, Out dprobs, Out workspace, bool has_probs, bool has_dpermuted,
                                 bool has_dprobs) {
  UnpermuteBackwardArgs a;
  if (!float_dtype(dout.element_type(), &a.dtype)) return dtype_error("unpermute_backward's dout");
  if (!is_int32(row_map)) return invalid("row_map must be int32");
  const auto dd = dout.dimensions(), rd = row_map.dimensions();
  if (dd.size() != 2) return shape_error("dout");
  if (rd.size() != 2 || rd[0] != dd[0]) return shape_error("row_map");
  a.num_tokens = rd[0], a.top_k = rd[1], a.hidden = dd[1];
  if (has_dpermuted || has_dprobs) {
    const auto rows = has_dpermuted ? dpermuted->dimensions() : permuted.dimensions();
    if (rows.size() != 2) return shape_error(has_dpermuted ? "dpermuted" : "permuted");
    a.num_rows = rows[0];
  }
  if (has_dpermuted) {
    if (dpermuted->element_type() != dout.element_type())
      return dtype_error("unpermute_backward's dpermuted");
    if (!shape_is(*dpermuted, {a.num_rows, a.hidden})) return shape_error("dpermuted");
    a.dpermuted = dpermuted->untyped_data();
  }
  if (has_dprobs) {
    if (permuted.element_type() != dout.element_type()) return dtype_error("unpermute_backward's permuted");
    if (!shape_is(permuted, {a.num_rows, a.hidden})) return shape_error("permuted");
    if (!float_dtype(dprobs->element_type(), &a.probs_dtype))
      return dtype_error("unpermute_backward's dprobs");
    if (!shape_is(*dprobs, {a.num_tokens, a.top_k})) return shape_error("dprobs");
    a.permuted = permuted.untyped_data(), a.dprobs = dprobs->untyped_data();
  }
  if (has_probs) {
    DType probs_dtype;
    if (!float_dtype(probs.element_type(), &probs_dtype) || (has_dprobs && probs_dtype != a.probs_dtype))
      return dtype_error("unpermute_backward's probs (and dprobs)");
    if (!shape_is(probs, {a.num_tokens, a.top_k})) return shape_error("probs");
    a.probs_dtype = probs_dtype, a.probs = probs.untyped_data();
  }
  a.dout = dout.untyped_data();
  a.row_map = static_cast<const int32_t*>(row_map.untyped_data());
  return to_ffi(unpermute_backward(a, context(device, stream, &*workspace)));
}

// activation: h [M, F_in] -> out [M, F]; kind is Activation's value.
ffi::Error activation_op(Device device, void* stream, Buf h, Out out, int32_t kind) {
  ActivationArgs a;
  if (!float_dtype(h.element_type(), &a.dtype) || out->element_type() != h.element_type())
    return dtype_error("activation (h and out)");
  const auto hd = h.dimensions();
  if (hd.size() != 2) return shape_error("h");
  a.kind = static_cast<Activation>(kind), a.rows = hd[0], a.in_features = hd[1];
  // An unknown kind or an odd swiglu width is the core's to report, before any shape.
  if (valid_activation(a.kind) && !(a.kind == Activation::swiglu && a.in_features % 2 != 0) &&
      !shape_is(*out, {a.rows, activation_out_features(a.kind, a.in_features)}))
    return shape_error("out");
  a.h = h.untyped_data(), a.out = out->untyped_data();
  return to_ffi(activation(a, plain_context(device, stream)));
}

// activation's backward: (dout [M, F], h [M, F_in]) -> dh [M, F_in].
ffi::Error activation_backward_op(Device device, void* stream, Buf dout, Buf h, Out dh, int32_t kind) {
  ActivationBackwardArgs a;
  if (!float_dtype(h.element_type(), &a.dtype) || dout.element_type() != h.element_type() ||
      dh->element_type() != h.element_type())
    return dtype_error("activation_backward (dout, h and dh)");
  const auto hd = h.dimensions();
  if (hd.size() != 2) return shape_error("h");
  a.kind = static_cast<Activation>(kind), a.rows = hd[0], a.in_features = hd[1];
  if (valid_activation(a.kind) && !(a.kind == Activation::swiglu && a.in_features % 2 != 0) &&
      !shape_is(dout, {a.rows, activation_out_features(a.kind, a.in_features)}))
    return shape_error("dout");
  if (!shape_is(*dh, {a.rows, a.in_features})) return shape_error("dh");
  a.dout = dout.untyped_data(), a.h = h.untyped_data(), a.dh = dh->untyped_data();
  return to_ffi(activation_backward(a, plain_context(device, stream)));
}

// probs / dprobs of the router: float32, float64 for float64 logits.
bool is_router_probs(const Buf& b, DType logits) {
  return b.element_type() == (logits == DType::f64 ? ffi::DataType::F64 : ffi::DataType::F32);
}

// softmax_topk: logits [T, E] -> (expert_indices [T, k] int32, probs [T, k]).
ffi::Error softmax_topk_op(Device device, void* stream, Buf logits, Out expert_indices, Out probs,
                           bool renormalize) {
  SoftmaxTopkArgs a;
  if (!float_dtype(logits.element_type(), &a.dtype)) return dtype_error("softmax_topk's logits");
  if (!is_int32(*expert_indices)) return invalid("expert_indices must be int32");
  if (!is_router_probs(*probs, a.dtype)) return dtype_error("softmax_topk's probs");
  const auto ld = logits.dimensions(), id = expert_indices->dimensions();
  if (ld.size() != 2) return shape_error("logits");
  if (id.size() != 2 || id[0] != ld[0]) return shape_error("expert_indices");
  a.num_tokens = ld[0], a.num_experts = ld[1], a.top_k = id[1], a.renormalize = renormalize;
  if (!shape_is(*probs, {a.num_tokens, a.top_k})) return shape_error("probs");
  a.logits = logits.untyped_data(), a.probs = probs->untyped_data();
  a.expert_indices = static_cast<int32_t*>(expert_indices->untyped_data());
  return to_ffi(softmax_topk(a, plain_context(device, stream)));
}

// softmax_topk's backward: (logits [T, E], expert_indices [T, k], dprobs [T, k]) -> dlogits [T, E].
ffi::Error softmax_topk_backward_op(Device device, void* stream, Buf logits, Buf expert_indices, Buf dprobs,
                                    Out dlogits, bool renormalize) {
  SoftmaxTopkBackwardArgs a;
  if (!float_dtype(logits.element_type(), &a.dtype) || dlogits->element_type() != logits.element_type())
    return dtype_error("softmax_topk_backward (logits and dlogits)");
  if (!is_int32(expert_indices)) return invalid("expert_indices must be int32");
  if (!is_router_probs(dprobs, a.dtype)) return dtype_error("softmax_topk_backward's dprobs");
  const auto ld = logits.dimensions(), id = expert_indices.dimensions();
  if (ld.size() != 2) return shape_error("logits");
  if (id.size() != 2 || id[0] != ld[0]) return shape_error("expert_indices");
  a.num_tokens = ld[0], a.num_experts = ld[1], a.top_k = id[1], a.renormalize = renormalize;
  if (!shape_is(dprobs, {a.num_tokens, a.top_k})) return shape_error("dprobs");
  if (!shape_is(*dlogits, {a.num_tokens, a.num_experts})) return shape_error("dlogits");
  a.logits = logits.untyped_data(), a.dprobs = dprobs.untyped_data(), a.dlogits = dlogits->untyped_data();
  a.expert_indices = static_cast<const int32_t*>(expert_indices.untyped_data());
  return to_ffi(softmax_topk_backward(a, plain_context(device, stream)));
}

// softmax_topk's forward-mode derivative: (logits [T, E], expert_indices [T, k], tlogits [T, E]) ->
// tprobs [T, k].
ffi::Error softmax_topk_tangent_op(Device device, void* stream, Buf logits, Buf expert_indices, Buf tlogits,
                                   Out tprobs, bool renormalize) {
  SoftmaxTopkTangentArgs a;
  if (!float_dtype(logits.element_type(), &a.dtype) || tlogits.element_type() != logits.element_type())
    return dtype_error("softmax_topk_tangent (logits and tlogits)");
  if (!is_int32(expert_indices)) return invalid("expert_indices must be int32");
  if (!is_router_probs(*tprobs, a.dtype)) return dtype_error("softmax_topk_tangent's tprobs");
  const auto ld = logits.dimensions(), id = expert_indices.dimensions();
  if (ld.size() != 2) return shape_error("logits");
  if (id.size() != 2 || id[0] != ld[0]) return shape_error("expert_indices");
  a.num_tokens = ld[0], a.num_experts = ld[1], a.top_k = id[1], a.renormalize = renormalize;
  if (!shape_is(tlogits, {a.num_tokens, a.num_experts})) return shape_error("tlogits");
  if (!shape_is(*tprobs, {a.num_tokens, a.top_k})) return shape_error("tprobs");
  a.logits = logits.untyped_data(), a.tlogits = tlogits.untyped_data(), a.tprobs = tprobs->untyped_data();
  a.expert_indices = static_cast<const int32_t*>(expert_indices.untyped_data());
  return to_ffi(softmax_topk_tangent(a, plain_context(device, stream)));
}

// The CPU variant of an op runs with no stream; the CUDA one with XLA's.
template <auto Op, typename... Rest>
ffi::Error on_cpu(Rest... rest) {
  return Op(Device::cpu, nullptr, rest...);
}
template <auto Op, typename... Rest>
ffi::Error on_cuda(void* stream, Rest... rest) {
  return Op(Device::cuda, stream, rest...);
}

// Operands, results and attributes of each op, after the CUDA variant's stream context.
template <typename B>
auto permute_binding(B b) {
  return std::move(b)
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Ret<Buf>()
      .template Ret<Buf>()
      .template Ret<Buf>()
      .template Ret<Buf>();
}
template <typename B>
auto unpermute_binding(B b) {
  return std::move(b)
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Ret<Buf>()
      .template Attr<bool>("has_probs");
}
template <typename B>
auto unpermute_backward_binding(B b) {
  return std::move(b)
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Ret<Buf>()
      .template Ret<Buf>()
      .template Ret<Buf>()
      .template Attr<bool>("has_probs")
      .template Attr<bool>("has_dpermuted")
      .template Attr<bool>("has_dprobs");
}
template <typename B>
auto activation_binding(B b) {
  return std::move(b).template Arg<Buf>().template Ret<Buf>().template Attr<int32_t>("kind");
}
template <typename B>
auto activation_backward_binding(B b) {
  return std::move(b).template Arg<Buf>().template Arg<Buf>().template Ret<Buf>().template Attr<int32_t>(
      "kind");
}

template <typename B>
auto softmax_topk_binding(B b) {
  return std::move(b).template Arg<Buf>().template Ret<Buf>().template Ret<Buf>().template Attr<bool>(
      "renormalize");
}
template <typename B>
auto softmax_topk_backward_binding(B b) {
  return std::move(b)
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Arg<Buf>()
      .template Ret<Buf>()
      .template Attr<bool>("renormalize");
}

auto cpu_bind() { return ffi::Ffi::Bind(); }
auto cuda_bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>(); }

XLA_FFI_DEFINE_HANDLER(kPermuteCpu, (on_cpu<permute_op, Buf, Buf, Out, Out, Out, Out>),
                       permute_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kPermuteCuda, (on_cuda<permute_op, Buf, Buf, Out, Out, Out, Out>),
                       permute_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kUnpermuteCpu, (on_cpu<unpermute_op, Buf, Buf, Buf, Out, bool>),
                       unpermute_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kUnpermuteCuda, (on_cuda<unpermute_op, Buf, Buf, Buf, Out, bool>),
                       unpermute_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kUnpermuteBackwardCpu,
                       (on_cpu<unpermute_backward_op, Buf, Buf, Buf, Buf, Out, Out, Out, bool, bool, bool>),
                       unpermute_backward_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kUnpermuteBackwardCuda,
                       (on_cuda<unpermute_backward_op, Buf, Buf, Buf, Buf, Out, Out, Out, bool, bool, bool>),
                       unpermute_backward_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kActivationCpu, (on_cpu<activation_op, Buf, Out, int32_t>),
                       activation_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kActivationCuda, (on_cuda<activation_op, Buf, Out, int32_t>),
                       activation_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kActivationBackwardCpu, (on_cpu<activation_backward_op, Buf, Buf, Out, int32_t>),
                       activation_backward_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kActivationBackwardCuda, (on_cuda<activation_backward_op, Buf, Buf, Out, int32_t>),
                       activation_backward_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkCpu, (on_cpu<softmax_topk_op, Buf, Out, Out, bool>),
                       softmax_topk_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkCuda, (on_cuda<softmax_topk_op, Buf, Out, Out, bool>),
                       softmax_topk_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkBackwardCpu, (on_cpu<softmax_topk_backward_op, Buf, Buf, Buf, Out, bool>),
                       softmax_topk_backward_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkBackwardCuda,
                       (on_cuda<softmax_topk_backward_op, Buf, Buf, Buf, Out, bool>),
                       softmax_topk_backward_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});
// The tangent takes the backward's operand, result and attribute kinds.
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkTangentCpu, (on_cpu<softmax_topk_tangent_op, Buf, Buf, Buf, Out, bool>),
                       softmax_topk_backward_binding(cpu_bind()));
XLA_FFI_DEFINE_HANDLER(kSoftmaxTopkTangentCuda, (on_cuda<softmax_topk_tangent_op, Buf, Buf, Buf, Out, bool>),
                       softmax_topk_backward_binding(cuda_bind()), {ffi::Traits::kCmdBufferCompatible});

nb::capsule capsule(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }

}  // namespace

void add_moe_ffi_handlers(nb::dict& cpu, nb::dict& cuda) {
  cpu["groupgemm_permute"] = capsule(kPermuteCpu);
  cpu["groupgemm_unpermute"] = capsule(kUnpermuteCpu);
  cpu["groupgemm_unpermute_backward"] = capsule(kUnpermuteBackwardCpu);
  cpu["groupgemm_activation"] = capsule(kActivationCpu);
  cpu["groupgemm_activation_backward"] = capsule(kActivationBackwardCpu);
  cpu["groupgemm_softmax_topk"] = capsule(kSoftmaxTopkCpu);
  cpu["groupgemm_softmax_topk_backward"] = capsule(kSoftmaxTopkBackwardCpu);
  cpu["groupgemm_softmax_topk_tangent"] = capsule(kSoftmaxTopkTangentCpu);
  cuda["groupgemm_permute"] = capsule(kPermuteCuda);
  cuda["groupgemm_unpermute"] = capsule(kUnpermuteCuda);
  cuda["groupgemm_unpermute_backward"] = capsule(kUnpermuteBackwardCuda);
  cuda["groupgemm_activation"] = capsule(kActivationCuda);
  cuda["groupgemm_activation_backward"] = capsule(kActivationBackwardCuda);
  cuda["groupgemm_softmax_topk"] = capsule(kSoftmaxTopkCuda);
  cuda["groupgemm_softmax_topk_backward"] = capsule(kSoftmaxTopkBackwardCuda);
  cuda["groupgemm_softmax_topk_tangent"] = capsule(kSoftmaxTopkTangentCuda);
}

}  // namespace groupgemm
