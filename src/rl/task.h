// Verifiable tasks: seeded (prompt, answer) generators with an exact scorer, for RL rewards and
// for the solved examples of the built-in pretraining corpus (rl/synthetic_corpus.h).
//
// Text format. Plain ASCII (the default job's tokenizer is byte-level, rl/byte_tokens.h):
//
//   example text = prompt + answer + kEndOfAnswer            (kEndOfAnswer = '\n')
//
// The prompt ends with whatever precedes the answer, so the answer starts at the first generated
// byte: "=" for the arithmetic tasks (no spaces anywhere), "= " for the word tasks.
//
//   | task      | prompt                           | answer (then '\n')               |
//   |-----------|----------------------------------|----------------------------------|
//   | add       | "12+345="                        | "357"                            |
//   | mul       | "12*34="                         | "408"                            |
//   | arith     | "12-34=" (ops from the op list)  | "-22"                            |
//   | reverse   | "reverse 3 9 1 4 = "             | "4 1 9 3"                        |
//   | sort      | "sort 31 9 17 4 = "              | "4 9 17 31"                      |
//   | countdown | "countdown 25 3 7 2 to 70 = "    | an expression, e.g. "25*3-7+2"   |
//
// Numbers are written in decimal without leading zeros or signs (a negative result has a '-').
// A sampler should start the prompt after kEndOfDocumentToken: in the corpus a task document's
// first example follows that token, the others follow the '\n' of the previous example.
//
// Scoring (all tasks). The completion is the generated text after the prompt, as bytes (the caller
// stops at, and drops, any token that is not a byte, such as kEndOfDocumentToken). The completion's
// answer is its text before the first '\n'; a completion without '\n' scores 0 (missing end marker:
// the sampler ran out of length or stopped at the end of a document). Text after the first '\n' is
// ignored (the sampler stops there). Nothing is trimmed: " 357\n", "357 \n", "357\r\n" and
// "357x\n" score 0, because the format is fixed and a model pretrained on it emits it exactly.
// Reward is 1 for the exact answer and 0 otherwise, except where a task's options ask for partial
// credit (list tasks: partial=1; countdown: format_reward), documented with the option. Countdown
// is scored by a checker, not a string compare: any expression that reaches the target counts.
//
// Determinism. Task::make_example(seed, index) is a pure function of (task name, options, seed,
// index): draws come from the Philox stream keyed by (seed, task name, index) (core/rng.h), so
// examples can be generated in any order, on any thread, and replayed exactly. The corpus calls
// Task::generate with its own streams, so its examples never coincide by construction with the
// examples make_example hands to RL (except where the problem space is tiny).
//
// Tasks are made from a spec string, "name" or "name:key=value,key=value" (e.g. "add:digits=3");
// the registry (task_infos) declares every task's options with defaults, ranges and help, and
// errors name the offending option and list the allowed ones.
#pragma once

#include "core/rng.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::rl {

inline constexpr char kEndOfAnswer = '\n';

// One problem with its reference answer.
struct Example {
  std::string prompt;           // ends with the separator before the answer, e.g. "12+345="
  std::string answer;           // the reference answer, without kEndOfAnswer
  std::vector<int64_t> inputs;  // the problem's integers: the two operands (arithmetic), the list
                                // (reverse, sort), the numbers then the target (countdown)

  // prompt + answer + kEndOfAnswer: a solved example as the corpus writes it.
  std::string text() const;
};

// Sequential draws from one Philox stream: draw number k is word k of the stream, so a generator
// that makes the same calls gets the same values. Small and cheap to construct (one per example).
class TaskRng {
 public:
  explicit TaskRng(RandomStream stream) : stream_(stream) {}

  uint32_t next_u32();
  uint64_t next_u64();
  // Uniform integer in [lo, hi] (inclusive; lo <= hi). Multiply-shift on 64 random bits: the bias
  // is below (hi - lo + 1) / 2^64.
  int64_t uniform_int(int64_t lo, int64_t hi);
  // Uniform in [0, 1) with 53 random bits.
  double uniform01();

 private:
  RandomStream stream_;
  uint64_t word_ = 0;      // index of the next 32-bit word of the stream
  Philox4x32Result block_{};  // the Philox block that holds word_ - 1 (valid when word_ % 4 != 0)
};

enum class OptionKind { kInt, kReal, kText };

// One option of a task, as declared in the registry (the single source of parsing, validation,
// defaults and help).
struct TaskOptionSpec {
  std::string_view name;
  OptionKind kind = OptionKind::kInt;
  std::string_view default_value;  // as it would be written in a spec
  double min = 0, max = 0;         // kInt, kReal: the allowed range, inclusive
  std::string_view allowed;        // kText: the allowed characters (each used at most once)
  std::string_view help;
};

class Task;
class TaskOptions;

// A task in the registry.
struct TaskInfo {
  std::string_view name;
  std::string_view summary;    // one line for people, with an example
  std::string_view easy_spec;  // the difficulty the synthetic corpus teaches (RL then trains on
                               // harder specs, e.g. the defaults)
  std::vector<TaskOptionSpec> options;
  std::unique_ptr<Task> (*make)(const TaskOptions& options) = nullptr;
};

// Every option of one task, parsed and validated, defaults filled in.
class TaskOptions {
 public:
  TaskOptions(const TaskInfo& info, std::vector<std::string> values)
      : info_(&info), values_(std::move(values)) {}

  const TaskInfo& info() const { return *info_; }
  int64_t get_int(std::string_view name) const;
  double get_real(std::string_view name) const;
  const std::string& get_text(std::string_view name) const;
  // "name:key=value,..." with every option in declared order: the canonical spec.
  std::string canonical_spec() const;

 private:
  size_t find(std::string_view name, OptionKind kind) const;
  const TaskInfo* info_;
  std::vector<std::string> values_;  // values_[i] belongs to info().options[i]
};

// The interface every task implements: generate an example from a random stream, score a
// completion. Implementations are immutable after construction, so one Task may be shared by
// threads.
class Task {
 public:
  explicit Task(const TaskOptions& options);
  virtual ~Task() = default;

  const std::string& name() const { return name_; }
  // The canonical spec: every option with its value, e.g. "add:digits=3,min_digits=1".
  const std::string& spec() const { return spec_; }

  // Example number `index` (< 2^40) of the sequence keyed by `seed`: a pure function of (name,
  // options, seed, index). The second form reuses out's storage.
  Example make_example(uint64_t seed, uint64_t index) const;
  void make_example(uint64_t seed, uint64_t index, Example& out) const;

  // Draws one example from `rng` into `out` (overwriting all its fields, reusing its storage).
  virtual void generate(TaskRng& rng, Example& out) const = 0;

  // Reward in [0, 1] of `completion` (the generated text after example.prompt) for `example`.
  // Default: score_exact(example.answer, completion).
  virtual double score(const Example& example, std::string_view completion) const;

 private:
  std::string name_;
  std::string spec_;
  uint64_t stream_salt_;  // from the name; keeps tasks' streams apart for the same seed
};

// The text of `completion` before its first kEndOfAnswer; nullopt when it has none.
std::optional<std::string_view> completion_answer(std::string_view completion);

// 1 when completion is exactly `answer` followed by kEndOfAnswer (anything after that ignored),
// else 0.
double score_exact(std::string_view answer, std::string_view completion);

// Every registered task, in a fixed order.
const std::vector<TaskInfo>& task_infos();

// The registry entry named `name`; throws an Error listing the task names if there is none.
const TaskInfo& task_info(std::string_view name);

// Parses "name" or "name:key=value,key=value,..." and builds the task. Throws an Error that names
// the offending part (unknown task, unknown or repeated option, missing '=', a value that does
// not parse or is out of range) and lists what is allowed.
std::unique_ptr<Task> make_task(std::string_view spec);

// For --help texts: every task with its summary, options (default, range, help) and easy spec.
std::string describe_tasks();

}  // namespace fourbit::rl
