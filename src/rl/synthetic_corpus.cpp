// The built-in synthetic corpus: one generator per document kind, each drawing from the
// document's own Philox stream (see synthetic_corpus.h for the format and the determinism
// contract). Generators append to the output string with no formatting library in the loop, which
// is what keeps the corpus at tens of MB/s.
#include "rl/synthetic_corpus.h"

#include "core/check.h"
#include "rl/byte_tokens.h"
#include "rl/task_catalog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fourbit::rl {

namespace {

using detail::append_int;

constexpr std::string_view kNames[] = {"Alice", "Bob",  "Carol", "Dave", "Emma", "Frank",
                                       "Grace", "Henry", "Ivy",  "Jack", "Kate", "Liam",
                                       "Mia",   "Noah", "Olga",  "Paul"};
struct Noun {
  std::string_view one, many;
};
constexpr Noun kObjects[] = {{"apple", "apples"}, {"book", "books"},   {"coin", "coins"},
                             {"pen", "pens"},     {"cup", "cups"},     {"stone", "stones"},
                             {"card", "cards"},   {"egg", "eggs"},     {"shell", "shells"},
                             {"stamp", "stamps"}, {"key", "keys"},     {"box", "boxes"},
                             {"pear", "pears"},   {"marble", "marbles"}};
constexpr std::string_view kColors[] = {"red",   "blue",  "green",  "yellow",
                                        "black", "white", "orange", "purple"};
constexpr std::string_view kAnimals[] = {"cat", "dog", "bird", "fish", "horse", "cow", "fox", "owl"};
constexpr std::string_view kCities[] = {"Paris", "Oslo",  "Rome",   "Cairo",  "Lima",
                                        "Tokyo", "Delhi", "Quito",  "Berlin", "Madrid"};
constexpr std::string_view kDays[] = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                      "Friday", "Saturday", "Sunday"};
constexpr std::string_view kMonths[] = {"January", "February", "March",     "April",
                                        "May",     "June",     "July",      "August",
                                        "September", "October", "November", "December"};
constexpr std::string_view kVariables[] = {"x", "y", "z", "a", "b", "c", "n", "m"};

template <typename T, size_t N>
int64_t pick_index(TaskRng& rng, const T (&)[N]) {
  return rng.uniform_int(0, (int64_t)N - 1);
}
template <typename T, size_t N>
const T& pick(TaskRng& rng, const T (&list)[N]) {
  return list[pick_index(rng, list)];
}

// Writes k distinct indices of [0, n) to idx (a partial Fisher-Yates shuffle; k <= n <= 32).
void pick_distinct(TaskRng& rng, int n, int k, int* idx) {
  int all[32];
  for (int i = 0; i < n; ++i) all[i] = i;
  for (int i = 0; i < k; ++i) {
    const int j = (int)rng.uniform_int(i, n - 1);
    std::swap(all[i], all[j]);
    idx[i] = all[i];
  }
}

void append_count(std::string& s, int64_t n, const Noun& noun) {
  append_int(s, n);
  s += ' ';
  s += n == 1 ? noun.one : noun.many;
}

// ---- story -------------------------------------------------------------------------------------

// People pass things around and the numbers stay consistent.
void story_exchange(TaskRng& rng, std::string& s) {
  int who[3];
  const int n_people = (int)rng.uniform_int(2, 3);
  pick_distinct(rng, (int)std::size(kNames), n_people, who);
  const Noun& noun = pick(rng, kObjects);
  int64_t count[3];
  for (int i = 0; i < n_people; ++i) {
    count[i] = rng.uniform_int(0, 12);
    s += kNames[who[i]];
    s += " has ";
    append_count(s, count[i], noun);
    s += ". ";
  }
  const int64_t n_events = rng.uniform_int(2, 5);
  for (int64_t e = 0; e < n_events; ++e) {
    const int p = (int)rng.uniform_int(0, n_people - 1);
    const int64_t type = rng.uniform_int(0, 2);
    if (type == 0 && count[p] > 0) {  // give
      int q = (int)rng.uniform_int(0, n_people - 2);
      if (q >= p) ++q;
      const int64_t k = rng.uniform_int(1, count[p]);
      count[p] -= k;
      count[q] += k;
      s += kNames[who[p]];
      s += " gives ";
      s += kNames[who[q]];
      s += ' ';
      append_count(s, k, noun);
      s += ". Now ";
      s += kNames[who[p]];
      s += " has ";
      append_count(s, count[p], noun);
      s += " and ";
      s += kNames[who[q]];
      s += " has ";
      append_count(s, count[q], noun);
      s += ". ";
    } else {  // finds (or loses, when there is something to lose)
      const bool lose = type == 1 && count[p] > 0;
      const int64_t k = rng.uniform_int(1, lose ? count[p] : 6);
      count[p] += lose ? -k : k;
      s += kNames[who[p]];
      s += lose ? " loses " : " finds ";
      append_count(s, k, noun);
      s += ". Now ";
      s += kNames[who[p]];
      s += " has ";
      append_count(s, count[p], noun);
      s += ". ";
    }
  }
  int64_t total = 0;
  for (int i = 0; i < n_people; ++i) total += count[i];
  s += "Together they have ";
  append_count(s, total, noun);
  s += ".\n";
}

void story_facts(TaskRng& rng, std::string& s) {
  int who[4];
  const int n_people = (int)rng.uniform_int(2, 4);
  pick_distinct(rng, (int)std::size(kNames), n_people, who);
  for (int i = 0; i < n_people; ++i) {
    const std::string_view name = kNames[who[i]];
    const std::string_view animal = pick(rng, kAnimals);
    s += name;
    s += " lives in ";
    s += pick(rng, kCities);
    s += ". ";
    s += name;
    s += " has a ";
    s += pick(rng, kColors);
    s += ' ';
    s += animal;
    s += ". The ";
    s += animal;
    s += " is ";
    append_int(s, rng.uniform_int(1, 15));
    s += " years old. ";
    s += name;
    s += " was born in ";
    s += pick(rng, kMonths);
    s += ".\n";
  }
}

void story_document(TaskRng& rng, std::string& s) {
  const int64_t n = rng.uniform_int(1, 2);
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) s += '\n';
    if (rng.uniform_int(0, 2) == 0) {
      story_facts(rng, s);
    } else {
      story_exchange(rng, s);
    }
  }
}

// ---- counting ----------------------------------------------------------------------------------

void counting_document(TaskRng& rng, std::string& s) {
  const int64_t n_lines = rng.uniform_int(3, 6);
  for (int64_t line = 0; line < n_lines; ++line) {
    switch (rng.uniform_int(0, 5)) {
      case 0: {  // count from a to b
        const int64_t a = rng.uniform_int(0, 100), len = rng.uniform_int(3, 12);
        s += "count from ";
        append_int(s, a);
        s += " to ";
        append_int(s, a + len - 1);
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          append_int(s, a + i);
        }
        break;
      }
      case 1: {  // count by a step
        const int64_t step = rng.uniform_int(2, 10), a = step * rng.uniform_int(0, 10);
        const int64_t len = rng.uniform_int(5, 10);
        s += "count by ";
        append_int(s, step);
        s += " from ";
        append_int(s, a);
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          append_int(s, a + i * step);
        }
        break;
      }
      case 2: {  // count down
        const int64_t len = rng.uniform_int(3, 12), a = rng.uniform_int(len - 1, 100);
        s += "count down from ";
        append_int(s, a);
        s += " to ";
        append_int(s, a - len + 1);
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          append_int(s, a - i);
        }
        break;
      }
      case 3: {  // letters
        const int64_t len = rng.uniform_int(3, 8), first = rng.uniform_int(0, 26 - len);
        s += "letters from ";
        s += (char)('a' + first);
        s += " to ";
        s += (char)('a' + first + len - 1);
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          s += (char)('a' + first + i);
        }
        break;
      }
      case 4: {  // days of the week, wrapping around
        const int64_t first = pick_index(rng, kDays), len = rng.uniform_int(3, 7);
        s += "days from ";
        s += kDays[first];
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          s += kDays[(first + i) % 7];
        }
        break;
      }
      default: {  // months, wrapping around
        const int64_t first = pick_index(rng, kMonths), len = rng.uniform_int(3, 6);
        s += "months from ";
        s += kMonths[first];
        s += ':';
        for (int64_t i = 0; i < len; ++i) {
          s += ' ';
          s += kMonths[(first + i) % 12];
        }
        break;
      }
    }
    s += '\n';
  }
}

// ---- records -----------------------------------------------------------------------------------

void records_document(TaskRng& rng, std::string& s) {
  // id and name always; each other field, in this fixed order, present in the whole document or
  // absent from it.
  bool age = false, city = false, color = false, pet = false, score = false;
  for (bool* f : {&age, &city, &color, &pet, &score}) *f = rng.uniform_int(0, 4) < 3;
  const int64_t n_records = rng.uniform_int(2, 5);
  const int64_t first_id = rng.uniform_int(1, 500);
  for (int64_t r = 0; r < n_records; ++r) {
    if (r > 0) s += '\n';
    s += "id: ";
    append_int(s, first_id + r);
    s += "\nname: ";
    s += pick(rng, kNames);
    s += '\n';
    if (age) {
      s += "age: ";
      append_int(s, rng.uniform_int(18, 80));
      s += '\n';
    }
    if (city) {
      s += "city: ";
      s += pick(rng, kCities);
      s += '\n';
    }
    if (color) {
      s += "color: ";
      s += pick(rng, kColors);
      s += '\n';
    }
    if (pet) {
      s += "pet: ";
      s += pick(rng, kAnimals);
      s += '\n';
    }
    if (score) {
      s += "score: ";
      append_int(s, rng.uniform_int(0, 100));
      s += '\n';
    }
  }
}

// ---- table -------------------------------------------------------------------------------------

void table_document(TaskRng& rng, std::string& s) {
  int cols[3], rows[5];
  const int n_cols = (int)rng.uniform_int(1, 3), n_rows = (int)rng.uniform_int(2, 5);
  pick_distinct(rng, (int)std::size(kObjects), n_cols, cols);
  pick_distinct(rng, (int)std::size(kNames), n_rows, rows);
  const bool total_col = n_cols > 1;
  s += "| name |";
  for (int c = 0; c < n_cols; ++c) {
    s += ' ';
    s += kObjects[cols[c]].many;
    s += " |";
  }
  if (total_col) s += " total |";
  s += "\n|";
  for (int c = 0; c < n_cols + 1 + total_col; ++c) s += "---|";
  s += '\n';
  int64_t col_sum[3] = {0, 0, 0};
  for (int r = 0; r < n_rows; ++r) {
    s += "| ";
    s += kNames[rows[r]];
    s += " |";
    int64_t row_sum = 0;
    for (int c = 0; c < n_cols; ++c) {
      const int64_t v = rng.uniform_int(0, 20);
      row_sum += v;
      col_sum[c] += v;
      s += ' ';
      append_int(s, v);
      s += " |";
    }
    if (total_col) {
      s += ' ';
      append_int(s, row_sum);
      s += " |";
    }
    s += '\n';
  }
  s += "| total |";
  int64_t all = 0;
  for (int c = 0; c < n_cols; ++c) {
    all += col_sum[c];
    s += ' ';
    append_int(s, col_sum[c]);
    s += " |";
  }
  if (total_col) {
    s += ' ';
    append_int(s, all);
    s += " |";
  }
  s += '\n';
}

// ---- program -----------------------------------------------------------------------------------

void program_document(TaskRng& rng, std::string& s) {
  const int64_t n_programs = rng.uniform_int(1, 3);
  for (int64_t p = 0; p < n_programs; ++p) {
    if (p > 0) s += '\n';
    int vars[4];
    int64_t value[4];
    const int n_vars = (int)rng.uniform_int(2, 4);
    pick_distinct(rng, (int)std::size(kVariables), n_vars, vars);
    for (int v = 0; v < n_vars; ++v) {
      s += kVariables[vars[v]];
      s += " = ";
      if (v == 0) {
        value[v] = rng.uniform_int(0, 20);
        append_int(s, value[v]);
      } else {
        // An earlier variable combined with a constant or another earlier variable.
        const int a = (int)rng.uniform_int(0, v - 1);
        const bool with_var = v > 1 && rng.uniform_int(0, 1) == 0;
        const int b = with_var ? (int)rng.uniform_int(0, v - 1) : -1;
        const int64_t rhs = with_var ? value[b] : rng.uniform_int(1, 9);
        int64_t op = rng.uniform_int(0, 2);
        if (op == 2 && value[a] * rhs > 1000) op = 0;  // keep values small
        value[v] = op == 0 ? value[a] + rhs : op == 1 ? value[a] - rhs : value[a] * rhs;
        s += kVariables[vars[a]];
        s += op == 0 ? " + " : op == 1 ? " - " : " * ";
        if (with_var) {
          s += kVariables[vars[b]];
        } else {
          append_int(s, rhs);
        }
      }
      s += '\n';
    }
    const int shown = (int)rng.uniform_int(0, n_vars - 1);
    s += "print(";
    s += kVariables[vars[shown]];
    s += ")\n";
    append_int(s, value[shown]);
    s += '\n';
  }
}

constexpr uint64_t kDocumentIndexBits = 56;

TaskRng document_rng(uint64_t seed, CorpusSplit split, uint64_t index) {
  FOURBIT_CHECK(index < (1ull << kDocumentIndexBits), "corpus document index {} is too large (< 2^{})",
                index, kDocumentIndexBits);
  return TaskRng(RandomStream{seed, (1ull << 63) | ((uint64_t)split << kDocumentIndexBits) | index});
}

}  // namespace

std::string_view document_kind_name(DocumentKind kind) {
  constexpr std::string_view kNamesOfKinds[kDocumentKindCount] = {"task",    "story", "counting",
                                                                  "records", "table", "program"};
  return kNamesOfKinds[(int)kind];
}

SyntheticCorpus::SyntheticCorpus(CorpusOptions options) : options_(std::move(options)) {
  double total = 0;
  for (int k = 0; k < kDocumentKindCount; ++k) {
    const double w = options_.weights[k];
    FOURBIT_CHECK(std::isfinite(w) && w >= 0, "corpus weight of '{}' documents is {}; weights must be >= 0",
                  document_kind_name((DocumentKind)k), w);
    total += w;
  }
  FOURBIT_CHECK(total > 0, "all corpus weights are 0; give at least one document kind a weight");
  double acc = 0;
  for (int k = 0; k < kDocumentKindCount; ++k) {
    acc += options_.weights[k];
    cumulative_[k] = acc / total;
  }
  // Rounding must not leave a sliver of [0, 1) past the last kind with a weight.
  int last = kDocumentKindCount - 1;
  while (options_.weights[last] == 0) --last;
  for (int k = last; k < kDocumentKindCount; ++k) cumulative_[k] = 1.0;
  FOURBIT_CHECK(options_.min_examples >= 1 && options_.min_examples <= options_.max_examples,
                "corpus examples per task document: min_examples={} and max_examples={} need "
                "1 <= min_examples <= max_examples",
                options_.min_examples, options_.max_examples);
  if (options_.task_specs.empty()) {
    for (const TaskInfo& info : task_infos()) options_.task_specs.emplace_back(info.easy_spec);
  }
  for (const std::string& spec : options_.task_specs) tasks_.push_back(make_task(spec));
}

DocumentKind SyntheticCorpus::document_kind(CorpusSplit split, uint64_t index) const {
  TaskRng rng = document_rng(options_.seed, split, index);
  const double u = rng.uniform01();
  int k = 0;
  while (u >= cumulative_[k]) ++k;  // cumulative_ ends with 1.0 > u
  return (DocumentKind)k;
}

DocumentKind SyntheticCorpus::document(CorpusSplit split, uint64_t index, std::string& out) const {
  const DocumentKind kind = document_kind(split, index);
  TaskRng rng = document_rng(options_.seed, split, index);
  rng.uniform01();  // the kind's draw
  out.clear();
  switch (kind) {
    case DocumentKind::kTask: {
      thread_local Example example;
      const Task& task = *tasks_[rng.uniform_int(0, (int64_t)tasks_.size() - 1)];
      const int64_t n = rng.uniform_int(options_.min_examples, options_.max_examples);
      for (int64_t i = 0; i < n; ++i) {
        task.generate(rng, example);
        out += example.prompt;
        out += example.answer;
        out += kEndOfAnswer;
      }
      break;
    }
    case DocumentKind::kStory: story_document(rng, out); break;
    case DocumentKind::kCounting: counting_document(rng, out); break;
    case DocumentKind::kRecords: records_document(rng, out); break;
    case DocumentKind::kTable: table_document(rng, out); break;
    case DocumentKind::kProgram: program_document(rng, out); break;
  }
  return kind;
}

std::string SyntheticCorpus::text(CorpusSplit split, uint64_t min_bytes, uint64_t first_document) const {
  std::string all, doc;
  all.reserve(min_bytes + 1024);
  for (uint64_t i = first_document; all.size() < min_bytes; ++i) {
    document(split, i, doc);
    all += doc;
    all += kEndOfDocumentText;
  }
  return all;
}

// ---- reader --------------------------------------------------------------------------------------

CorpusReader::CorpusReader(const SyntheticCorpus& corpus, CorpusSplit split, CorpusPosition start)
    : corpus_(&corpus), split_(split), document_(start.document), offset_(start.offset) {
  load(document_);
  FOURBIT_CHECK(offset_ <= text_.size(),
                "corpus position (document {}, offset {}) is past that document's {} tokens; was "
                "it saved with other corpus options?",
                start.document, start.offset, text_.size() + 1);
}

void CorpusReader::load(uint64_t document) {
  if (loaded_ == document) return;
  corpus_->document(split_, document, text_);
  loaded_ = document;
}

template <typename T>
void CorpusReader::fill(std::span<T> tokens) {
  size_t i = 0;
  while (i < tokens.size()) {
    load(document_);
    const size_t n = std::min<size_t>(tokens.size() - i, text_.size() - offset_);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(text_.data()) + offset_;
    for (size_t j = 0; j < n; ++j) tokens[i + j] = (T)bytes[j];
    i += n;
    offset_ += n;
    if (i < tokens.size()) {  // offset_ == text_.size(): the document's end token
      tokens[i++] = (T)kEndOfDocumentToken;
      ++document_;
      offset_ = 0;
    }
  }
}

void CorpusReader::fill_tokens(std::span<int32_t> tokens) { fill(tokens); }
void CorpusReader::fill_tokens(std::span<uint16_t> tokens) { fill(tokens); }

}  // namespace fourbit::rl
