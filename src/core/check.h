// FOURBIT_CHECK(cond, fmt, args...): takes a bool condition only (a string literal would be
// always true: the Transformer Engine CHECK("message") bug) and throws fourbit::Error with
// file:line, the failed condition and a formatted message that should tell the user what to do
// next. Errors are exceptions so that the CLI prints them cleanly and tests can assert on them;
// nothing in fourbit catches and ignores them. Host code only (uses fmt); CUDA checks are in
// core/error.h, which this header includes.
#pragma once

#include "core/error.h"

#include <fmt/format.h>

#include <type_traits>

#define FOURBIT_CHECK(cond, ...)                                                                \
  do {                                                                                          \
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(cond)>, bool>,                     \
                  "FOURBIT_CHECK takes a bool condition");                                      \
    if (!(cond)) [[unlikely]] {                                                                 \
      ::fourbit::core::throw_check_failure(__FILE__, __LINE__, #cond,                           \
                                           ::fmt::format(__VA_ARGS__));                         \
    }                                                                                           \
  } while (0)
