// List tasks with a longer answer: "reverse 3 9 1 4 = " -> "4 1 9 3" and "sort 31 9 17 4 = " ->
// "4 9 17 31" (ascending). A list has a length uniform in [min_len, len] and values uniform in
// [0, max_value]; items are separated by one space.
//
// Partial credit (partial=1; default 0 = exact only): a completion with its end marker gets the
// fraction of positions whose item equals the reference item, over max(its item count, the
// reference's), items being the texts between single spaces (so a stray space costs an item).
#include "core/check.h"
#include "rl/task_catalog.h"

#include <algorithm>

namespace fourbit::rl::detail {

namespace {

enum class ListOp { kReverse, kSort };

constexpr int64_t kMaxLen = 64;

class ListTask final : public Task {
 public:
  ListTask(const TaskOptions& o, ListOp op)
      : Task(o), op_(op), max_len_(o.get_int("len")), min_len_(o.get_int("min_len")),
        max_value_(o.get_int("max_value")), partial_(o.get_int("partial") != 0) {
    FOURBIT_CHECK(min_len_ <= max_len_,
                  "task {}: min_len={} is larger than len={}; lower min_len or raise len", name(),
                  min_len_, max_len_);
  }

  void generate(TaskRng& rng, Example& out) const override {
    const int64_t n = min_len_ == max_len_ ? min_len_ : rng.uniform_int(min_len_, max_len_);
    out.inputs.resize(n);
    for (int64_t& v : out.inputs) v = rng.uniform_int(0, max_value_);
    out.prompt.assign(op_ == ListOp::kReverse ? "reverse" : "sort");
    for (int64_t v : out.inputs) {
      out.prompt += ' ';
      append_int(out.prompt, v);
    }
    out.prompt += " = ";
    // The sorted or reversed list, built in place in the answer text.
    out.answer.clear();
    if (op_ == ListOp::kReverse) {
      for (int64_t i = n - 1; i >= 0; --i) append_item(out.answer, out.inputs[i]);
    } else {
      int64_t sorted[kMaxLen];
      std::copy(out.inputs.begin(), out.inputs.end(), sorted);
      std::sort(sorted, sorted + n);
      for (int64_t i = 0; i < n; ++i) append_item(out.answer, sorted[i]);
    }
  }

  double score(const Example& example, std::string_view completion) const override {
    if (!partial_) return score_exact(example.answer, completion);
    const std::optional<std::string_view> given = completion_answer(completion);
    if (!given) return 0.0;
    if (*given == example.answer) return 1.0;
    // Item lists of both texts, compared position by position.
    const std::vector<std::string_view> ga = split_items(*given), rb = split_items(example.answer);
    const size_t n_given = ga.size(), n_ref = rb.size();
    size_t matched = 0;
    for (size_t i = 0; i < std::min(n_given, n_ref); ++i) matched += ga[i] == rb[i];
    return (double)matched / (double)std::max(n_given, n_ref);
  }

 private:
  static void append_item(std::string& s, int64_t v) {
    if (!s.empty()) s += ' ';
    append_int(s, v);
  }
  static std::vector<std::string_view> split_items(std::string_view s) {
    std::vector<std::string_view> items;
    while (true) {
      const size_t sp = s.find(' ');
      items.push_back(s.substr(0, sp));
      if (sp == std::string_view::npos) return items;
      s = s.substr(sp + 1);
    }
  }

  ListOp op_;
  int64_t max_len_, min_len_, max_value_;
  bool partial_;
};

std::vector<TaskOptionSpec> list_options(std::string_view max_value_default) {
  return {{"len", OptionKind::kInt, "8", 1, kMaxLen, "", "most items in a list"},
          {"min_len", OptionKind::kInt, "2", 1, kMaxLen, "", "fewest items in a list"},
          {"max_value", OptionKind::kInt, max_value_default, 0, 1e9, "",
           "largest item (items are uniform in [0, max_value])"},
          {"partial", OptionKind::kInt, "0", 0, 1, "",
           "1: partial credit, the fraction of items in the right position"}};
}

}  // namespace

std::vector<TaskInfo> list_task_infos() {
  std::vector<TaskInfo> infos;
  infos.push_back({"reverse",
                   "reverse a list, \"reverse 3 9 1 4 = \" -> \"4 1 9 3\"",
                   "reverse:len=4",
                   list_options("9"),
                   [](const TaskOptions& o) -> std::unique_ptr<Task> {
                     return std::make_unique<ListTask>(o, ListOp::kReverse);
                   }});
  infos.push_back({"sort",
                   "sort a list ascending, \"sort 31 9 17 4 = \" -> \"4 9 17 31\"",
                   "sort:len=4",
                   list_options("99"),
                   [](const TaskOptions& o) -> std::unique_ptr<Task> {
                     return std::make_unique<ListTask>(o, ListOp::kSort);
                   }});
  return infos;
}

}  // namespace fourbit::rl::detail
