// Countdown: the expression checker (exact rational arithmetic) and the task generator.
//
// Generator: n numbers uniform in [1, max_value]; then, while more than one value remains, two
// random values a, b are combined with a random operator among those that keep the value an
// integer in [1, max_target] (a+b, a-b if a > b, a*b, a/b if b divides a; when none applies,
// b and a swap, and a-b or a/b then does). The last value is the target and the combination,
// printed with the fewest parentheses, is the reference answer, so every problem is solvable with
// all numbers used once. A target equal to one of the numbers is redrawn (up to 16 times).
//
// Partial credit: format_reward (default 0) is the reward of a completion whose expression parses
// and uses only given numbers (each at most as often as given) but misses the target.
#include "rl/countdown.h"

#include "core/check.h"
#include "rl/task_catalog.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace fourbit::rl {

namespace {

constexpr size_t kMaxExpressionChars = 256;
constexpr int kMaxDepth = 32;
constexpr int kMaxNumberDigits = 9;

struct Rational {
  int64_t num = 0;
  int64_t den = 1;  // > 0, gcd(num, den) == 1
};

// Each returns false on int64 overflow or division by zero.
bool make_rational(int64_t num, int64_t den, Rational& out) {
  if (den == 0) return false;
  if (den < 0) {
    if (__builtin_mul_overflow(num, -1, &num) || __builtin_mul_overflow(den, -1, &den)) return false;
  }
  const int64_t g = std::gcd(num, den);
  out = {num / g, den / g};
  return true;
}

bool apply(char op, const Rational& a, const Rational& b, Rational& out) {
  int64_t x, y, z;
  switch (op) {
    case '+':
    case '-':
      if (__builtin_mul_overflow(a.num, b.den, &x) || __builtin_mul_overflow(b.num, a.den, &y) ||
          __builtin_mul_overflow(a.den, b.den, &z)) {
        return false;
      }
      if (op == '+' ? __builtin_add_overflow(x, y, &x) : __builtin_sub_overflow(x, y, &x)) return false;
      return make_rational(x, z, out);
    case '*':
      if (__builtin_mul_overflow(a.num, b.num, &x) || __builtin_mul_overflow(a.den, b.den, &z)) return false;
      return make_rational(x, z, out);
    case '/':
      if (__builtin_mul_overflow(a.num, b.den, &x) || __builtin_mul_overflow(a.den, b.num, &z)) return false;
      return make_rational(x, z, out);
  }
  return false;
}

// Recursive-descent parser that evaluates as it goes. A grammar error stops it; an arithmetic
// failure (overflow, division by zero) only marks the value as unusable.
class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  bool parse(Rational& value) {
    if (s_.size() > kMaxExpressionChars) {
      return fail(fmt::format("longer than {} characters", kMaxExpressionChars));
    }
    if (!expr(value)) return false;
    skip_spaces();
    if (pos_ != s_.size()) return fail(fmt::format("unexpected '{}' at offset {}", s_[pos_], pos_));
    return true;
  }

  const std::string& error() const { return error_; }
  const std::string& arithmetic_error() const { return arithmetic_error_; }
  const std::vector<int64_t>& numbers_used() const { return used_; }

 private:
  bool fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  void skip_spaces() {
    while (pos_ < s_.size() && s_[pos_] == ' ') ++pos_;
  }
  bool peek(char a, char b, char& op) {
    skip_spaces();
    if (pos_ < s_.size() && (s_[pos_] == a || s_[pos_] == b)) {
      op = s_[pos_++];
      return true;
    }
    return false;
  }
  void combine(char op, Rational& acc, const Rational& rhs) {
    if (!arithmetic_error_.empty()) return;
    if (!apply(op, acc, rhs, acc)) {
      arithmetic_error_ = op == '/' && rhs.num == 0 ? "division by zero" : "int64 overflow";
    }
  }
  bool expr(Rational& value) {
    if (!term(value)) return false;
    char op;
    while (peek('+', '-', op)) {
      Rational rhs;
      if (!term(rhs)) return false;
      combine(op, value, rhs);
    }
    return true;
  }
  bool term(Rational& value) {
    if (!factor(value)) return false;
    char op;
    while (peek('*', '/', op)) {
      Rational rhs;
      if (!factor(rhs)) return false;
      combine(op, value, rhs);
    }
    return true;
  }
  bool factor(Rational& value) {
    skip_spaces();
    if (pos_ == s_.size()) return fail("ends where a number or '(' is expected");
    const char c = s_[pos_];
    if (c == '(') {
      if (++depth_ > kMaxDepth) return fail(fmt::format("more than {} nested parentheses", kMaxDepth));
      ++pos_;
      if (!expr(value)) return false;
      skip_spaces();
      if (pos_ == s_.size() || s_[pos_] != ')') return fail(fmt::format("missing ')' at offset {}", pos_));
      ++pos_;
      --depth_;
      return true;
    }
    if (c < '0' || c > '9') return fail(fmt::format("unexpected '{}' at offset {}", c, pos_));
    const size_t start = pos_;
    int64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      if (pos_ - start == kMaxNumberDigits) return fail("a number with more than 9 digits");
      v = v * 10 + (s_[pos_++] - '0');
    }
    if (s_[start] == '0' && pos_ - start > 1) {
      return fail(fmt::format("number with a leading zero at offset {}", start));
    }
    used_.push_back(v);
    value = {v, 1};
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
  int depth_ = 0;
  std::string error_;
  std::string arithmetic_error_;
  std::vector<int64_t> used_;
};

}  // namespace

CountdownCheck check_countdown(std::string_view expression, std::span<const int64_t> numbers,
                               int64_t target) {
  CountdownCheck r;
  Parser parser(expression);
  Rational value;
  if (!parser.parse(value)) {
    r.error = "not an expression: " + parser.error();
    return r;
  }
  r.parsed = true;
  std::vector<int64_t> available(numbers.begin(), numbers.end());
  for (int64_t v : parser.numbers_used()) {
    const auto it = std::find(available.begin(), available.end(), v);
    if (it == available.end()) {
      r.error = fmt::format("uses {} more often than it is given", v);
      return r;
    }
    available.erase(it);
  }
  r.numbers_ok = true;
  if (!parser.arithmetic_error().empty()) {
    r.error = parser.arithmetic_error();
    return r;
  }
  if (value.den != 1 || value.num != target) {
    r.error = value.den == 1 ? fmt::format("evaluates to {}, not {}", value.num, target)
                             : fmt::format("evaluates to {}/{}, not {}", value.num, value.den, target);
    return r;
  }
  r.exact = true;
  return r;
}

namespace detail {

namespace {

constexpr int64_t kMaxNumbers = 6;

int precedence(char op) { return op == '+' || op == '-' ? 1 : 2; }
constexpr int kAtom = 3;

// A value of the reference solution with its text and the precedence of its outermost operator.
struct Term {
  int64_t value = 0;
  std::string text;
  int prec = kAtom;
};

// Fewest parentheses: the left operand needs them when it binds looser than op, the right one
// also when it binds equally and op is - or / (a-(b+c), a/(b*c)).
void combine(const Term& a, char op, const Term& b, Term& r) {
  const int p = precedence(op);
  r.value = op == '+' ? a.value + b.value
            : op == '-' ? a.value - b.value
            : op == '*' ? a.value * b.value
                        : a.value / b.value;
  r.prec = p;
  const bool paren_a = a.prec < p;
  const bool paren_b = b.prec < p || (b.prec == p && (op == '-' || op == '/'));
  r.text.clear();
  if (paren_a) r.text += '(';
  r.text += a.text;
  if (paren_a) r.text += ')';
  r.text += op;
  if (paren_b) r.text += '(';
  r.text += b.text;
  if (paren_b) r.text += ')';
}

class CountdownTask final : public Task {
 public:
  explicit CountdownTask(const TaskOptions& o)
      : Task(o), n_(o.get_int("n")), max_value_(o.get_int("max_value")),
        max_target_(o.get_int("max_target")), format_reward_(o.get_real("format_reward")) {
    FOURBIT_CHECK(max_target_ >= max_value_,
                  "task {}: max_target={} is smaller than max_value={}; raise max_target", name(),
                  max_target_, max_value_);
  }

  void generate(TaskRng& rng, Example& out) const override {
    out.inputs.resize(n_);
    for (int64_t& v : out.inputs) v = rng.uniform_int(1, max_value_);
    Term items[kMaxNumbers];
    Term merged;
    int64_t target = 0;
    for (int attempt = 0; attempt < 16; ++attempt) {
      for (int64_t i = 0; i < n_; ++i) {
        items[i].value = out.inputs[i];
        items[i].text.clear();
        append_int(items[i].text, out.inputs[i]);
        items[i].prec = kAtom;
      }
      for (int64_t m = n_; m > 1; --m) {
        int64_t i = rng.uniform_int(0, m - 1);
        int64_t j = rng.uniform_int(0, m - 2);
        if (j >= i) ++j;
        char ops[4];
        int n_ops = valid_ops(items[i].value, items[j].value, ops);
        if (n_ops == 0) {
          std::swap(i, j);
          n_ops = valid_ops(items[i].value, items[j].value, ops);
        }
        const char op = ops[rng.uniform_int(0, n_ops - 1)];
        combine(items[i], op, items[j], merged);
        // Remove i and j, append the merged item (order of the rest kept).
        std::swap(items[std::max(i, j)], items[m - 1]);
        std::swap(items[std::min(i, j)], items[m - 2]);
        std::swap(items[m - 2], merged);
      }
      target = items[0].value;
      if (std::find(out.inputs.begin(), out.inputs.end(), target) == out.inputs.end()) break;
    }
    out.prompt.assign("countdown");
    for (int64_t v : out.inputs) {
      out.prompt += ' ';
      append_int(out.prompt, v);
    }
    out.prompt += " to ";
    append_int(out.prompt, target);
    out.prompt += " = ";
    out.answer = items[0].text;
    out.inputs.push_back(target);
  }

  double score(const Example& example, std::string_view completion) const override {
    const std::optional<std::string_view> given = completion_answer(completion);
    if (!given || example.inputs.empty()) return 0.0;
    const std::span<const int64_t> numbers(example.inputs.data(), example.inputs.size() - 1);
    const CountdownCheck c = check_countdown(*given, numbers, example.inputs.back());
    return c.exact ? 1.0 : c.numbers_ok ? format_reward_ : 0.0;
  }

 private:
  int valid_ops(int64_t a, int64_t b, char* ops) const {
    int n = 0;
    if (a + b <= max_target_) ops[n++] = '+';
    if (a > b) ops[n++] = '-';
    if (a * b <= max_target_) ops[n++] = '*';
    if (a % b == 0) ops[n++] = '/';
    return n;
  }

  int64_t n_, max_value_, max_target_;
  double format_reward_;
};

}  // namespace

std::vector<TaskInfo> countdown_task_infos() {
  std::vector<TaskInfo> infos;
  infos.push_back(
      {"countdown",
       "reach the target with + - * / and each number at most once, "
       "\"countdown 25 3 7 2 to 70 = \" -> e.g. \"25*3-7+2\" (checked, any correct expression)",
       "countdown:n=3,max_value=10,max_target=50",
       {{"n", OptionKind::kInt, "4", 2, (double)kMaxNumbers, "", "how many numbers are given"},
        {"max_value", OptionKind::kInt, "20", 1, 1000, "", "largest given number (uniform in [1, max_value])"},
        {"max_target", OptionKind::kInt, "100", 1, 1000000, "",
         "largest target, and largest intermediate value of the reference solution"},
        {"format_reward", OptionKind::kReal, "0", 0, 1, "",
         "reward of a well-formed expression of given numbers that misses the target"}},
       [](const TaskOptions& o) -> std::unique_ptr<Task> { return std::make_unique<CountdownTask>(o); }});
  return infos;
}

}  // namespace detail

}  // namespace fourbit::rl
