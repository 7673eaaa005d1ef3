// Internal to rl: the task families that task.cpp's registry lists, and small text helpers the
// task implementations share. Not a public header.
#pragma once

#include "rl/task.h"

#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

namespace fourbit::rl::detail {

std::vector<TaskInfo> arithmetic_task_infos();  // add, mul, arith
std::vector<TaskInfo> list_task_infos();        // reverse, sort
std::vector<TaskInfo> countdown_task_infos();   // countdown

// Appends the decimal text of v (a '-' for negatives, no leading zeros).
inline void append_int(std::string& out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, r.ptr);
}

}  // namespace fourbit::rl::detail
