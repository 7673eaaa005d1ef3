// Batches of (inputs, targets) over token shards, shuffled, reproducible and resumable.
//
// The data is a list of spans: token ranges [begin, end) of memory-mapped shards (a whole shard, or
// the train or validation part of one: see holdout_*). A span of L tokens yields the sequences of
// T + 1 tokens starting at phase + k*T (k = 0, 1, ...), so consecutive sequences share one token,
// as in llm.c: inputs are tokens [s, s + T), targets [s + 1, s + T + 1). An epoch visits every span
// once and every sequence of a span once.
//
// With shuffle on, each epoch draws (all from Philox keyed by the seed, the epoch and the span, so
// any epoch's order can be recomputed without replaying earlier ones):
//   - the order of the spans (shuffling across shards),
//   - per span, the order of its sequences,
//   - per span, when random_phase is on, the phase in [0, T) of the sequence starts, so sequence
//     boundaries move between epochs (a span shorter than 2T + 1 tokens gets a smaller range).
// Batches are B consecutive sequences of that stream; they cross span and epoch boundaries.
//
// Position: (epoch, index of the span in the epoch's order, sequences taken from it). state()
// serializes it with the seed and a fingerprint of the data to JSON; restore() on a loader built
// the same way continues bit for bit with the batch that would have come next (the batch size may
// differ). The RNG has no other state: it is counter-based.
#pragma once

#include "core/tensor.h"
#include "io/token_shards.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace fourbit::io {

// Every shard of one dataset, memory-mapped and validated.
class ShardSet {
 public:
  // vocab_size > 0: every token of every shard is checked against it when opening.
  static std::shared_ptr<const ShardSet> open(const std::vector<std::string>& paths,
                                              int64_t vocab_size = 0);
  int size() const { return (int)shards_.size(); }
  const TokenShard& operator[](int i) const { return shards_[(size_t)i]; }
  int64_t n_tokens() const;

 private:
  std::vector<TokenShard> shards_;
};

// Tokens [begin, end) of shard `shard`.
struct ShardSpan {
  int shard = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Every shard, whole.
std::vector<ShardSpan> all_spans(const ShardSet& shards);

struct Holdout {
  std::vector<ShardSpan> train;
  std::vector<ShardSpan> val;
};
// The last `n_val_shards` shards (by position in the set) for validation, the others for training.
Holdout holdout_last_shards(const ShardSet& shards, int n_val_shards);
// The last `val_fraction` of every shard's tokens (rounded down) for validation.
Holdout holdout_fraction(const ShardSet& shards, double val_fraction);

struct LoaderOptions {
  int64_t batch_size = 8;  // B
  int64_t seq_len = 256;   // T
  bool shuffle = true;     // span order and sequence order per epoch
  bool random_phase = true;  // with shuffle: random sequence phase per epoch and span
  uint64_t seed = 1337;
};

class DataLoader {
 public:
  // Needs at least one span of T + 1 tokens or more.
  DataLoader(std::shared_ptr<const ShardSet> shards, std::vector<ShardSpan> spans,
             LoaderOptions options);

  // Fills inputs and targets, each (B, T) row-major int32.
  void next_batch(std::span<int32_t> inputs, std::span<int32_t> targets);
  struct Batch {
    Tensor inputs;   // (B, T) i32 on the CPU
    Tensor targets;  // (B, T) i32 on the CPU
  };
  Batch next_batch();

  // The position of the next batch, as JSON: {"epoch", "span", "offset" (sequences already taken
  // from that span), "shard" and "token" (where the next sequence starts; informational), "rng"
  // {"generator": "philox4x32-10", "seed"}, "shuffle", "random_phase", "seq_len", "data"
  // (fingerprint of the spans: shard file names, sizes and ranges), "sequences" (served so far)}.
  nlohmann::json state() const;
  // Continues from a state() of a loader over the same data with the same seed, shuffle and
  // seq_len; anything else is refused with an error that names the difference.
  void restore(const nlohmann::json& state);
  // Back to the first sequence of epoch 0.
  void reset();

  uint64_t epoch() const { return epoch_; }
  int64_t sequences_served() const { return served_; }
  // Sequences in one epoch (varies by epoch only with random_phase).
  int64_t sequences_in_epoch(uint64_t epoch) const;
  int64_t n_tokens() const;  // tokens in the spans
  const LoaderOptions& options() const { return options_; }
  const std::string& fingerprint() const { return fingerprint_; }

 private:
  struct SpanPlan {
    int64_t phase = 0;
    int64_t n_sequences = 0;
  };
  SpanPlan plan(uint64_t epoch, int64_t span) const;
  void load_epoch(uint64_t epoch);    // span order of `epoch`
  void load_span();                   // plan and sequence order of the current span
  int64_t next_sequence_start(int* shard);

  std::shared_ptr<const ShardSet> shards_;
  std::vector<ShardSpan> spans_;
  LoaderOptions options_;
  std::string fingerprint_;

  // Position.
  uint64_t epoch_ = 0;
  int64_t span_pos_ = 0;  // index into order_
  int64_t offset_ = 0;    // sequences taken from the current span
  int64_t served_ = 0;

  // Caches derived from the position (pure functions of seed, epoch and span).
  uint64_t order_epoch_ = ~uint64_t{0};
  std::vector<int64_t> order_;  // span indices in this epoch's order
  int64_t perm_span_pos_ = -1;
  SpanPlan span_plan_;
  std::vector<uint32_t> perm_;  // sequence order of the current span
  std::vector<int32_t> buffer_;
};

}  // namespace fourbit::io
