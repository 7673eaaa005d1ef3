// A/B switches read from the environment (env.h).
#include "core/env.h"

#include "core/check.h"

#include <cstdlib>
#include <string_view>

namespace fourbit {

int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  const std::string_view s(v);
  FOURBIT_CHECK(s == "0" || s == "1", "{}='{}': expected 0 (off) or 1 (on); unset it for the default", name, s);
  return s == "1" ? 1 : 0;
}

}  // namespace fourbit
