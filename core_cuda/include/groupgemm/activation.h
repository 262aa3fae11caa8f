// The expert MLP's activations and their exact derivatives, per element, in float (for
// float32, bfloat16 and float16 storage) and double (float64). __host__ __device__: the
// CPU backend and the CUDA kernel evaluate the same expressions (the libraries' exp and
// erf may still differ in the last bit between host and device).
//
// swiglu(gate, up) = silu(gate) * up, with the gate in the first half of each input row;
// gelu is the exact erf form; silu(x) = x * sigmoid(x). Each maps 0 to 0, so a zero
// (padding) row stays exactly zero.
#pragma once

#include <math.h>

#include <cstdint>

#include "groupgemm/schedule.h"

namespace groupgemm {

GG_HD bool valid_activation(Activation kind) {
  return kind == Activation::swiglu || kind == Activation::gelu || kind == Activation::relu ||
         kind == Activation::silu;
}

// Output columns for F_in input columns: swiglu halves them.
GG_HD int64_t activation_out_features(Activation kind, int64_t in_features) {
  return kind == Activation::swiglu ? in_features / 2 : in_features;
}

GG_HD float exp_of(float x) { return expf(x); }
GG_HD double exp_of(double x) { return exp(x); }
GG_HD float erf_of(float x) { return erff(x); }
GG_HD double erf_of(double x) { return erf(x); }
GG_HD float erfc_of(float x) { return erfcf(x); }
GG_HD double erfc_of(double x) { return erfc(x); }

// sigmoid(x) from e = exp(-x): a caller can take the exponentials (calls) apart from the
// divisions (which then vectorize), with the bits of sigmoid.
template <typename T>
GG_HD T sigmoid_of_exp(T e) {
  return T(1) / (T(1) + e);
}

template <typename T>
GG_HD T sigmoid(T x) {
  return sigmoid_of_exp(exp_of(-x));
}

// Phi(x) = 0.5 (1 + erf(x / sqrt 2)), the standard normal CDF. Below 0 it is
// 0.5 erfc(-x / sqrt 2): 1 + erf cancels there (gelu(-6) came out 0 in float32, 57% off at
// -5.5), erfc keeps every bit down to its underflow.
template <typename T>
GG_HD T normal_cdf(T x) {
  const T scaled = x * T(0.70710678118654752440);
  return x < T(0) ? T(0.5) * erfc_of(-scaled) : T(0.5) * (T(1) + erf_of(scaled));
}

template <typename T>
GG_HD T gelu(T x) {
  return x * normal_cdf(x);
}

// gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
template <typename T>
GG_HD T gelu_derivative(T x) {
  return normal_cdf(x) + x * T(0.39894228040143267794) * exp_of(T(-0.5) * x * x);
}

// relu keeps NaN (x < 0 is false for it); relu'(0) = 0.
template <typename T>
GG_HD T relu(T x) {
  return x < T(0) ? T(0) : x;
}

// The gradient at (x, up) times dout: dx for the input column (the gate for swiglu) and,
// for swiglu, dup for the up column.
template <typename T>
struct ActivationGrad {
  T dx, dup;
};

// swiglu and silu are functions of x, up and sigmoid(x): a caller that needs the value and
// the gradient at one x computes the sigmoid once (and gets the bits of the functions below).
template <typename T>
GG_HD T activation_forward_at_sigmoid(Activation kind, T x, T up, T s) {
  return kind == Activation::swiglu ? (x * s) * up : x * s;
}

template <typename T>
GG_HD ActivationGrad<T> activation_backward_at_sigmoid(Activation kind, T dout, T x, T up, T s) {
  const T derivative = s + x * s * (T(1) - s);  // silu'(x)
  if (kind == Activation::swiglu) return {dout * up * derivative, dout * (x * s)};
  return {dout * derivative, T(0)};
}

// out[m, f] for an elementwise kind (x = h[m, f]) or swiglu (x = h[m, f], the gate, and
// up = h[m, F + f]); `up` is ignored by the elementwise kinds.
template <typename T>
GG_HD T activation_forward(Activation kind, T x, T up) {
  switch (kind) {
    case Activation::swiglu:
    case Activation::silu: return activation_forward_at_sigmoid(kind, x, up, sigmoid(x));
    case Activation::gelu: return gelu(x);
    case Activation::relu: return relu(x);
  }
  return T(0);
}

template <typename T>
GG_HD ActivationGrad<T> activation_backward_at(Activation kind, T dout, T x, T up) {
  switch (kind) {
    case Activation::swiglu:
    case Activation::silu: return activation_backward_at_sigmoid(kind, dout, x, up, sigmoid(x));
    case Activation::gelu: return {dout * gelu_derivative(x), T(0)};
    case Activation::relu: return {x > T(0) ? dout : T(0), T(0)};
  }
  return {T(0), T(0)};
}

}  // namespace groupgemm
