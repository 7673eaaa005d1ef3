// A/B switches and integer settings read from the environment, shared by every module that has one.
// Invariant: a switch is 1 for "1", 0 for "0", -1 when unset or empty (the caller's default); an
// integer is nullopt when unset or empty. Any other value is an error that names the variable.
#pragma once

#include <optional>

namespace fourbit {

int env_switch(const char* name);
// The decimal integer in [0, max] that `name` holds.
std::optional<int> env_int(const char* name, int max);
}  // namespace fourbit
