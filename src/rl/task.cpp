// The task interface's shared parts: the per-example random stream, exact scoring, and the
// registry with its spec parser ("name:key=value,..."), driven by each task's option table.
#include "rl/task.h"

#include "core/check.h"
#include "rl/task_catalog.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

namespace fourbit::rl {

std::string Example::text() const {
  std::string t;
  t.reserve(prompt.size() + answer.size() + 1);
  t += prompt;
  t += answer;
  t += kEndOfAnswer;
  return t;
}

// ---- TaskRng ------------------------------------------------------------------------------------

uint32_t TaskRng::next_u32() {
  if ((word_ & 3) == 0) block_ = stream_.block(word_ >> 2);
  return block_.v[word_++ & 3];
}

uint64_t TaskRng::next_u64() {
  const uint64_t hi = next_u32();
  return (hi << 32) | next_u32();
}

int64_t TaskRng::uniform_int(int64_t lo, int64_t hi) {
  FOURBIT_CHECK(lo <= hi, "uniform_int: empty range [{}, {}]", lo, hi);
  const uint64_t range = (uint64_t)hi - (uint64_t)lo + 1;  // 0 means all 2^64 values
  const uint64_t x = next_u64();
  const uint64_t offset = range == 0 ? x : (uint64_t)(((unsigned __int128)x * range) >> 64);
  return (int64_t)((uint64_t)lo + offset);
}

double TaskRng::uniform01() { return (double)(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

// ---- Task ----------------------------------------------------------------------------------------

namespace {

// FNV-1a, 64-bit: a fixed hash of the task name (std::hash may differ between library versions).
uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

constexpr int kIndexBits = 40;

}  // namespace

Task::Task(const TaskOptions& options)
    : name_(options.info().name),
      spec_(options.canonical_spec()),
      // Stream id layout: bit 63 = 0 (the corpus uses 1), bits 40..62 the name's salt, bits 0..39
      // the index.
      stream_salt_((fnv1a(options.info().name) & ((1ull << 23) - 1)) << kIndexBits) {}

Example Task::make_example(uint64_t seed, uint64_t index) const {
  Example e;
  make_example(seed, index, e);
  return e;
}

void Task::make_example(uint64_t seed, uint64_t index, Example& out) const {
  FOURBIT_CHECK(index < (1ull << kIndexBits), "task {}: example index {} is too large (< 2^{})",
                name_, index, kIndexBits);
  TaskRng rng(RandomStream{seed, stream_salt_ | index});
  generate(rng, out);
}

double Task::score(const Example& example, std::string_view completion) const {
  return score_exact(example.answer, completion);
}

std::optional<std::string_view> completion_answer(std::string_view completion) {
  const size_t end = completion.find(kEndOfAnswer);
  if (end == std::string_view::npos) return std::nullopt;
  return completion.substr(0, end);
}

double score_exact(std::string_view answer, std::string_view completion) {
  const std::optional<std::string_view> given = completion_answer(completion);
  return given && *given == answer ? 1.0 : 0.0;
}

// ---- options -------------------------------------------------------------------------------------

size_t TaskOptions::find(std::string_view name, OptionKind kind) const {
  for (size_t i = 0; i < info_->options.size(); ++i) {
    if (info_->options[i].name == name) {
      FOURBIT_CHECK(info_->options[i].kind == kind, "task {}: option '{}' read with the wrong kind",
                    info_->name, name);
      return i;
    }
  }
  FOURBIT_CHECK(false, "task {}: no option '{}' is declared", info_->name, name);
  return 0;
}

int64_t TaskOptions::get_int(std::string_view name) const {
  const std::string& v = values_[find(name, OptionKind::kInt)];
  int64_t x = 0;
  std::from_chars(v.data(), v.data() + v.size(), x);  // validated when parsed
  return x;
}

double TaskOptions::get_real(std::string_view name) const {
  const std::string& v = values_[find(name, OptionKind::kReal)];
  double x = 0;
  std::from_chars(v.data(), v.data() + v.size(), x);
  return x;
}

const std::string& TaskOptions::get_text(std::string_view name) const {
  return values_[find(name, OptionKind::kText)];
}

std::string TaskOptions::canonical_spec() const {
  std::string s(info_->name);
  for (size_t i = 0; i < values_.size(); ++i) {
    s += i == 0 ? ':' : ',';
    s += info_->options[i].name;
    s += '=';
    s += values_[i];
  }
  return s;
}

// ---- registry ------------------------------------------------------------------------------------

const std::vector<TaskInfo>& task_infos() {
  static const std::vector<TaskInfo> infos = [] {
    std::vector<TaskInfo> all;
    for (auto family : {detail::arithmetic_task_infos, detail::list_task_infos,
                        detail::countdown_task_infos}) {
      for (TaskInfo& info : family()) all.push_back(std::move(info));
    }
    return all;
  }();
  return infos;
}

namespace {

std::string task_names() {
  std::string names;
  for (const TaskInfo& info : task_infos()) {
    if (!names.empty()) names += ", ";
    names += info.name;
  }
  return names;
}

std::string option_list(const TaskInfo& info) {
  std::string list;
  for (const TaskOptionSpec& o : info.options) {
    if (!list.empty()) list += ", ";
    list += fmt::format("{} (default {})", o.name, o.default_value);
  }
  return list.empty() ? "none" : list;
}

std::string allowed_values(const TaskOptionSpec& o) {
  switch (o.kind) {
    case OptionKind::kInt: return fmt::format("an integer in [{}, {}]", (int64_t)o.min, (int64_t)o.max);
    case OptionKind::kReal: return fmt::format("a number in [{}, {}]", o.min, o.max);
    case OptionKind::kText: return fmt::format("one or more of the characters '{}', each at most once", o.allowed);
  }
  return "";
}

// Parses and validates one value; returns its canonical text. `where` prefixes errors.
std::string parse_value(const TaskOptionSpec& o, std::string_view value, const std::string& where) {
  const std::string bad = fmt::format("{}: {}={} is not valid: {} expects {} ({})", where, o.name,
                                      value, o.name, allowed_values(o), o.help);
  const char* first = value.data();
  const char* last = value.data() + value.size();
  switch (o.kind) {
    case OptionKind::kInt: {
      int64_t x = 0;
      const auto r = std::from_chars(first, last, x);
      FOURBIT_CHECK(!value.empty() && r.ec == std::errc() && r.ptr == last && (double)x >= o.min &&
                        (double)x <= o.max,
                    "{}", bad);
      return std::to_string(x);
    }
    case OptionKind::kReal: {
      double x = 0;
      const auto r = std::from_chars(first, last, x);
      FOURBIT_CHECK(!value.empty() && r.ec == std::errc() && r.ptr == last && std::isfinite(x) &&
                        x >= o.min && x <= o.max,
                    "{}", bad);
      return fmt::format("{}", x);
    }
    case OptionKind::kText: {
      bool ok = !value.empty();
      for (size_t i = 0; ok && i < value.size(); ++i) {
        ok = o.allowed.find(value[i]) != std::string_view::npos &&
             value.find(value[i], i + 1) == std::string_view::npos;
      }
      FOURBIT_CHECK(ok, "{}", bad);
      return std::string(value);
    }
  }
  return std::string(value);
}

}  // namespace

const TaskInfo& task_info(std::string_view name) {
  for (const TaskInfo& info : task_infos()) {
    if (info.name == name) return info;
  }
  FOURBIT_CHECK(false, "unknown task '{}'; the tasks are: {} (`fourbit tasks --list` describes them)",
                name, task_names());
  return task_infos().front();
}

std::unique_ptr<Task> make_task(std::string_view spec) {
  const size_t colon = spec.find(':');
  const std::string_view name = spec.substr(0, colon);
  const std::string where = fmt::format("task spec '{}'", spec);
  FOURBIT_CHECK(!name.empty(), "{}: no task name; write name or name:key=value,... (tasks: {})",
                where, task_names());
  const TaskInfo* info = nullptr;
  for (const TaskInfo& i : task_infos()) {
    if (i.name == name) info = &i;
  }
  FOURBIT_CHECK(info != nullptr, "{}: unknown task '{}'; the tasks are: {}", where, name,
                task_names());

  std::vector<std::string> values(info->options.size());
  std::vector<bool> given(info->options.size(), false);
  if (colon != std::string_view::npos) {
    std::string_view rest = spec.substr(colon + 1);
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      const size_t eq = item.find('=');
      const std::string_view key = item.substr(0, eq);
      FOURBIT_CHECK(!key.empty(), "{}: expected key=value in '{}'; options of {}: {}", where, item,
                    info->name, option_list(*info));
      size_t k = 0;
      while (k < info->options.size() && info->options[k].name != key) ++k;
      FOURBIT_CHECK(k < info->options.size(), "{}: task '{}' has no option '{}'; its options: {}",
                    where, info->name, key, option_list(*info));
      FOURBIT_CHECK(eq != std::string_view::npos, "{}: option '{}' has no value; write {}=VALUE ({})",
                    where, key, key, allowed_values(info->options[k]));
      FOURBIT_CHECK(!given[k], "{}: option '{}' is given twice", where, key);
      values[k] = parse_value(info->options[k], item.substr(eq + 1), where);
      given[k] = true;
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  for (size_t k = 0; k < values.size(); ++k) {
    if (!given[k]) values[k] = parse_value(info->options[k], info->options[k].default_value, where);
  }
  return info->make(TaskOptions(*info, std::move(values)));
}

std::string describe_tasks() {
  std::string s;
  for (const TaskInfo& info : task_infos()) {
    s += fmt::format("{}: {}\n", info.name, info.summary);
    for (const TaskOptionSpec& o : info.options) {
      s += fmt::format("    {:<14} {} (default {}; {})\n", o.name, o.help, o.default_value,
                       allowed_values(o));
    }
    s += fmt::format("    easy (taught by the synthetic corpus): {}\n", info.easy_spec);
  }
  return s;
}

}  // namespace fourbit::rl
