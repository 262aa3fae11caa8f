// The XLA FFI handlers' shared glue: a core Status as an ffi::Error, XLA dtypes as core
// dtypes, index buffers as IndexArrays, the execution context of a call. Used by
// ffi_handlers.cpp (the GEMMs) and moe_ffi_handlers.cpp (the expert layer's ops).
#pragma once

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

inline ffi::Error dtype_error(const char* what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("groupgemm: unsupported dtype for ") + what);
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
