// Helpers shared by the recipe tests (tests/test_recipe_*.cpp).
#pragma once

#include "core/error.h"
#include "recipe/recipe.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace fourbit::recipe::testing {

// Runs fn, which must throw fourbit::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "':\n  " << msg;
    }
    return;
  }
  ADD_FAILURE() << "no fourbit::Error thrown (expected one mentioning '" << parts.front() << "')";
}

inline ModelShape dense(int n_layers) { return {n_layers, {}, false}; }

inline quant::QuantConfig config(quant::Format f, bool block_2d, quant::Rounding r, bool rht = false) {
  quant::QuantConfig c;
  c.format = f;
  c.block_2d = block_2d;
  c.rounding = r;
  c.rht = rht;
  return c;
}

}  // namespace fourbit::recipe::testing
