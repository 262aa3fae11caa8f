// The array entry points of groupgemm._core: every op of the table (python/csrc/op_table.h)
// as a Python function of DLPack-capable arrays (torch tensors, NumPy arrays), which reach
// the core zero-copy. Arguments are the op's arrays (operands, then results, the workspace
// among them; None for an absent optional one) and attributes, in declared order or by
// name, then `stream`. An array must be C-contiguous and of a dtype the op reads, a result
// writable, and is never converted: a copied output would be lost. Attributes are integers
// (flags 0 or 1). The core runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "array_args.h"
#include "op_table.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using array_args::Array;
using array_args::WritableArray;
using glue::ArgView;

class ArrayCall : public glue::OpCall {
 public:
  ArrayCall(const glue::Op& op, const nb::args& args, const nb::kwargs& kwargs)
      : OpCall(op), arrays_(op.arrays.size()), attributes_(op.attributes.size()) {
    const std::vector<nb::handle> given = by_position(args, kwargs);
    for (size_t i = 0; i < op.arrays.size(); ++i) {
      const glue::Param& p = op.arrays[i];
      arrays_[i] = array_at(p, given[i]);
      if (p.name == "workspace")
        views_.set_workspace(arrays_[i]);
      else
        views_.add(arrays_[i], p.name.c_str());
    }
    for (size_t i = 0; i < op.attributes.size(); ++i) {
      const nb::handle value = given[op.arrays.size() + i];
      if (value.is_valid() && !value.is_none())
        attributes_[i] = integer(value, op.attributes[i].name, "an int (int64)");
      else if (!op.attributes[i].optional)
        refuse(op.attributes[i].name + " must be given");
    }
    if (const nb::handle stream = given.back(); stream.is_valid() && !stream.is_none()) {
      uintptr_t address = 0;
      if (!nb::try_cast(stream, address))
        refuse("stream must be an int (a CUDA stream's address), got " + type_name(stream));
      views_.set_stream(address);
    }
    context = views_.context();
  }

  using OpCall::array;
  ArgView array(const glue::Param& p) const override {
    return views_(arrays_[&p - op.arrays.data()], p.name.c_str());
  }

  std::optional<int64_t> attribute(const char* name, bool is_flag) const override {
    const glue::Param& p = op.attribute(name);
    const std::optional<int64_t> v = attributes_[&p - op.attributes.data()];
    if (is_flag && v && *v != 0 && *v != 1)
      throw glue::ArgError(p.name + " must be a bool (0 or 1), got " + std::to_string(*v), false);
    return v;
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const {
    throw nb::type_error((std::string(op.name) + ": " + what).c_str());
  }

  static std::string type_name(nb::handle value) { return nb::type_name(value.type()).c_str(); }

  int64_t integer(nb::handle value, const std::string& name, const char* expected) const {
    int64_t v = 0;
    if (!nb::try_cast(value, v))  // an int, a bool or a NumPy integer; never a float
      refuse(name + " must be " + expected + ", got " + nb::str(nb::repr(value)).c_str());
    return v;
  }

  // Each argument at its place: the op's arrays, its attributes, then the stream.
  std::vector<nb::handle> by_position(const nb::args& args, const nb::kwargs& kwargs) const {
    const size_t num_arrays = op.arrays.size(), num_attributes = op.attributes.size();
    std::vector<nb::handle> given(num_arrays + num_attributes + 1);
    if (args.size() > given.size()) refuse("too many arguments");
    for (size_t i = 0; i < args.size(); ++i) given[i] = args[i];
    for (auto [key, value] : kwargs) {
      const std::string name = nb::cast<std::string>(key);
      size_t i = name == "stream" ? given.size() - 1 : given.size();
      if (const glue::Param* p = op.find(op.arrays, name)) i = p - op.arrays.data();
      if (const glue::Param* p = op.find(op.attributes, name)) i = num_arrays + (p - op.attributes.data());
      if (i == given.size()) refuse("no argument " + name);
      if (given[i].is_valid()) refuse(name + " given twice");
      given[i] = value;
    }
    return given;
  }

  std::optional<Array> array_at(const glue::Param& p, nb::handle value) const {
    if (!value.is_valid() || value.is_none()) {
      if (p.optional) return std::nullopt;
      refuse(p.name + " must be given");
    }
    if (WritableArray a; nb::try_cast(value, a, /*convert=*/false)) return Array(a);
    if (Array a; nb::try_cast(value, a, /*convert=*/false)) {
      if (p.result) refuse(p.name + " must be writable: the op writes its result there");
      return a;
    }
    if (nb::ndarray<nb::ro> strided; nb::try_cast(value, strided, /*convert=*/false))
      refuse(p.name + " must be C-contiguous (row-major without gaps); it is a strided view");
    refuse(p.name + " must be a DLPack array (a torch tensor, a NumPy array), got " + type_name(value));
  }

  array_args::ArrayViews views_;
  std::vector<std::optional<Array>> arrays_;
  std::vector<std::optional<int64_t>> attributes_;
};

}  // namespace

void bind_array_entry_points(nb::module_& m) {
  static std::deque<std::string> docs;  // nanobind keeps the pointer
  for (const glue::Op& op : glue::ops()) {
    std::string listed;
    for (const auto* params : {&op.arrays, &op.attributes})
      for (const glue::Param& p : *params) listed += p.name + (p.optional ? "?, " : ", ");
    const std::string& doc = docs.emplace_back(
        std::string(op.doc) + "\n\nArguments, in order or by name (?: may be None or left out): " + listed +
        "stream?.");
    m.def(
        op.name,
        [&op](nb::args args, nb::kwargs kwargs) {
          const ArrayCall call(op, args, kwargs);
          array_args::run_core([&] { return op.run(call); });
        },
        doc.c_str());
  }
}

}  // namespace groupgemm
