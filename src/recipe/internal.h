// Internal to the recipe module. The declared table of an operand's fields (name, type, allowed
// values, default, which formats it applies to, help): JSON reading and writing, --set, the
// canonical-form check of validation and the help text all come from this one table. And the
// policy checks shared by Recipe::validate() and resolve().
#pragma once

#include "core/error.h"
#include "recipe/recipe.h"

#include <string>
#include <string_view>
#include <vector>

namespace fourbit::recipe::detail {

// "bf16" and the quantized formats, in the order they are listed to users.
inline constexpr std::array<std::string_view, 5> kFormatNames = {"bf16", "nvfp4", "mxfp8",
                                                                 "fp8-tensor", "fp8-block"};
std::string_view precision_format_name(const Precision& p);
// Parses a format name: nullopt for bf16, a default QuantConfig of that format otherwise. Throws
// naming `field` and listing kFormatNames.
Precision parse_format(std::string_view value, std::string_view field);

enum class FieldType : uint8_t { kBool, kEnum, kUint };

struct OperandField {
  std::string_view name;
  FieldType type;
  std::vector<std::string_view> values;  // kEnum: names by enum value; kBool: false, true
  std::string_view applies_to;           // for messages: "nvfp4 and fp8-block", ...
  std::string_view help;
  bool (*applies)(const quant::QuantConfig&);
  uint64_t (*get)(const quant::QuantConfig&);  // enum value, 0/1, or the integer
  void (*set)(quant::QuantConfig&, uint64_t);

  std::string value_text(const quant::QuantConfig& c) const;  // "stochastic", "true", "42"
  std::string allowed_text() const;                            // "nearest, stochastic"
  // Parses a --set value; throws naming `path` and the allowed values.
  uint64_t parse_text(std::string_view value, std::string_view path) const;
};

// In dependency order: a field's `applies` reads only fields listed before it (and the format).
const std::vector<OperandField>& operand_fields();
const OperandField* find_operand_field(std::string_view name);  // nullptr if unknown
std::string operand_field_names();  // "format, block_2d, rounding, ..."

// Resets every field that does not apply to its default (in table order).
void canonicalize(quant::QuantConfig& c);
// Throws naming `path`.FIELD when a field that does not apply differs from its default.
void check_canonical(const quant::QuantConfig& c, std::string_view path);

// Throws fourbit::Error("<where>: <message>"); `where` is a field path. The public entry points add
// the recipe's name (and the layer) in front (with_context).
[[noreturn]] void fail(std::string_view where, const std::string& message);

// Runs fn(); a fourbit::Error it throws is rethrown with "<prefix>: " in front of its message.
template <typename Fn>
decltype(auto) with_context(const std::string& prefix, Fn&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    throw Error(prefix + ": " + e.what());
  }
}

// The policy checks of Recipe::validate() (see recipe.h), naming the slot and field.
void check_policy(const Policy& p, bool allow_sampler_mismatch);
// The rules of one slot on its own (fields, 2D only on weights, RHT only on Wgrad, sampler and
// trainer rounding).
void check_slot(Slot s, const Precision& p);
// Orders an override's entries like all_slots() (the order of the table and of parsed JSON).
void sort_by_slot(std::vector<std::pair<Slot, Precision>>& set);
// The first field in which two precisions differ ("format", "block_2d", ...); empty if equal.
std::string first_difference(const Precision& a, const Precision& b);

}  // namespace fourbit::recipe::detail
