// Training data for the trainer: batches of (inputs, targets) from llm.c token shards (through
// io::DataLoader) or from the built-in synthetic corpus (rl::CorpusReader), behind one interface,
// each resumable from a JSON state (stored in checkpoints).
//
// Shapes: every batch is host i32 inputs [B, T] and targets [B, T]; targets[b, t] is the token
// after inputs[b, t] (no position is ignored).
//   shards: io::DataLoader sequences (T + 1 tokens sharing one token with the next, llm.c style),
//           shuffled per epoch for training, in file order without shuffling for validation;
//   corpus: each row takes the next T + 1 tokens of the split's token stream (rows do not
//           overlap); training reads the train split from where it left off, validation restarts
//           the validation split (its own, disjoint draws) at its beginning at every reset().
// Validation sources are reset() before every evaluation, so every evaluation sees the same tokens.
#pragma once

#include "core/tensor.h"
#include "rl/synthetic_corpus.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace fourbit::train {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // inputs, targets: host i32 [B, T], contiguous.
  virtual void next(const TensorView& inputs, const TensorView& targets) = 0;
  virtual nlohmann::json state() const = 0;
  // Continues from a state() of a source built the same way (errors name what differs).
  virtual void restore(const nlohmann::json& state) = 0;
  virtual void reset() = 0;  // back to the first batch
  virtual std::string describe() const = 0;
  virtual int64_t batch_size() const = 0;
  virtual int64_t seq_len() const = 0;
};

struct DataSources {
  std::unique_ptr<BatchSource> train, val;
  int64_t min_vocab = 0;  // the model's vocabulary must hold at least this many ids
};

struct DataOptions {
  std::string data;           // shard glob / directory / file; empty: the built-in corpus
  std::string val_data;       // validation shards; empty: hold out val_fraction of every shard
  double val_fraction = 0.05;
  uint64_t seed = 1337;       // shuffling (shards) or corpus generation
  int64_t batch_size = 8;     // B
  int64_t seq_len = 256;      // T
  int64_t vocab = 0;          // > 0: every shard token is checked against it when opening
};

DataSources make_data_sources(const DataOptions& options);

}  // namespace fourbit::train
