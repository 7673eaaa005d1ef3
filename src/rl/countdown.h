// Countdown: reach a target from given numbers with + - * / and parentheses, each number used at
// most once. The task ("countdown" in the registry) writes prompts like
// "countdown 25 3 7 2 to 70 = " and a reference solution such as "25*3-7+2"; a completion is
// scored by check_countdown, so any correct expression earns the reward, not only the reference.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace fourbit::rl {

struct CountdownCheck {
  bool parsed = false;      // a well-formed expression (grammar below)
  bool numbers_ok = false;  // parsed, and every number in it is one of the given numbers, each
                            // used at most as often as it is given
  bool exact = false;       // numbers_ok, and its value is exactly the target
  std::string error;        // why not, for people; empty when exact
};

// Checks `expression` against the given numbers and target.
//
// Grammar: expr = term {('+'|'-') term}; term = factor {('*'|'/') factor};
// factor = number | '(' expr ')'; number = decimal digits without a leading zero (at most 9).
// Spaces between tokens are allowed; no unary minus; at most 256 characters and 32 levels of
// parentheses. Evaluation is exact in rationals (int64 numerator and denominator; an overflow or a
// division by zero makes the expression fail), left to right within a precedence level, so
// "7/2*4" is 14, not 12.
CountdownCheck check_countdown(std::string_view expression, std::span<const int64_t> numbers,
                               int64_t target);

}  // namespace fourbit::rl
