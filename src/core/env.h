// A/B switches read from the environment, shared by every module that has one.
// Invariant: a switch is 1 for "1", 0 for "0", -1 when unset or empty (the caller's default);
// any other value is an error that names the variable.
#pragma once

namespace fourbit {

int env_switch(const char* name);

}  // namespace fourbit
