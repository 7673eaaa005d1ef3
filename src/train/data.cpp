// Batch sources over token shards and the built-in corpus (data.h).
#include "train/data.h"

#include "core/check.h"
#include "io/data_loader.h"
#include "io/token_shards.h"
#include "rl/byte_tokens.h"

#include <vector>

namespace fourbit::train {
namespace {

void check_batch(const TensorView& v, int64_t B, int64_t T, const char* what) {
  FOURBIT_CHECK(v.device == Device::kCpu && v.dtype == DType::kI32 && v.is_contiguous() &&
                    v.numel() == B * T,
                "batch source: {} must be a contiguous host i32 tensor of {} x {}, got {}", what,
                B, T, v.describe());
}

class ShardSource final : public BatchSource {
 public:
  ShardSource(std::shared_ptr<const io::ShardSet> shards, std::vector<io::ShardSpan> spans,
              io::LoaderOptions options, std::string name)
      : loader_(std::move(shards), std::move(spans), options), name_(std::move(name)) {}
  void next(const TensorView& inputs, const TensorView& targets) override {
    const int64_t B = batch_size(), T = seq_len();
    check_batch(inputs, B, T, "inputs");
    check_batch(targets, B, T, "targets");
    loader_.next_batch({inputs.ptr<int32_t>(), (size_t)(B * T)},
                       {targets.ptr<int32_t>(), (size_t)(B * T)});
  }
  nlohmann::json state() const override { return loader_.state(); }
  void restore(const nlohmann::json& s) override { loader_.restore(s); }
  void reset() override { loader_.reset(); }
  std::string describe() const override {
    return fmt::format("{}: {} tokens of token shards", name_, loader_.n_tokens());
  }
  int64_t batch_size() const override { return loader_.options().batch_size; }
  int64_t seq_len() const override { return loader_.options().seq_len; }

 private:
  io::DataLoader loader_;
  std::string name_;
};

class CorpusSource final : public BatchSource {
 public:
  CorpusSource(std::shared_ptr<const rl::SyntheticCorpus> corpus, rl::CorpusSplit split, int64_t B,
               int64_t T)
      : corpus_(std::move(corpus)), split_(split), B_(B), T_(T), reader_(*corpus_, split),
        row_((size_t)(T + 1)) {}
  void next(const TensorView& inputs, const TensorView& targets) override {
    check_batch(inputs, B_, T_, "inputs");
    check_batch(targets, B_, T_, "targets");
    for (int64_t b = 0; b < B_; ++b) {
      reader_.fill_tokens(std::span<int32_t>(row_));
      for (int64_t t = 0; t < T_; ++t) {
        inputs.ptr<int32_t>()[b * T_ + t] = row_[(size_t)t];
        targets.ptr<int32_t>()[b * T_ + t] = row_[(size_t)t + 1];
      }
    }
  }
  nlohmann::json state() const override {
    const rl::CorpusPosition p = reader_.position();
    return {{"source", "synthetic-corpus"},
            {"split", split_ == rl::CorpusSplit::kTrain ? "train" : "validation"},
            {"seed", corpus_->options().seed},
            {"seq_len", T_},
            {"document", p.document},
            {"offset", p.offset}};
  }
  void restore(const nlohmann::json& s) override {
    FOURBIT_CHECK(s.is_object() && s.value("source", "") == "synthetic-corpus",
                  "data state: the checkpoint's data position is not of the built-in corpus ({}); "
                  "resume with the same --data as the run that saved it",
                  s.dump());
    FOURBIT_CHECK(s.at("seed").get<uint64_t>() == corpus_->options().seed,
                  "data state: the checkpoint's corpus seed is {} but this run's is {}",
                  s.at("seed").get<uint64_t>(), corpus_->options().seed);
    FOURBIT_CHECK(s.at("seq_len").get<int64_t>() == T_,
                  "data state: the checkpoint's seq_len is {} but this run's is {}",
                  s.at("seq_len").get<int64_t>(), T_);
    reader_ = rl::CorpusReader(*corpus_, split_,
                               {s.at("document").get<uint64_t>(), s.at("offset").get<uint64_t>()});
  }
  void reset() override { reader_ = rl::CorpusReader(*corpus_, split_); }
  std::string describe() const override {
    return fmt::format("built-in synthetic corpus ({} split, seed {})",
                       split_ == rl::CorpusSplit::kTrain ? "train" : "validation",
                       corpus_->options().seed);
  }
  int64_t batch_size() const override { return B_; }
  int64_t seq_len() const override { return T_; }

 private:
  std::shared_ptr<const rl::SyntheticCorpus> corpus_;
  rl::CorpusSplit split_;
  int64_t B_, T_;
  rl::CorpusReader reader_;
  std::vector<int32_t> row_;
};

}  // namespace

DataSources make_data_sources(const DataOptions& o) {
  FOURBIT_CHECK(o.batch_size >= 1 && o.seq_len >= 1,
                "data: batch size and sequence length must be >= 1, got {} and {}", o.batch_size,
                o.seq_len);
  DataSources d;
  if (o.data.empty()) {
    rl::CorpusOptions co;
    co.seed = o.seed;
    auto corpus = std::make_shared<const rl::SyntheticCorpus>(co);
    d.train = std::make_unique<CorpusSource>(corpus, rl::CorpusSplit::kTrain, o.batch_size, o.seq_len);
    d.val = std::make_unique<CorpusSource>(corpus, rl::CorpusSplit::kValidation, o.batch_size, o.seq_len);
    d.min_vocab = rl::kByteVocabSize;
    return d;
  }
  io::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.seq_len = o.seq_len;
  lo.seed = o.seed;
  io::LoaderOptions vo = lo;
  vo.shuffle = false;
  vo.random_phase = false;
  auto shards = io::ShardSet::open(io::find_shards(o.data), o.vocab);
  if (!o.val_data.empty()) {
    auto val = io::ShardSet::open(io::find_shards(o.val_data), o.vocab);
    d.train = std::make_unique<ShardSource>(shards, io::all_spans(*shards), lo, "train");
    d.val = std::make_unique<ShardSource>(val, io::all_spans(*val), vo, "validation");
    return d;
  }
  FOURBIT_CHECK(o.val_fraction > 0 && o.val_fraction < 1,
                "data: --val-fraction must lie in (0, 1) when no --val-data is given, got {}",
                o.val_fraction);
  io::Holdout h = io::holdout_fraction(*shards, o.val_fraction);
  d.train = std::make_unique<ShardSource>(shards, std::move(h.train), lo, "train");
  d.val = std::make_unique<ShardSource>(shards, std::move(h.val), vo, "validation");
  return d;
}

}  // namespace fourbit::train
