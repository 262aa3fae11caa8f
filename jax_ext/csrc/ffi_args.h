// The XLA FFI handlers' shared glue: a core Status as an ffi::Error, XLA dtypes as core
// dtypes, index buffers as IndexArrays, shape checks, the execution context of a call.
// Used by ffi_handlers.cpp (the GEMMs), moe_ffi_handlers.cpp (the expert layer's ops) and
// fp8_ffi_handlers.cpp (the FP8 calls). The core gets pointers and sizes only, so the
// handlers check each buffer's shape against the sizes they pass: a custom call built
// with other shapes gets an error, never an access past a buffer.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>

#include "dtype_table.h"
#include "groupgemm/groupgemm.h"
#include "xla/ffi/api/ffi.h"

namespace groupgemm {
namespace ffi_args {

namespace ffi = xla::ffi;

inline ffi::Error to_ffi(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  const auto code = s.code == Status::Code::invalid_argument ? ffi::ErrorCode::kInvalidArgument
                    : s.code == Status::Code::unimplemented  ? ffi::ErrorCode::kUnimplemented
                                                             : ffi::ErrorCode::kInternal;
  return ffi::Error(code, "groupgemm: " + s.message);
}

inline bool float_dtype(ffi::DataType t, DType* out) {
  const std::optional<DType> dtype = dtype_from_xla(t);
  if (dtype) *out = *dtype;
  return dtype.has_value();
}

inline bool index_array(const ffi::AnyBuffer& b, IndexArray* out) {
  if (b.element_type() != ffi::DataType::S32 && b.element_type() != ffi::DataType::S64) return false;
  *out = {b.untyped_data(), b.element_type() == ffi::DataType::S32 ? IndexType::i32 : IndexType::i64,
          static_cast<int64_t>(b.element_count())};
  return true;
}

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "groupgemm: " + message);
}

// A buffer's dimensions against the expected ones.
inline bool shape_is(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  const auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

inline ffi::Error shape_error(const char* name) { return invalid(std::string(name) + " has an unexpected shape"); }

inline bool count_is(const ffi::AnyBuffer& b, int64_t want) { return static_cast<int64_t>(b.element_count()) == want; }

inline ffi::Error dtype_error(const char* what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("groupgemm: unsupported dtype for ") + what);
}

// The context of a call without a workspace.
inline ExecContext plain_context(Device device, void* stream) {
  ExecContext ctx;
  ctx.device = device, ctx.stream = stream;
  return ctx;
}

inline ExecContext context(Device device, void* stream, ffi::AnyBuffer* workspace) {
  ExecContext ctx;
  ctx.device = device, ctx.stream = stream;
  ctx.workspace = workspace->untyped_data();
  ctx.workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  return ctx;
}

}  // namespace ffi_args
}  // namespace groupgemm
