// The CPU's rows of a sigmoid-based activation (swiglu, silu), column chunk by column chunk:
// a chunk's exponentials (library calls, which no loop around them vectorizes) in one loop,
// its divisions and the activation's arithmetic in others, which the compiler vectorizes.
// Each value is activation.h's, bit for bit (a NaN's sign and payload aside, which IEEE
// arithmetic leaves open): only the order of independent steps changes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "groupgemm/activation.h"
#include "values.h"

namespace groupgemm {
namespace cpu {

// Columns per chunk: a chunk's sigmoids and up values (2 KiB in float) stay in L1. A
// multiple of kDotLanes, so that a column's dot-product lane is its index in the chunk's.
constexpr int64_t kColumnChunk = 256;

template <Activation kKind>
using KindConstant = std::integral_constant<Activation, kKind>;

// sig[i] = sigmoid(x[i]) for i < n.
template <typename A, typename T>
void sigmoid_chunk(const T* x, int64_t n, A* sig) {
  for (int64_t i = 0; i < n; ++i) sig[i] = exp_of(-load<A>(x, i));
  for (int64_t i = 0; i < n; ++i) sig[i] = sigmoid_of_exp(sig[i]);
}

// up[i] for the chunk of gates at `gate`: swiglu's up half, f columns on; 0 for silu.
template <Activation kKind, typename A, typename T>
void up_chunk(const T* gate, int64_t f, int64_t n, A* up) {
  for (int64_t i = 0; i < n; ++i) up[i] = kKind == Activation::swiglu ? load<A>(gate + f, i) : A(0);
}

template <Activation kKind, typename T, typename Fn>
void sigmoid_chunks_of(const T* h, int64_t f, Fn& fn) {
  using A = Acc<T>;
  A sig[kColumnChunk], up[kColumnChunk];
  for (int64_t c0 = 0; c0 < f; c0 += kColumnChunk) {
    const int64_t n = std::min(kColumnChunk, f - c0);
    sigmoid_chunk(h + c0, n, sig);
    up_chunk<kKind>(h + c0, f, n, up);
    fn(KindConstant<kKind>{}, c0, n, up, sig);
  }
}

// For a sigmoid-based kind, fn(kind, c0, n, up, sig) for each chunk of a row's f output
// columns, h its input row, kind a KindConstant (so that fn's loops have no branch on it).
// False, fn not called, for the other kinds.
template <typename T, typename Fn>
bool for_sigmoid_chunks(Activation kind, const T* h, int64_t f, Fn&& fn) {
  switch (kind) {
    case Activation::swiglu: sigmoid_chunks_of<Activation::swiglu>(h, f, fn); return true;
    case Activation::silu: sigmoid_chunks_of<Activation::silu>(h, f, fn); return true;
    default: return false;
  }
}

// A chunk's activation: y[c0 + i] for the chunk of h's row that for_sigmoid_chunks gave.
template <Activation kKind, typename T, typename A>
void forward_chunk(KindConstant<kKind>, const T* h, int64_t c0, int64_t n, const A* up, const A* sig, T* y) {
  for (int64_t i = 0; i < n; ++i)
    y[c0 + i] = store<T>(activation_forward_at_sigmoid(kKind, load<A>(h, c0 + i), up[i], sig[i]));
}

// A chunk's input gradient from its output gradient dy(i): the gates' into dh[c0 + i],
// swiglu's ups' into dh[f + c0 + i] (h's layout).
template <Activation kKind, typename T, typename A, typename Dy>
void backward_chunk(KindConstant<kKind>, const T* h, int64_t f, int64_t c0, int64_t n, const A* up, const A* sig,
                    Dy dy, T* dh) {
  for (int64_t i = 0; i < n; ++i) {
    const ActivationGrad<A> d = activation_backward_at_sigmoid(kKind, dy(i), load<A>(h, c0 + i), up[i], sig[i]);
    dh[c0 + i] = store<T>(d.dx);
    if (kKind == Activation::swiglu) dh[f + c0 + i] = store<T>(d.dup);
  }
}

}  // namespace cpu
}  // namespace groupgemm
