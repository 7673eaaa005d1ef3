// Minimal logging to stderr with a level and (later) the rank prefix of distributed runs.
#pragma once

#include <fmt/format.h>

#include <cstdio>

namespace fourbit {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);

template <typename... Args>
void log_at(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < log_level()) return;
  static constexpr const char* kPrefix[] = {"[debug] ", "", "[warn] ", "[error] "};
  std::fputs(kPrefix[(int)level], stderr);
  std::fputs(fmt::format(f, std::forward<Args>(args)...).c_str(), stderr);
  std::fputc('\n', stderr);
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log_at(LogLevel::kInfo, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log_at(LogLevel::kWarn, f, std::forward<Args>(args)...);
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  log_at(LogLevel::kDebug, f, std::forward<Args>(args)...);
}

}  // namespace fourbit
