// Arithmetic tasks: "a+b=", "a*b=" and the mixed "arith" (a random operator per example from an
// op list, '-' included on request). Difficulty is the operands' digit count: each operand
// independently gets a digit count uniform in [min_digits, digits], then a value uniform among the
// numbers with exactly that many digits (0..9 for one digit), so short and long operands are
// equally common whatever the range. Exact scoring only (no partial credit).
#include "core/check.h"
#include "rl/task_catalog.h"

namespace fourbit::rl::detail {

namespace {

constexpr int64_t kPow10[19] = {1,
                                10,
                                100,
                                1000,
                                10000,
                                100000,
                                1000000,
                                10000000,
                                100000000,
                                1000000000,
                                10000000000,
                                100000000000,
                                1000000000000,
                                10000000000000,
                                100000000000000,
                                1000000000000000,
                                10000000000000000,
                                100000000000000000,
                                1000000000000000000};

class ArithmeticTask final : public Task {
 public:
  ArithmeticTask(const TaskOptions& o, std::string ops)
      : Task(o), ops_(std::move(ops)), max_digits_(o.get_int("digits")),
        min_digits_(o.get_int("min_digits")) {
    FOURBIT_CHECK(min_digits_ <= max_digits_,
                  "task {}: min_digits={} is larger than digits={}; lower min_digits or raise "
                  "digits",
                  name(), min_digits_, max_digits_);
  }

  void generate(TaskRng& rng, Example& out) const override {
    const char op = ops_.size() == 1 ? ops_[0] : ops_[rng.uniform_int(0, (int64_t)ops_.size() - 1)];
    const int64_t a = operand(rng);
    const int64_t b = operand(rng);
    // Ranges keep every result inside int64: digits <= 18 for + and -, <= 9 for *.
    const int64_t result = op == '+' ? a + b : op == '-' ? a - b : a * b;
    out.prompt.clear();
    append_int(out.prompt, a);
    out.prompt += op;
    append_int(out.prompt, b);
    out.prompt += '=';
    out.answer.clear();
    append_int(out.answer, result);
    out.inputs.assign({a, b});
  }

 private:
  int64_t operand(TaskRng& rng) const {
    const int64_t d = min_digits_ == max_digits_ ? min_digits_ : rng.uniform_int(min_digits_, max_digits_);
    const int64_t lo = d == 1 ? 0 : kPow10[d - 1];
    return rng.uniform_int(lo, kPow10[d] - 1);
  }

  std::string ops_;  // operator characters, each in "+-*"
  int64_t max_digits_, min_digits_;
};

TaskOptionSpec digits_option(std::string_view default_value, double max) {
  return {"digits", OptionKind::kInt, default_value, 1, max, "", "most digits of an operand"};
}
TaskOptionSpec min_digits_option(double max) {
  return {"min_digits", OptionKind::kInt, "1", 1, max, "", "fewest digits of an operand"};
}

}  // namespace

std::vector<TaskInfo> arithmetic_task_infos() {
  std::vector<TaskInfo> infos;
  infos.push_back({"add",
                   "addition, \"12+345=\" -> \"357\"",
                   "add:digits=2",
                   {digits_option("3", 18), min_digits_option(18)},
                   [](const TaskOptions& o) -> std::unique_ptr<Task> {
                     return std::make_unique<ArithmeticTask>(o, "+");
                   }});
  infos.push_back({"mul",
                   "multiplication, \"12*34=\" -> \"408\"",
                   "mul:digits=1",
                   {digits_option("2", 9), min_digits_option(9)},
                   [](const TaskOptions& o) -> std::unique_ptr<Task> {
                     return std::make_unique<ArithmeticTask>(o, "*");
                   }});
  infos.push_back({"arith",
                   "mixed arithmetic, an operator per example from `ops`, \"12-34=\" -> \"-22\"",
                   "arith:digits=1",
                   {digits_option("2", 9), min_digits_option(9),
                    {"ops", OptionKind::kText, "+*", 0, 0, "+-*",
                     "the operators to draw from, uniformly"}},
                   [](const TaskOptions& o) -> std::unique_ptr<Task> {
                     return std::make_unique<ArithmeticTask>(o, o.get_text("ops"));
                   }});
  return infos;
}

}  // namespace fourbit::rl::detail
