// The built-in pretraining corpus: seeded, deterministic synthetic documents, generated in
// process, so the default job needs no download and runs on a machine without a GPU.
//
// A document is plain ASCII text whose lines each end with '\n'. Its kind is drawn by the mixture
// weights of CorpusOptions (by document count):
//   task      4..16 solved examples of one task at its EASY difficulty (TaskInfo::easy_spec, e.g.
//             "add:digits=2"), one per line in the exact RL format of rl/task.h ("12+34=46\n"),
//             so a model pretrained here knows the format and can be RL-trained on harder specs;
//   story     short sentences about people and things whose numbers add up ("Alice has 7 apples.
//             Bob gives Alice 3 apples. Now Alice has 10 apples and Bob has 2 apples.") or facts
//             ("Alice lives in Oslo.");
//   counting  lines like "count from 7 to 12: 7 8 9 10 11 12", "count by 5 from 10: ...",
//             "letters from d to h: d e f g h", "days from Friday: Friday Saturday ...";
//   records   key: value records with consecutive ids, separated by a blank line;
//   table     a markdown table of counts with a total column and a total row;
//   program   tiny assignments ("x = 3", "y = x + 4") ending with "print(y)" and its output.
//
// Determinism. Document number i of a split is a pure function of (options, split, i): its draws
// come from the Philox stream (seed, stream id = 2^63 | split << 56 | i), disjoint from the
// streams Task::make_example uses. The validation split uses its own streams, so its documents
// are new draws from the same distribution (the easy task instances themselves, such as "3+4=",
// recur in both: their problem space is small).
//
// Tokens. The token stream of a split is document 0's bytes, kEndOfDocumentToken, document 1's
// bytes, kEndOfDocumentToken, ... (rl/byte_tokens.h: ids 0..255 are bytes, 256 ends a document).
// The text form puts kEndOfDocumentText where the token stream has kEndOfDocumentToken.
//
// Speed: ~tens of MB/s per core (`fourbit corpus --stats` measures it); the generator allocates
// nothing per document once its buffers have grown.
#pragma once

#include "rl/task.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::rl {

enum class CorpusSplit : uint8_t { kTrain = 0, kValidation = 1 };

enum class DocumentKind : uint8_t { kTask, kStory, kCounting, kRecords, kTable, kProgram };
inline constexpr int kDocumentKindCount = 6;
std::string_view document_kind_name(DocumentKind kind);

struct CorpusOptions {
  uint64_t seed = 0;
  // Mixture weights by document count, indexed by DocumentKind (normalized; >= 0, not all zero).
  double weights[kDocumentKindCount] = {0.55, 0.1, 0.1, 0.1, 0.1, 0.05};
  // Task specs of task documents, drawn uniformly per document; empty = the easy spec of every
  // registered task.
  std::vector<std::string> task_specs;
  int min_examples = 4;   // solved examples per task document
  int max_examples = 16;
};

class SyntheticCorpus {
 public:
  // Validates the options (weights, example counts) and builds the tasks; throws an Error naming
  // the bad field or task spec.
  explicit SyntheticCorpus(CorpusOptions options = {});

  const CorpusOptions& options() const { return options_; }
  const std::vector<std::unique_ptr<Task>>& tasks() const { return tasks_; }

  // Writes document `index` of `split` to `out` (overwritten; its capacity is reused) and returns
  // its kind.
  DocumentKind document(CorpusSplit split, uint64_t index, std::string& out) const;
  // The kind of document `index` without generating it.
  DocumentKind document_kind(CorpusSplit split, uint64_t index) const;

  // The text form of documents first_document, first_document + 1, ...: each document followed by
  // kEndOfDocumentText, whole documents until the text holds at least min_bytes.
  std::string text(CorpusSplit split, uint64_t min_bytes, uint64_t first_document = 0) const;

 private:
  CorpusOptions options_;
  std::vector<std::unique_ptr<Task>> tasks_;
  double cumulative_[kDocumentKindCount];  // normalized cumulative weights, last = 1
};

// Where a CorpusReader is in its split's token stream: `offset` tokens of document `document`
// (counting its kEndOfDocumentToken as its last token) have been read. Store it in a checkpoint to
// resume the stream exactly.
struct CorpusPosition {
  uint64_t document = 0;
  uint64_t offset = 0;
};

// Sequential reader of one split's token stream, resumable from a CorpusPosition.
class CorpusReader {
 public:
  CorpusReader(const SyntheticCorpus& corpus, CorpusSplit split, CorpusPosition start = {});

  // Fills `tokens` with the next tokens of the stream (ids in [0, kByteVocabSize)). The uint16
  // form is the token shard format.
  void fill_tokens(std::span<int32_t> tokens);
  void fill_tokens(std::span<uint16_t> tokens);

  CorpusPosition position() const { return {document_, offset_}; }

 private:
  template <typename T>
  void fill(std::span<T> tokens);
  void load(uint64_t document);

  const SyntheticCorpus* corpus_;
  CorpusSplit split_;
  uint64_t document_ = 0;
  uint64_t offset_ = 0;
  uint64_t loaded_ = UINT64_MAX;  // the document held in text_
  std::string text_;
};

}  // namespace fourbit::rl
