// Every entry point of the core that the frontends call, declared once, for both bindings.
//
// An op is one GROUPGEMM_OP: its names (the array entry point groupgemm._core.<name> and
// the XLA FFI target), its arrays (operands, then results) and attributes, and a body that
// reads them from an OpCall, unpacks them into the core's argument struct and calls the
// core. Each binding makes an OpCall its own way: the DLPack arrays of a Python call
// (torch_ext/csrc/array_bindings.cpp) or the buffers and attributes of an XLA FFI call
// (jax_ext/csrc/ffi_handlers.cpp); both are generated from the declaration. The core gets
// pointers and sizes only, so a body checks every array against the sizes it hands the
// core (arg_view.h); the core checks the sizes themselves.
//
// Declarations are space-separated names; a trailing `?` marks an optional array or
// attribute. An absent optional array is None in a Python call and a size-0 rank-1
// placeholder in an XLA call; its view has given() false. The array named `workspace`, the
// CUDA backend's caller-allocated scratch, goes into the call's context instead of a view.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "arg_view.h"
#include "attribute_enums.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace glue {

struct Param {
  std::string name;
  bool optional = false;
  bool result = false;  // an XLA FFI result (else an operand); in a Python call, just an array
  int index = 0;        // among the operands or among the results
};

class OpCall;

struct Op {
  const char* name;    // groupgemm._core.<name>
  const char* target;  // the XLA FFI target
  const char* doc;
  Status (*run)(const OpCall&);
  std::vector<Param> arrays, attributes;
  int num_operands = 0, num_results = 0;

  // The declared array or attribute `name`; nullptr when there is none.
  const Param* find(const std::vector<Param>& params, std::string_view name) const {
    for (const Param& p : params)
      if (p.name == name) return &p;
    return nullptr;
  }
  const Param& array(const char* name) const { return declared(find(arrays, name), name); }
  const Param& attribute(const char* name) const { return declared(find(attributes, name), name); }

 private:
  const Param& declared(const Param* p, const char* name) const {
    if (!p) throw std::logic_error(std::string(this->name) + " declares no argument " + name);
    return *p;
  }
};

// One call of an op, as a binding presents it.
class OpCall {
 public:
  explicit OpCall(const Op& op) : op(op) {}
  virtual ~OpCall() = default;

  // The declared array p: a view with given() false where an optional one is absent.
  virtual ArgView array(const Param& p) const = 0;
  // The array `name`, as array(p) for its declaration.
  ArgView array(const char* name) const { return array(op.array(name)); }
  // The attribute `name`, a flag (0 or 1) or an integer; nullopt where it was not given.
  virtual std::optional<int64_t> attribute(const char* name, bool is_flag) const = 0;

  // Each binding has checked that every attribute not declared optional was given.
  bool flag(const char* name) const { return attribute(name, true).value_or(0) != 0; }  // absent: false
  int64_t integer(const char* name) const { return attribute(name, false).value_or(0); }
  // An enumerated attribute (attribute_enums.h); any value not the enum's is refused as given.
  template <typename Enum>
  std::optional<Enum> enumerated(const char* name) const {
    const std::optional<int64_t> v = attribute(name, false);
    if (!v) return std::nullopt;
    for (const Enumerator& e : Enumerators<Enum>::values)
      if (e.value == *v) return static_cast<Enum>(e.value);
    throw ArgError(std::string(name) + " must be " + enumerator_list<Enum>() + ", got " + std::to_string(*v),
                   false);
  }

  const Op& op;
  ExecContext context;  // where the call runs: device, stream and workspace
};

// Whether two arrays' bytes overlap; each is C-contiguous (both bindings check), so it spans
// its data pointer to its element count's bytes. An array of elements of no known size spans
// nothing (its op refuses it).
inline bool overlap(const ArgView& a, const ArgView& b) {
  const auto* a_begin = static_cast<const char*>(a.data);
  const auto* b_begin = static_cast<const char*>(b.data);
  return a_begin < b_begin + b.count() * element_bytes(b) && b_begin < a_begin + a.count() * element_bytes(a);
}

// An array the op writes (a result, or the accumulator it adds into) must not share memory
// with an array it reads, nor with another it writes: the core would read values it had
// already overwritten, or write one answer over another. The accumulator is out itself
// (expect_accumulator), so that pair is the one allowed. XLA never overlaps its buffers but
// for that alias; a Python call may pass any arrays, views of one storage included.
inline void expect_written_arrays_apart(const OpCall& call) {
  std::vector<ArgView> read, written;
  for (const Param& p : call.op.arrays) {
    if (p.name == "workspace") continue;  // the context's scratch, not a view
    const ArgView v = call.array(p);
    if (!v.given() || v.count() == 0) continue;
    (p.result || p.name == "accumulate_into" ? written : read).push_back(v);
  }
  for (size_t i = 0; i < written.size(); ++i) {
    for (const ArgView& r : read)
      if (overlap(written[i], r))
        refuse(written[i], std::string("shares memory with ") + r.name + "; pass a separate buffer");
    for (size_t j = i + 1; j < written.size(); ++j) {
      const bool accumulator_is_out =
          std::string_view(written[i].name) == "accumulate_into" && written[i].data == written[j].data;
      if (!accumulator_is_out && overlap(written[i], written[j]))
        refuse(written[j], std::string("shares memory with ") + written[i].name + "; pass a separate buffer");
    }
  }
}

// A weight gradient's accumulator: given with accumulate and only then, as out itself (XLA
// aliases the operand to the result; a Python call passes the same array as both). The
// core adds into out, so any other buffer would leave the accumulator unread and out's
// prior contents (garbage, for an XLA result) summed instead.
inline void expect_accumulator(const ArgView& accumulate_into, const ArgView& out, bool accumulate) {
  if (!accumulate_into.given()) {
    if (accumulate) refuse(accumulate_into, "must be given with accumulate: out itself, holding the sums so far");
    return;
  }
  if (!accumulate) refuse(accumulate_into, "is read only with accumulate");
  expect_shape(accumulate_into, {out.dims[0], out.dims[1], out.dims[2]});
  expect_dtype(accumulate_into, float_dtype(out), "out");
  if (accumulate_into.data != out.data)
    refuse(accumulate_into, "must be out itself (in XLA, aliased to out by input_output_aliases): the core adds "
                            "into out");
}

// group_sizes (or, with cumulative, group ends) and the optional group_offset of a grouped op.
template <typename Args>
void set_groups(Args& a, const OpCall& call, bool cumulative) {
  const ArgView group_sizes = call.array("group_sizes");
  expect_rank(group_sizes, 1);
  a.group_sizes = index_array(group_sizes, cumulative);
  a.group_offset = optional_offset(call.array("group_offset"));
}

inline std::vector<Op>& ops() {
  static std::vector<Op> all;  // filled while the module loads, read once it has
  return all;
}

inline std::vector<Param> parse_params(const char* declared, bool result, int* count) {
  std::vector<Param> params;
  std::istringstream words(declared);
  for (std::string w; words >> w;) {
    Param p;
    p.optional = w.back() == '?';
    p.name = p.optional ? w.substr(0, w.size() - 1) : w;
    p.result = result, p.index = (*count)++;
    params.push_back(p);
  }
  return params;
}

struct OpRegistration {
  OpRegistration(const char* name, const char* target, const char* operands, const char* results,
                 const char* attributes, const char* doc, Status (*run)(const OpCall&)) {
    Op op{name, target, doc, run, {}, {}};
    op.arrays = parse_params(operands, false, &op.num_operands);
    for (const Param& p : parse_params(results, true, &op.num_results)) op.arrays.push_back(p);
    int num_attributes = 0;
    op.attributes = parse_params(attributes, false, &num_attributes);
    ops().push_back(op);
  }
};

// GROUPGEMM_OP(name, target, operands, results, attributes, doc) { body }: the
// body reads `call` (an OpCall) and returns the core's Status; before it, every op checks
// that the arrays it writes are apart from the rest (expect_written_arrays_apart).
#define GROUPGEMM_OP(name, target, operands, results, attributes, doc)                                      \
  ::groupgemm::Status name##_body(const ::groupgemm::glue::OpCall& call);                                   \
  ::groupgemm::Status name##_op(const ::groupgemm::glue::OpCall& call) {                                    \
    ::groupgemm::glue::expect_written_arrays_apart(call);                                                   \
    return name##_body(call);                                                                               \
  }                                                                                                         \
  const ::groupgemm::glue::OpRegistration name##_registration(#name, target, operands, results, attributes, \
                                                              doc, &name##_op);                             \
  ::groupgemm::Status name##_body(const ::groupgemm::glue::OpCall& call)

}  // namespace glue
}  // namespace groupgemm
