// A/B switches read from the environment (env.h).
#include "core/env.h"

#include "core/check.h"

#include <cstdlib>
#include <optional>
#include <string_view>

namespace fourbit {

int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  const std::string_view s(v);
  FOURBIT_CHECK(s == "0" || s == "1", "{}='{}': expected 0 (off) or 1 (on); unset it for the default", name, s);
  return s == "1" ? 1 : 0;
}

std::optional<int> env_int(const char* name, int max) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  FOURBIT_CHECK(*end == '\0' && x >= 0 && x <= max, "{}='{}': expected an integer in [0, {}]; unset it for the default",
                name, v, max);
  return (int)x;
}

}  // namespace fourbit
