// Implementation of log.h.
#include "core/log.h"

namespace fourbit {
namespace {
LogLevel g_level = LogLevel::kInfo;
}
LogLevel log_level() { return g_level; }
void set_log_level(LogLevel level) { g_level = level; }
}  // namespace fourbit
