// rl synthetic corpus (cpu): determinism (by index, across readers and chunkings, resume from a
// position), the text form equals the token stream, the document mixture matches its weights,
// bytes are printable ASCII or '\n' and tokens lie in [0, kByteVocabSize), the validation split
// differs from the training split, task documents hold correct examples at the easy difficulty,
// tables add up, option errors; and a predictability check (a bigram model fit on the train split
// has a validation loss far below the uniform ln 257).
#include "core/error.h"
#include "rl/byte_tokens.h"
#include "rl/countdown.h"
#include "rl/synthetic_corpus.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <set>
#include <sstream>

namespace fourbit::rl {
namespace {

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> lines;
  std::stringstream in(s);
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep)) parts.push_back(item);
  return parts;
}

// The byte-level tokenizer contract of rl/byte_tokens.h, written out independently.
std::vector<int32_t> encode(const std::string& text) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, kEndOfDocumentText.size(), kEndOfDocumentText) == 0) {
      ids.push_back(kEndOfDocumentToken);
      i += kEndOfDocumentText.size();
    } else {
      ids.push_back((unsigned char)text[i++]);
    }
  }
  return ids;
}

TEST(RlSyntheticCorpus, DocumentsArePureFunctionsOfSeedSplitAndIndex) {
  const SyntheticCorpus a, b;
  std::vector<std::string> forward(300);
  for (uint64_t i = 0; i < forward.size(); ++i) a.document(CorpusSplit::kTrain, i, forward[i]);
  std::string doc;
  for (uint64_t i = forward.size(); i-- > 0;) {
    const DocumentKind kind = b.document(CorpusSplit::kTrain, i, doc);
    EXPECT_EQ(doc, forward[i]) << "document " << i;
    EXPECT_EQ(kind, a.document_kind(CorpusSplit::kTrain, i));
  }
  CorpusOptions other;
  other.seed = 1;
  const SyntheticCorpus c(other);
  int same = 0;
  for (uint64_t i = 0; i < forward.size(); ++i) {
    c.document(CorpusSplit::kTrain, i, doc);
    same += doc == forward[i];
  }
  EXPECT_EQ(same, 0);
}

TEST(RlSyntheticCorpus, ReaderChunkingAndResume) {
  const SyntheticCorpus corpus;
  constexpr size_t kTokens = 200000;
  std::vector<int32_t> whole(kTokens);
  CorpusReader(corpus, CorpusSplit::kTrain).fill_tokens(whole);
  // The same stream read in uneven chunks, as uint16, resuming a new reader at each position.
  std::vector<uint16_t> chunked(kTokens);
  CorpusPosition pos;
  size_t done = 0, chunk = 1;
  while (done < kTokens) {
    const size_t n = std::min(chunk, kTokens - done);
    CorpusReader reader(corpus, CorpusSplit::kTrain, pos);
    reader.fill_tokens(std::span<uint16_t>(chunked.data() + done, n));
    pos = reader.position();
    done += n;
    chunk = chunk * 7 % 1013 + 1;
  }
  for (size_t i = 0; i < kTokens; ++i) ASSERT_EQ((int32_t)chunked[i], whole[i]) << "token " << i;
  // The text form tokenizes to the same stream.
  const std::string text = corpus.text(CorpusSplit::kTrain, 2 * kTokens);  // the marker is 13 bytes
  std::vector<int32_t> ids = encode(text);
  ASSERT_GE(ids.size(), kTokens);
  ids.resize(kTokens);
  EXPECT_EQ(ids, whole);
  // A position past a document's end is refused.
  expect_error([&] { CorpusReader(corpus, CorpusSplit::kTrain, {0, 1u << 30}); }, "past that document");
}

TEST(RlSyntheticCorpus, MixtureMatchesTheWeights) {
  const SyntheticCorpus corpus;
  constexpr int kDocs = 20000;
  int count[kDocumentKindCount] = {};
  for (uint64_t i = 0; i < kDocs; ++i) ++count[(int)corpus.document_kind(CorpusSplit::kTrain, i)];
  double total = 0;
  for (double w : corpus.options().weights) total += w;
  for (int k = 0; k < kDocumentKindCount; ++k) {
    const double p = corpus.options().weights[k] / total;
    const double sigma = std::sqrt(p * (1 - p) / kDocs);
    EXPECT_NEAR((double)count[k] / kDocs, p, 5 * sigma) << document_kind_name((DocumentKind)k);
  }
  // Weights select kinds; zero weights never occur. Task documents draw their task uniformly.
  CorpusOptions only;
  std::fill(std::begin(only.weights), std::end(only.weights), 0.0);
  only.weights[(int)DocumentKind::kTable] = 1;
  only.weights[(int)DocumentKind::kTask] = 3;
  only.task_specs = {"add:digits=1", "reverse:len=3"};
  const SyntheticCorpus custom(only);
  int tables = 0, adds = 0, reverses = 0;
  std::string doc;
  for (uint64_t i = 0; i < 4000; ++i) {
    const DocumentKind kind = custom.document(CorpusSplit::kTrain, i, doc);
    ASSERT_TRUE(kind == DocumentKind::kTable || kind == DocumentKind::kTask);
    tables += kind == DocumentKind::kTable;
    if (kind == DocumentKind::kTask) (doc[0] == 'r' ? reverses : adds) += 1;
  }
  EXPECT_NEAR(tables / 4000.0, 0.25, 0.035);
  EXPECT_NEAR((double)adds / (adds + reverses), 0.5, 0.04);
}

TEST(RlSyntheticCorpus, PrintableAsciiAndTokenRange) {
  const SyntheticCorpus corpus;
  std::vector<int32_t> tokens(500000);
  CorpusReader(corpus, CorpusSplit::kValidation).fill_tokens(tokens);
  int64_t documents = 0;
  int32_t previous = kEndOfDocumentToken;
  for (int32_t t : tokens) {
    ASSERT_TRUE(t == '\n' || (t >= 0x20 && t <= 0x7E) || t == kEndOfDocumentToken) << t;
    if (t == kEndOfDocumentToken) {
      ++documents;
      EXPECT_EQ(previous, '\n') << "documents end with a newline";
    }
    EXPECT_FALSE(previous == kEndOfDocumentToken && t == kEndOfDocumentToken) << "empty document";
    previous = t;
  }
  EXPECT_GT(documents, 1000);
  EXPECT_LT(kEndOfDocumentToken, kByteVocabSize);
}

TEST(RlSyntheticCorpus, ValidationSplitDiffersFromTrain) {
  const SyntheticCorpus corpus;
  std::set<std::string> train;
  std::string doc;
  for (uint64_t i = 0; i < 5000; ++i) {
    corpus.document(CorpusSplit::kTrain, i, doc);
    train.insert(doc);
  }
  int seen = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    corpus.document(CorpusSplit::kValidation, i, doc);
    seen += train.count(doc) > 0;
  }
  EXPECT_EQ(seen, 0);
  EXPECT_NE(corpus.text(CorpusSplit::kTrain, 10000), corpus.text(CorpusSplit::kValidation, 10000));
}

// Every line of a task document is a correct example of one of the tasks, at the easy difficulty.
TEST(RlSyntheticCorpus, TaskDocumentsHoldCorrectEasyExamples) {
  const SyntheticCorpus corpus;
  std::set<std::string> kinds_seen;
  std::string doc;
  int64_t lines = 0;
  for (uint64_t i = 0; i < 3000; ++i) {
    if (corpus.document(CorpusSplit::kTrain, i, doc) != DocumentKind::kTask) continue;
    const std::vector<std::string> ls = lines_of(doc);
    EXPECT_TRUE(ls.size() >= 4 && ls.size() <= 16) << doc;
    for (const std::string& line : ls) {
      ++lines;
      if (isdigit(line[0])) {  // "a+b=c" or "a*b=c", one digit (mul, arith) or two (add)
        const size_t op = line.find_first_of("+*-", 1), eq = line.find('=');
        ASSERT_TRUE(op != std::string::npos && eq != std::string::npos) << line;
        const int64_t a = std::stoll(line.substr(0, op)), b = std::stoll(line.substr(op + 1, eq - op - 1));
        const int64_t c = std::stoll(line.substr(eq + 1));
        EXPECT_EQ(c, line[op] == '+' ? a + b : line[op] == '-' ? a - b : a * b) << line;
        EXPECT_TRUE(a < 100 && b < 100) << line;
        if (line[op] == '*') {
          EXPECT_TRUE(a < 10 && b < 10) << line;
        }
        kinds_seen.insert(std::string(1, line[op]));
        continue;
      }
      const std::vector<std::string> w = split(line, ' ');
      kinds_seen.insert(w[0]);
      if (w[0] == "reverse" || w[0] == "sort") {
        const auto eq = std::find(w.begin(), w.end(), "=");
        ASSERT_NE(eq, w.end()) << line;
        std::vector<int64_t> in, out;
        for (auto it = w.begin() + 1; it != eq; ++it) in.push_back(std::stoll(*it));
        for (auto it = eq + 1; it != w.end(); ++it) out.push_back(std::stoll(*it));
        EXPECT_TRUE(in.size() >= 2 && in.size() <= 4) << line;
        if (w[0] == "sort") {
          std::sort(in.begin(), in.end());
        } else {
          std::reverse(in.begin(), in.end());
        }
        EXPECT_EQ(in, out) << line;
      } else {
        ASSERT_EQ(w[0], "countdown") << line;
        ASSERT_EQ(w.size(), 8u) << line;  // countdown a b c to t = expr
        const std::vector<int64_t> numbers = {std::stoll(w[1]), std::stoll(w[2]), std::stoll(w[3])};
        EXPECT_TRUE(check_countdown(w[7], numbers, std::stoll(w[5])).exact) << line;
        EXPECT_LE(std::stoll(w[5]), 50) << line;
      }
    }
  }
  EXPECT_GT(lines, 5000);
  EXPECT_EQ(kinds_seen, (std::set<std::string>{"+", "*", "reverse", "sort", "countdown"}));
}

TEST(RlSyntheticCorpus, TablesAddUp) {
  CorpusOptions only;
  std::fill(std::begin(only.weights), std::end(only.weights), 0.0);
  only.weights[(int)DocumentKind::kTable] = 1;
  const SyntheticCorpus corpus(only);
  std::string doc;
  for (uint64_t i = 0; i < 200; ++i) {
    corpus.document(CorpusSplit::kTrain, i, doc);
    const std::vector<std::string> ls = lines_of(doc);
    std::vector<std::vector<int64_t>> rows;
    for (size_t r = 2; r < ls.size(); ++r) {
      std::vector<std::string> cells = split(ls[r], '|');  // "", " name ", " 3 ", ...
      std::vector<int64_t> row;
      for (size_t c = 2; c < cells.size(); ++c) row.push_back(std::stoll(cells[c]));
      rows.push_back(row);
    }
    const size_t n_cols = rows[0].size();
    const bool total_col = n_cols > 1;
    for (const auto& row : rows) {
      if (total_col) {
        int64_t s = 0;
        for (size_t c = 0; c + 1 < n_cols; ++c) s += row[c];
        EXPECT_EQ(s, row.back()) << doc;
      }
    }
    for (size_t c = 0; c < n_cols; ++c) {
      int64_t s = 0;
      for (size_t r = 0; r + 1 < rows.size(); ++r) s += rows[r][c];
      EXPECT_EQ(s, rows.back()[c]) << doc;
    }
  }
}

TEST(RlSyntheticCorpus, OptionErrors) {
  CorpusOptions o;
  o.weights[2] = -1;
  expect_error([&] { SyntheticCorpus c(o); }, "counting");
  o = {};
  std::fill(std::begin(o.weights), std::end(o.weights), 0.0);
  expect_error([&] { SyntheticCorpus c(o); }, "all corpus weights are 0");
  o = {};
  o.min_examples = 5;
  o.max_examples = 4;
  expect_error([&] { SyntheticCorpus c(o); }, "min_examples=5");
  o = {};
  o.task_specs = {"add:digit=2"};
  expect_error([&] { SyntheticCorpus c(o); }, "no option 'digit'");
}

// The corpus is predictable: a bigram model (add-one smoothing) fit on 4 MB of the train split
// has a validation cross-entropy well below the uniform ln(257) = 5.55 nats per token. A
// transformer, which also sees longer contexts, goes much lower; this bounds what it must beat.
TEST(RlSyntheticCorpus, BigramModelPredictsTheValidationSplit) {
  const SyntheticCorpus corpus;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> train(4'000'000), val(400'000);
  CorpusReader(corpus, CorpusSplit::kTrain).fill_tokens(train);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CorpusReader(corpus, CorpusSplit::kValidation).fill_tokens(val);
  std::vector<double> counts((size_t)kByteVocabSize * kByteVocabSize, 1.0), totals(kByteVocabSize, kByteVocabSize);
  for (size_t i = 1; i < train.size(); ++i) {
    counts[(size_t)train[i - 1] * kByteVocabSize + train[i]] += 1;
    totals[train[i - 1]] += 1;
  }
  double nll = 0;
  for (size_t i = 1; i < val.size(); ++i) {
    nll -= std::log(counts[(size_t)val[i - 1] * kByteVocabSize + val[i]] / totals[val[i - 1]]);
  }
  nll /= (double)(val.size() - 1);
  std::printf("bigram validation loss %.3f nats/token (uniform %.3f); corpus generation %.1f M tokens/s\n",
              nll, std::log((double)kByteVocabSize), (double)train.size() / seconds / 1e6);
  EXPECT_LT(nll, 2.5);
}

}  // namespace
}  // namespace fourbit::rl
