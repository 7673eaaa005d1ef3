// rl tasks (cpu): determinism of make_example, reference answers recomputed independently from
// the prompt text, the difficulty ranges, the scoring rules of rl/task.h (end marker, trailing
// text, whitespace, partial credit), the countdown checker (reuse, non-exact values, rational
// arithmetic, grammar), and option parsing errors that name the option and list the allowed ones.
#include "core/error.h"
#include "rl/countdown.h"
#include "rl/task.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace fourbit::rl {
namespace {

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << parts.front();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(what.find(p), std::string::npos) << "message lacks '" << p << "': " << what;
    }
  }
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep)) parts.push_back(item);
  return parts;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s;
}

// Decimal without sign or leading zeros.
bool canonical_number(const std::string& s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), ::isdigit) &&
         (s.size() == 1 || s[0] != '0');
}

// ---- determinism -------------------------------------------------------------------------------

TEST(RlTasks, SameSeedAndIndexGiveTheSameExample) {
  for (const TaskInfo& info : task_infos()) {
    for (std::string spec : {std::string(info.name), std::string(info.easy_spec)}) {
      const auto a = make_task(spec);
      const auto b = make_task(spec);
      std::vector<Example> forward;
      for (uint64_t i = 0; i < 200; ++i) forward.push_back(a->make_example(7, i));
      int differs_by_seed = 0;
      for (uint64_t i = 200; i-- > 0;) {  // reverse order, a second instance
        const Example e = b->make_example(7, i);
        EXPECT_EQ(e.prompt, forward[i].prompt) << spec << " index " << i;
        EXPECT_EQ(e.answer, forward[i].answer) << spec << " index " << i;
        EXPECT_EQ(e.inputs, forward[i].inputs) << spec << " index " << i;
        differs_by_seed += b->make_example(8, i).prompt != e.prompt;
      }
      EXPECT_GT(differs_by_seed, 100) << spec;  // another seed, mostly other problems
      // Reusing an Example's storage changes nothing.
      Example reused = a->make_example(7, 5);
      a->make_example(7, 3, reused);
      EXPECT_EQ(reused.text(), forward[3].text()) << spec;
    }
  }
}

// Pinned examples: a change here changes every run's data; make it on purpose only.
TEST(RlTasks, PinnedExamples) {
  EXPECT_EQ(make_task("add")->make_example(1, 0).text(), "626+326=952\n");
  EXPECT_EQ(make_task("add")->make_example(1, 2).text(), "826+7=833\n");
  EXPECT_EQ(make_task("reverse")->make_example(1, 0).text(), "reverse 5 4 3 7 7 0 3 1 = 1 3 0 7 7 3 4 5\n");
  EXPECT_EQ(make_task("countdown")->make_example(1, 1).text(), "countdown 7 16 13 2 to 93 = 7*(13-2)+16\n");
}

TEST(RlTasks, TasksWithTheSameSeedDrawIndependently) {
  const auto add = make_task("add:digits=2,min_digits=2");
  const auto mul = make_task("mul:digits=2,min_digits=2");
  int same = 0;
  for (uint64_t i = 0; i < 100; ++i) {
    same += add->make_example(3, i).inputs == mul->make_example(3, i).inputs;
  }
  EXPECT_LT(same, 3);
}

// ---- reference answers, recomputed from the prompt ----------------------------------------------

TEST(RlTasks, ArithmeticAnswersAndDigitRanges) {
  struct Case {
    std::string spec;
    int min_digits, max_digits;
  };
  for (const Case& c : {Case{"add:digits=3", 1, 3}, Case{"add:digits=18,min_digits=17", 17, 18},
                        Case{"mul:digits=2", 1, 2}, Case{"mul:digits=9,min_digits=9", 9, 9},
                        Case{"arith:digits=3,ops=+-*", 1, 3}}) {
    const std::string& spec = c.spec;
    const int min_digits = c.min_digits, max_digits = c.max_digits;
    const auto task = make_task(spec);
    std::set<size_t> lengths;
    std::set<char> ops;
    for (uint64_t i = 0; i < 2000; ++i) {
      const Example e = task->make_example(11, i);
      ASSERT_EQ(e.prompt.back(), '=') << e.prompt;
      const size_t op_pos = e.prompt.find_first_of("+-*", 1);
      ASSERT_NE(op_pos, std::string::npos) << e.prompt;
      const std::string a = e.prompt.substr(0, op_pos);
      const std::string b = e.prompt.substr(op_pos + 1, e.prompt.size() - op_pos - 2);
      ASSERT_TRUE(canonical_number(a) && canonical_number(b)) << e.prompt;
      for (const std::string& x : {a, b}) {
        EXPECT_GE((int)x.size(), min_digits) << spec << ": " << e.prompt;
        EXPECT_LE((int)x.size(), max_digits) << spec << ": " << e.prompt;
        lengths.insert(x.size());
      }
      const char op = e.prompt[op_pos];
      ops.insert(op);
      const __int128 va = std::stoll(a), vb = std::stoll(b);
      const __int128 r = op == '+' ? va + vb : op == '-' ? va - vb : va * vb;
      EXPECT_EQ(e.answer, std::to_string((long long)r)) << e.prompt;
      EXPECT_EQ(e.inputs, (std::vector<int64_t>{(int64_t)va, (int64_t)vb}));
      EXPECT_EQ(task->score(e, e.answer + "\n"), 1.0);
    }
    EXPECT_EQ((int)lengths.size(), max_digits - min_digits + 1) << spec << ": every digit count occurs";
    if (spec.rfind("arith", 0) == 0) {
      EXPECT_EQ(ops.size(), 3u);
    }
  }
}

TEST(RlTasks, ListAnswersAndLengths) {
  struct Case {
    std::string spec;
    int64_t max_value;
    std::set<size_t> lengths;  // every length that occurs
  };
  for (const Case& c : {Case{"reverse", 9, {2, 3, 4, 5, 6, 7, 8}}, Case{"reverse:len=4,max_value=0", 0, {2, 3, 4}},
                        Case{"sort", 99, {2, 3, 4, 5, 6, 7, 8}}, Case{"sort:len=12,min_len=12", 99, {12}}}) {
    const std::string& spec = c.spec;
    const auto task = make_task(spec);
    const bool sort = spec.rfind("sort", 0) == 0;
    std::set<size_t> lengths;
    for (uint64_t i = 0; i < 1000; ++i) {
      const Example e = task->make_example(5, i);
      const std::string head = sort ? "sort " : "reverse ";
      ASSERT_EQ(e.prompt.rfind(head, 0), 0u) << e.prompt;
      ASSERT_EQ(e.prompt.substr(e.prompt.size() - 3), " = ") << e.prompt;
      std::vector<int64_t> items;
      for (const std::string& t : split(e.prompt.substr(head.size(), e.prompt.size() - head.size() - 3), ' ')) {
        ASSERT_TRUE(canonical_number(t)) << e.prompt;
        items.push_back(std::stoll(t));
      }
      EXPECT_EQ(items, e.inputs);
      lengths.insert(items.size());
      for (int64_t v : items) EXPECT_LE(v, c.max_value) << e.prompt;
      if (sort) {
        std::sort(items.begin(), items.end());
      } else {
        std::reverse(items.begin(), items.end());
      }
      EXPECT_EQ(e.answer, join(items)) << e.prompt;
    }
    EXPECT_EQ(lengths, c.lengths) << spec;
  }
}

// An evaluator written independently of check_countdown: shunting-yard to postfix, then long
// double arithmetic.
long double evaluate(const std::string& expr, std::vector<int64_t>& numbers) {
  std::vector<std::string> out;
  std::vector<char> stack;
  auto prec = [](char c) { return c == '+' || c == '-' ? 1 : 2; };
  for (size_t i = 0; i < expr.size();) {
    const char c = expr[i];
    if (isdigit(c)) {
      size_t j = i;
      while (j < expr.size() && isdigit(expr[j])) ++j;
      out.push_back(expr.substr(i, j - i));
      numbers.push_back(std::stoll(out.back()));
      i = j;
      continue;
    }
    if (c == '(') {
      stack.push_back(c);
    } else if (c == ')') {
      while (stack.back() != '(') out.emplace_back(1, stack.back()), stack.pop_back();
      stack.pop_back();
    } else {
      while (!stack.empty() && stack.back() != '(' && prec(stack.back()) >= prec(c)) {
        out.emplace_back(1, stack.back());
        stack.pop_back();
      }
      stack.push_back(c);
    }
    ++i;
  }
  while (!stack.empty()) out.emplace_back(1, stack.back()), stack.pop_back();
  std::vector<long double> values;
  for (const std::string& t : out) {
    if (isdigit(t[0])) {
      values.push_back(std::stold(t));
      continue;
    }
    const long double b = values.back();
    values.pop_back();
    long double& a = values.back();
    a = t[0] == '+' ? a + b : t[0] == '-' ? a - b : t[0] == '*' ? a * b : a / b;
  }
  return values.at(0);
}

TEST(RlTasks, CountdownReferenceSolutionsReachTheTarget) {
  struct Case {
    std::string spec;
    int64_t max_value, max_target;
  };
  for (const Case& c : {Case{"countdown", 20, 100}, Case{"countdown:n=3,max_value=10,max_target=50", 10, 50},
                        Case{"countdown:n=6,max_value=100,max_target=1000", 100, 1000}}) {
    const std::string& spec = c.spec;
    const int64_t max_value = c.max_value, max_target = c.max_target;
    const auto task = make_task(spec);
    int target_is_input = 0;
    for (uint64_t i = 0; i < 1000; ++i) {
      const Example e = task->make_example(2, i);
      // "countdown 25 3 7 2 to 70 = "
      const std::vector<std::string> words = split(e.prompt, ' ');
      ASSERT_GE(words.size(), 6u) << e.prompt;
      ASSERT_EQ(words[0], "countdown");
      ASSERT_EQ(words[words.size() - 3], "to");
      ASSERT_EQ(words.back(), "=");
      std::vector<int64_t> given;
      for (size_t w = 1; w + 3 < words.size(); ++w) given.push_back(std::stoll(words[w]));
      const int64_t target = std::stoll(words[words.size() - 2]);
      for (int64_t v : given) EXPECT_TRUE(v >= 1 && v <= max_value) << e.prompt;
      EXPECT_TRUE(target >= 1 && target <= max_target) << e.prompt;
      target_is_input += std::count(given.begin(), given.end(), target) > 0;
      std::vector<int64_t> expected_inputs = given;
      expected_inputs.push_back(target);
      EXPECT_EQ(e.inputs, expected_inputs);
      // The reference uses every number exactly once and reaches the target.
      std::vector<int64_t> used;
      const long double v = evaluate(e.answer, used);
      EXPECT_LT(std::fabs(v - (long double)target), 1e-9L) << e.prompt << e.answer;
      std::sort(used.begin(), used.end());
      std::sort(given.begin(), given.end());
      EXPECT_EQ(used, given) << e.prompt << e.answer;
      EXPECT_EQ(task->score(e, e.answer + "\n"), 1.0) << e.prompt << e.answer;
    }
    EXPECT_LT(target_is_input, 20) << spec;  // redrawn, except rarely
  }
}

// ---- scoring -----------------------------------------------------------------------------------

TEST(RlTasks, ExactScoringRules) {
  Example e;
  e.prompt = "12+345=";
  e.answer = "357";
  const auto add = make_task("add");
  EXPECT_EQ(add->score(e, "357\n"), 1.0);
  EXPECT_EQ(add->score(e, "357\n12+1=13\n"), 1.0);  // after the end marker: ignored
  EXPECT_EQ(add->score(e, "358\n"), 0.0);          // wrong
  EXPECT_EQ(add->score(e, "357"), 0.0);            // no end marker
  EXPECT_EQ(add->score(e, "357x\n"), 0.0);         // trailing text before the marker
  EXPECT_EQ(add->score(e, "3570\n"), 0.0);
  EXPECT_EQ(add->score(e, " 357\n"), 0.0);         // no whitespace is trimmed
  EXPECT_EQ(add->score(e, "357 \n"), 0.0);
  EXPECT_EQ(add->score(e, "357\r\n"), 0.0);
  EXPECT_EQ(add->score(e, "0357\n"), 0.0);
  EXPECT_EQ(add->score(e, "\n"), 0.0);
  EXPECT_EQ(add->score(e, ""), 0.0);
  EXPECT_EQ(completion_answer("357\nabc"), std::optional<std::string_view>("357"));
  EXPECT_EQ(completion_answer("357"), std::nullopt);
  EXPECT_EQ(e.text(), "12+345=357\n");
}

TEST(RlTasks, ListPartialCredit) {
  const auto strict = make_task("reverse");
  const auto partial = make_task("reverse:partial=1");
  Example e;
  e.prompt = "reverse 3 9 1 4 = ";
  e.answer = "4 1 9 3";
  e.inputs = {3, 9, 1, 4};
  EXPECT_EQ(strict->score(e, "4 1 9 3\n"), 1.0);
  EXPECT_EQ(partial->score(e, "4 1 9 3\n"), 1.0);
  EXPECT_EQ(strict->score(e, "4 1 9 2\n"), 0.0);
  EXPECT_EQ(partial->score(e, "4 1 9 2\n"), 0.75);
  EXPECT_EQ(partial->score(e, "4 1 9\n"), 0.75);       // one item short
  EXPECT_EQ(partial->score(e, "4 1 9 3 5\n"), 0.8);    // one item extra
  EXPECT_EQ(partial->score(e, "4 1 9 3 \n"), 0.8);     // a stray space costs an item
  EXPECT_EQ(partial->score(e, "1 9 3\n"), 0.0);        // positions, not a subsequence
  EXPECT_EQ(partial->score(e, "4 1 9 3"), 0.0);        // no end marker: nothing
  EXPECT_EQ(partial->score(e, "\n"), 0.0);
}

TEST(RlTasks, CountdownChecker) {
  const std::vector<int64_t> n = {25, 3, 7, 2};
  auto check = [&](std::string_view expr, int64_t target) { return check_countdown(expr, n, target); };
  CountdownCheck c = check("25*3-7+2", 70);
  EXPECT_TRUE(c.exact) << c.error;
  EXPECT_TRUE(check("25 * 3 - 7 + 2", 70).exact);       // spaces between tokens
  EXPECT_TRUE(check("(25-7)*(3+2)", 90).exact);
  EXPECT_TRUE(check("25*3", 75).exact);                // a subset is fine
  EXPECT_TRUE(check_countdown("7/2*4", std::vector<int64_t>{7, 2, 4}, 14).exact);  // rational, left to right
  EXPECT_TRUE(check("(25+3)/(7*2)", 2).exact);
  c = check("25*3-7+3", 71);                           // 3 reused
  EXPECT_TRUE(c.parsed);
  EXPECT_FALSE(c.numbers_ok);
  EXPECT_NE(c.error.find("3"), std::string::npos) << c.error;
  EXPECT_FALSE(check("5*3", 15).numbers_ok);           // 5 is not given
  c = check("25*3-7", 70);                             // uses given numbers, misses
  EXPECT_TRUE(c.numbers_ok);
  EXPECT_FALSE(c.exact);
  EXPECT_NE(c.error.find("68"), std::string::npos) << c.error;
  c = check("7/2", 3);                                 // 7/2 is not 3: no rounding
  EXPECT_TRUE(c.numbers_ok);
  EXPECT_FALSE(c.exact);
  EXPECT_FALSE(check("7/2+25", 28).exact);
  c = check_countdown("5/(3-3)", std::vector<int64_t>{5, 3, 3}, 1);  // division by zero
  EXPECT_TRUE(c.numbers_ok);
  EXPECT_FALSE(c.exact);
  EXPECT_NE(c.error.find("division by zero"), std::string::npos) << c.error;
  EXPECT_TRUE(check_countdown("3*3-2", std::vector<int64_t>{3, 3, 2}, 7).exact);  // given twice
  // Grammar.
  for (std::string_view bad : {"", " ", "-3+25", "25*(3-7", "25*3)", "25**3", "25 3", "025+3",
                               "25*3-7+2=70", "2.5*2", "x", "()", "+"}) {
    c = check(bad, 70);
    EXPECT_FALSE(c.parsed) << "'" << bad << "'";
    EXPECT_FALSE(c.exact);
    EXPECT_FALSE(c.error.empty());
  }
  std::string deep(40, '(');
  deep += "3" + std::string(40, ')');
  EXPECT_FALSE(check(deep, 3).parsed);
  EXPECT_FALSE(check(std::string(300, ' ') + "3", 3).parsed);
  EXPECT_FALSE(check("1234567890", 3).parsed);
}

TEST(RlTasks, CountdownScore) {
  Example e;
  e.prompt = "countdown 25 3 7 2 to 70 = ";
  e.answer = "25*3-7+2";
  e.inputs = {25, 3, 7, 2, 70};
  const auto exact = make_task("countdown");
  const auto lenient = make_task("countdown:format_reward=0.1");
  EXPECT_EQ(exact->score(e, "25*3-7+2\n"), 1.0);
  EXPECT_EQ(exact->score(e, "2+25*3-7\n"), 1.0);  // another correct expression
  EXPECT_EQ(exact->score(e, "25*3-7+2"), 0.0);    // no end marker
  EXPECT_EQ(exact->score(e, "25*3-7\n"), 0.0);
  EXPECT_EQ(lenient->score(e, "25*3-7\n"), 0.1);  // well formed, misses the target
  EXPECT_EQ(lenient->score(e, "25*3-7+3\n"), 0.0);  // reuse earns nothing
  EXPECT_EQ(lenient->score(e, "25*3-7+2=70\n"), 0.0);
  EXPECT_EQ(lenient->score(e, "25*3-7+2\n"), 1.0);
}

// ---- options -----------------------------------------------------------------------------------

TEST(RlTasks, SpecsAndDefaults) {
  EXPECT_EQ(make_task("add")->spec(), "add:digits=3,min_digits=1");
  EXPECT_EQ(make_task("add:min_digits=2,digits=4")->spec(), "add:digits=4,min_digits=2");
  EXPECT_EQ(make_task("arith:ops=-")->spec(), "arith:digits=2,min_digits=1,ops=-");
  EXPECT_EQ(make_task("countdown:format_reward=0.25")->spec(),
            "countdown:n=4,max_value=20,max_target=100,format_reward=0.25");
  EXPECT_EQ(make_task("sort")->name(), "sort");
  std::set<std::string> names;
  for (const TaskInfo& info : task_infos()) {
    names.insert(std::string(info.name));
    EXPECT_EQ(make_task(info.easy_spec)->name(), info.name);
    EXPECT_NE(describe_tasks().find(std::string(info.name) + ": "), std::string::npos);
  }
  EXPECT_EQ(names, (std::set<std::string>{"add", "mul", "arith", "reverse", "sort", "countdown"}));
}

TEST(RlTasks, OptionErrorsNameTheOptionAndListTheAllowedOnes) {
  expect_error([] { make_task("ad:digits=3"); }, {"unknown task 'ad'", "add, mul, arith, reverse, sort, countdown"});
  expect_error([] { make_task(""); }, {"no task name"});
  expect_error([] { make_task(":digits=3"); }, {"no task name"});
  expect_error([] { make_task("add:digit=3"); }, {"'add:digit=3'", "no option 'digit'", "digits (default 3)", "min_digits (default 1)"});
  expect_error([] { make_task("add:digits"); }, {"option 'digits' has no value", "digits=VALUE"});
  expect_error([] { make_task("add:"); }, {"expected key=value"});
  expect_error([] { make_task("add:digits=3,"); }, {"expected key=value"});
  expect_error([] { make_task("add:digits=abc"); }, {"digits=abc", "an integer in [1, 18]"});
  expect_error([] { make_task("add:digits=3.5"); }, {"digits=3.5", "an integer"});
  expect_error([] { make_task("add:digits="); }, {"digits=", "an integer"});
  expect_error([] { make_task("add:digits=19"); }, {"digits=19", "[1, 18]"});
  expect_error([] { make_task("mul:digits=10"); }, {"digits=10", "[1, 9]"});
  expect_error([] { make_task("add:digits=0"); }, {"digits=0"});
  expect_error([] { make_task("add:digits=3,digits=4"); }, {"'digits' is given twice"});
  expect_error([] { make_task("add:digits=2,min_digits=3"); }, {"min_digits=3", "digits=2"});
  expect_error([] { make_task("arith:ops=+/"); }, {"ops=+/", "'+-*'"});
  expect_error([] { make_task("arith:ops=++"); }, {"ops=++", "each at most once"});
  expect_error([] { make_task("reverse:len=3,min_len=4"); }, {"min_len=4", "len=3"});
  expect_error([] { make_task("reverse:len=65"); }, {"len=65", "[1, 64]"});
  expect_error([] { make_task("countdown:format_reward=2"); }, {"format_reward=2", "[0, 1]"});
  expect_error([] { make_task("countdown:format_reward=nan"); }, {"format_reward=nan"});
  expect_error([] { make_task("countdown:max_value=50,max_target=20"); }, {"max_target=20", "max_value=50"});
  expect_error([] { make_task("countdown:n=7"); }, {"n=7", "[2, 6]"});
  expect_error([] { task_info("nope"); }, {"unknown task 'nope'", "countdown"});
}

}  // namespace
}  // namespace fourbit::rl
