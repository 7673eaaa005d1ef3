// DataLoader: per-epoch span order, per-span phase and sequence order, all from counter-based
// Philox draws keyed by (seed, purpose, epoch, span); see data_loader.h.
#include "io/data_loader.h"

#include "core/check.h"
#include "core/rng.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

namespace fourbit::io {

namespace {

// Philox stream ids: purpose in the top byte, the epoch (24 bits) and the span (32 bits) below,
// so no two (purpose, epoch, span) share a stream.
enum class Purpose : uint64_t { kSpanOrder = 1, kSequenceOrder = 2, kPhase = 3 };
constexpr uint64_t kMaxEpochs = uint64_t{1} << 24;

RandomStream stream_for(uint64_t seed, Purpose purpose, uint64_t epoch, int64_t span) {
  return RandomStream{seed, ((uint64_t)purpose << 56) | ((epoch & 0xFFFFFF) << 32) | (uint32_t)span};
}

// 64 random bits at `counter`. A draw modulo n has a bias below n / 2^64: negligible here.
uint64_t draw64(const RandomStream& s, uint64_t counter) {
  const Philox4x32Result r = s.block(counter);
  return (uint64_t)r.v[0] | ((uint64_t)r.v[1] << 32);
}

// Fisher-Yates with draw i for position i.
template <typename T>
void shuffle_with(std::vector<T>& v, const RandomStream& s) {
  for (size_t i = v.size(); i > 1; --i) {
    const size_t j = (size_t)(draw64(s, i - 1) % i);
    std::swap(v[i - 1], v[j]);
  }
}

// FNV-1a, 64 bits.
void fnv1a(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Shards and spans

std::shared_ptr<const ShardSet> ShardSet::open(const std::vector<std::string>& paths,
                                               int64_t vocab_size) {
  if (paths.empty()) throw Error("no token shards given");
  auto set = std::make_shared<ShardSet>();
  for (const std::string& p : paths) set->shards_.push_back(TokenShard::open(p, vocab_size));
  return set;
}

int64_t ShardSet::n_tokens() const {
  int64_t n = 0;
  for (const TokenShard& s : shards_) n += s.size();
  return n;
}

std::vector<ShardSpan> all_spans(const ShardSet& shards) {
  std::vector<ShardSpan> spans;
  for (int i = 0; i < shards.size(); ++i) spans.push_back({i, 0, shards[i].size()});
  return spans;
}

Holdout holdout_last_shards(const ShardSet& shards, int n_val_shards) {
  if (n_val_shards < 0 || n_val_shards >= shards.size()) {
    throw Error(fmt::format("cannot hold out {} of {} shards for validation: keep at least one "
                            "shard for training", n_val_shards, shards.size()));
  }
  Holdout h;
  for (const ShardSpan& s : all_spans(shards)) {
    (s.shard < shards.size() - n_val_shards ? h.train : h.val).push_back(s);
  }
  return h;
}

Holdout holdout_fraction(const ShardSet& shards, double val_fraction) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw Error(fmt::format("validation fraction {} is not in [0, 1)", val_fraction));
  }
  Holdout h;
  for (const ShardSpan& s : all_spans(shards)) {
    const int64_t n_val = (int64_t)std::floor((double)s.size() * val_fraction);
    const int64_t cut = s.end - n_val;
    if (cut > s.begin) h.train.push_back({s.shard, s.begin, cut});
    if (n_val > 0) h.val.push_back({s.shard, cut, s.end});
  }
  return h;
}

// ------------------------------------------------------------------------------------------------
// DataLoader

DataLoader::DataLoader(std::shared_ptr<const ShardSet> shards, std::vector<ShardSpan> spans,
                       LoaderOptions options)
    : shards_(std::move(shards)), spans_(std::move(spans)), options_(options) {
  FOURBIT_CHECK(shards_ != nullptr, "DataLoader: no shard set");
  if (options_.batch_size < 1 || options_.seq_len < 1) {
    throw Error(fmt::format("data loader: batch size {} and sequence length {} must be >= 1",
                            options_.batch_size, options_.seq_len));
  }
  if (spans_.size() > (size_t)UINT32_MAX) throw Error("data loader: more than 2^32 spans");
  const int64_t T = options_.seq_len;
  bool usable = false;
  uint64_t h = 0xcbf29ce484222325ull;
  for (const ShardSpan& s : spans_) {
    if (s.shard < 0 || s.shard >= shards_->size() || s.begin < 0 || s.begin > s.end ||
        s.end > (*shards_)[s.shard].size()) {
      throw Error(fmt::format("data loader: span [{}, {}) of shard {} is outside the data ({} shards)",
                              s.begin, s.end, s.shard, shards_->size()));
    }
    usable = usable || s.size() >= T + 1;
    const TokenShard& shard = (*shards_)[s.shard];
    const std::string name = std::filesystem::path(shard.path()).filename().string();
    const int64_t fields[4] = {shard.size(), (int64_t)shard.width(), s.begin, s.end};
    fnv1a(h, name.data(), name.size() + 1);
    fnv1a(h, fields, sizeof(fields));
  }
  fingerprint_ = fmt::format("fnv1a64:{:016x}:{}spans", h, spans_.size());
  if (!usable) {
    throw Error(fmt::format("data loader: no span holds seq_len + 1 = {} tokens ({} tokens in {} "
                            "spans): use a shorter sequence length or more data",
                            T + 1, n_tokens(), spans_.size()));
  }
  buffer_.resize((size_t)(T + 1));
}

int64_t DataLoader::n_tokens() const {
  int64_t n = 0;
  for (const ShardSpan& s : spans_) n += s.size();
  return n;
}

DataLoader::SpanPlan DataLoader::plan(uint64_t epoch, int64_t span) const {
  const int64_t T = options_.seq_len;
  const int64_t L = spans_[(size_t)span].size();
  SpanPlan p;
  if (L < T + 1) return p;
  if (options_.shuffle && options_.random_phase) {
    // Phases up to T - 1, but never so large that the span loses its last sequence.
    const int64_t max_phase = std::min(T - 1, L - (T + 1));
    const RandomStream s = stream_for(options_.seed, Purpose::kPhase, epoch, span);
    p.phase = (int64_t)(draw64(s, 0) % (uint64_t)(max_phase + 1));
  }
  p.n_sequences = (L - p.phase - 1) / T;
  return p;
}

int64_t DataLoader::sequences_in_epoch(uint64_t epoch) const {
  int64_t n = 0;
  for (size_t i = 0; i < spans_.size(); ++i) n += plan(epoch, (int64_t)i).n_sequences;
  return n;
}

void DataLoader::load_epoch(uint64_t epoch) {
  if (epoch >= kMaxEpochs) {
    throw Error(fmt::format("data loader: epoch {} exceeds the {} epochs the shuffling streams "
                            "distinguish", epoch, kMaxEpochs));
  }
  order_.resize(spans_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = (int64_t)i;
  if (options_.shuffle) shuffle_with(order_, stream_for(options_.seed, Purpose::kSpanOrder, epoch, 0));
  order_epoch_ = epoch;
  perm_span_pos_ = -1;
}

void DataLoader::load_span() {
  const int64_t span = order_[(size_t)span_pos_];
  span_plan_ = plan(epoch_, span);
  perm_.clear();
  if (options_.shuffle) {
    perm_.resize((size_t)span_plan_.n_sequences);
    for (size_t i = 0; i < perm_.size(); ++i) perm_[i] = (uint32_t)i;
    shuffle_with(perm_, stream_for(options_.seed, Purpose::kSequenceOrder, epoch_, span));
  }
  perm_span_pos_ = span_pos_;
}

int64_t DataLoader::next_sequence_start(int* shard) {
  // Terminates: the constructor checked that some span has a sequence in every epoch.
  for (;;) {
    if (order_epoch_ != epoch_) load_epoch(epoch_);
    if (span_pos_ >= (int64_t)spans_.size()) {
      ++epoch_;
      span_pos_ = 0;
      offset_ = 0;
      continue;
    }
    if (perm_span_pos_ != span_pos_) load_span();
    if (offset_ < span_plan_.n_sequences) {
      const int64_t k = options_.shuffle ? (int64_t)perm_[(size_t)offset_] : offset_;
      ++offset_;
      const ShardSpan& s = spans_[(size_t)order_[(size_t)span_pos_]];
      *shard = s.shard;
      return s.begin + span_plan_.phase + k * options_.seq_len;
    }
    ++span_pos_;
    offset_ = 0;
  }
}

void DataLoader::next_batch(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const int64_t B = options_.batch_size, T = options_.seq_len;
  FOURBIT_CHECK((int64_t)inputs.size() == B * T && (int64_t)targets.size() == B * T,
                "data loader: batch buffers hold {} and {} tokens; (B, T) = ({}, {}) needs {}",
                inputs.size(), targets.size(), B, T, B * T);
  for (int64_t b = 0; b < B; ++b) {
    int shard = 0;
    const int64_t start = next_sequence_start(&shard);
    (*shards_)[shard].read(start, T + 1, buffer_.data());
    std::copy(buffer_.begin(), buffer_.end() - 1, inputs.begin() + b * T);
    std::copy(buffer_.begin() + 1, buffer_.end(), targets.begin() + b * T);
    ++served_;
  }
}

DataLoader::Batch DataLoader::next_batch() {
  const Shape shape{options_.batch_size, options_.seq_len};
  Batch batch{Tensor::empty(shape, DType::kI32, Device::kCpu),
              Tensor::empty(shape, DType::kI32, Device::kCpu)};
  const size_t n = (size_t)(options_.batch_size * options_.seq_len);
  next_batch(std::span<int32_t>(batch.inputs.ptr<int32_t>(), n),
             std::span<int32_t>(batch.targets.ptr<int32_t>(), n));
  return batch;
}

nlohmann::json DataLoader::state() const {
  // Where the next sequence starts (informational; restore() uses epoch, span and offset).
  DataLoader probe = *this;
  int shard = 0;
  const int64_t token = probe.next_sequence_start(&shard);
  return {{"format", "fourbit-data-position"},
          {"version", 1},
          {"epoch", epoch_},
          {"span", span_pos_},
          {"offset", offset_},
          {"shard", shard},
          {"token", token},
          {"rng", {{"generator", "philox4x32-10"}, {"seed", options_.seed}}},
          {"shuffle", options_.shuffle},
          {"random_phase", options_.random_phase},
          {"seq_len", options_.seq_len},
          {"data", fingerprint_},
          {"sequences", served_}};
}

void DataLoader::restore(const nlohmann::json& state) {
  auto fail = [](const std::string& what) {
    throw Error(fmt::format("cannot resume the data loader: {}", what));
  };
  try {
    if (state.value("format", std::string()) != "fourbit-data-position" ||
        state.value("version", 0) != 1) {
      fail("the state is not a fourbit data position (version 1)");
    }
    const std::string data = state.at("data").get<std::string>();
    if (data != fingerprint_) {
      fail(fmt::format("it was saved for other data ({}; these shards and split give {}): resume "
                       "with the same shard files and the same validation split", data, fingerprint_));
    }
    const uint64_t seed = state.at("rng").at("seed").get<uint64_t>();
    const bool shuffle = state.at("shuffle").get<bool>();
    const bool random_phase = state.at("random_phase").get<bool>();
    const int64_t seq_len = state.at("seq_len").get<int64_t>();
    if (seed != options_.seed || shuffle != options_.shuffle ||
        random_phase != options_.random_phase || seq_len != options_.seq_len) {
      fail(fmt::format("it was saved with seed {}, shuffle {}, random_phase {}, seq_len {}; this "
                       "loader has seed {}, shuffle {}, random_phase {}, seq_len {}", seed, shuffle,
                       random_phase, seq_len, options_.seed, options_.shuffle,
                       options_.random_phase, options_.seq_len));
    }
    const uint64_t epoch = state.at("epoch").get<uint64_t>();
    const int64_t span = state.at("span").get<int64_t>();
    const int64_t offset = state.at("offset").get<int64_t>();
    if (epoch >= kMaxEpochs || span < 0 || span > (int64_t)spans_.size() || offset < 0) {
      fail(fmt::format("position epoch {}, span {}, offset {} is out of range", epoch, span, offset));
    }
    // Validated on a copy, so that a refused state leaves this loader where it was.
    DataLoader next = *this;
    next.epoch_ = epoch;
    next.span_pos_ = span;
    next.offset_ = offset;
    next.served_ = state.value("sequences", int64_t{0});
    next.order_epoch_ = ~uint64_t{0};
    next.perm_span_pos_ = -1;
    if (span < (int64_t)spans_.size()) {
      next.load_epoch(epoch);
      next.load_span();
      if (offset > next.span_plan_.n_sequences) {
        fail(fmt::format("offset {} is past the {} sequences of span {} in epoch {}", offset,
                         next.span_plan_.n_sequences, span, epoch));
      }
    }
    *this = std::move(next);
  } catch (const nlohmann::json::exception& e) {
    fail(fmt::format("the state is malformed: {}", e.what()));
  }
}

void DataLoader::reset() {
  epoch_ = 0;
  span_pos_ = 0;
  offset_ = 0;
  served_ = 0;
}

}  // namespace fourbit::io
