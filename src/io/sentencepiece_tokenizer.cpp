// The SentencePiece tokenizer: loading, training and the Tokenizer interface over
// sentencepiece::SentencePieceProcessor. Compiled to stubs that explain how to get SentencePiece
// when the build did not find it (FOURBIT_WITH_SENTENCEPIECE undefined).
#include "io/tokenizer.h"

#include "core/check.h"

#if defined(FOURBIT_WITH_SENTENCEPIECE)
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

#include <fstream>
#include <sstream>
#include <thread>

namespace fourbit::io {

#if defined(FOURBIT_WITH_SENTENCEPIECE)

namespace {

// SentencePiece skips longer training lines (its max_sentence_length is 4192 bytes).
constexpr size_t kMaxTrainLineBytes = 4096;

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& model_bytes, const std::string& name)
      : model_bytes_(model_bytes) {
    const sentencepiece::util::Status st = sp_.LoadFromSerializedProto(model_bytes_);
    if (!st.ok()) {
      throw Error(fmt::format("{}: not a SentencePiece model: {}", name, st.ToString()));
    }
    const auto id_or_none = [&](int id) { return id >= 0 && id < sp_.GetPieceSize() ? id : -1; };
    special_.unk = id_or_none(sp_.unk_id());
    special_.bos = id_or_none(sp_.bos_id());
    special_.eos = id_or_none(sp_.eos_id());
    special_.pad = id_or_none(sp_.pad_id());
    std::vector<int> newline;
    special_.end_of_answer = sp_.Encode("\n", &newline).ok() && newline.size() == 1
                                 ? newline[0] : special_.eos;
  }

  std::string kind() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const sentencepiece::util::Status st = sp_.Encode(text, &ids);
    if (!st.ok()) throw Error(fmt::format("SentencePiece encode failed: {}", st.ToString()));
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<int> v;
    v.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= sp_.GetPieceSize()) {
        throw Error(fmt::format("SentencePiece tokenizer: token {} at position {} is outside the "
                                "vocabulary [0, {})", ids[i], i, sp_.GetPieceSize()));
      }
      if (!is_special(ids[i])) v.push_back(ids[i]);
    }
    std::string text;
    const sentencepiece::util::Status st = sp_.Decode(v, &text);
    if (!st.ok()) throw Error(fmt::format("SentencePiece decode failed: {}", st.ToString()));
    return text;
  }

  std::string piece(int32_t id) const override {
    if (id < 0 || id >= sp_.GetPieceSize()) {
      throw Error(fmt::format("SentencePiece tokenizer: no token {}", id));
    }
    return sp_.IdToPiece(id);
  }

  std::string model_bytes() const override { return model_bytes_; }

 private:
  std::string model_bytes_;
  sentencepiece::SentencePieceProcessor sp_;
};

// Feeds SentencePiece's trainer, cutting long lines into pieces it does not skip.
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::function<bool(std::string&)>& next_line) : next_line_(next_line) {
    Next();
  }
  bool done() const override { return done_; }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }
  int64_t lines() const { return lines_; }

  void Next() override {
    for (;;) {
      if (rest_.empty()) {
        if (!next_line_(rest_)) {
          done_ = true;
          return;
        }
        if (!rest_.empty() && rest_.back() == '\r') rest_.pop_back();
        if (rest_.empty()) continue;
      }
      size_t cut = rest_.size();
      if (cut > kMaxTrainLineBytes) {
        cut = rest_.rfind(' ', kMaxTrainLineBytes);
        if (cut == std::string::npos || cut < kMaxTrainLineBytes / 2) {
          cut = kMaxTrainLineBytes;  // back off to a UTF-8 character boundary
          while (cut > 0 && ((unsigned char)rest_[cut] & 0xC0) == 0x80) --cut;
        }
      }
      value_ = rest_.substr(0, cut);
      rest_.erase(0, cut);
      ++lines_;
      return;
    }
  }

 private:
  const std::function<bool(std::string&)>& next_line_;
  std::string rest_;
  std::string value_;
  bool done_ = false;
  int64_t lines_ = 0;
};

}  // namespace

bool sentencepiece_available() { return true; }

std::unique_ptr<Tokenizer> load_sentencepiece_bytes(const std::string& model_bytes,
                                                    const std::string& name) {
  return std::make_unique<SentencePieceTokenizer>(model_bytes, name);
}

std::unique_ptr<Tokenizer> train_sentencepiece(const std::function<bool(std::string& line)>& next_line,
                                               const SentencePieceTrainOptions& o) {
  if (o.model_type != "bpe" && o.model_type != "unigram") {
    throw Error(fmt::format("SentencePiece model type '{}': choose bpe or unigram", o.model_type));
  }
  if (o.vocab_size < 300) {
    throw Error(fmt::format("SentencePiece vocabulary {} is too small: byte fallback alone takes "
                            "259 ids; use --vocab 300 or more (or --byte-level)", o.vocab_size));
  }
  const int threads = o.num_threads > 0 ? o.num_threads
                                        : std::max(1, (int)std::thread::hardware_concurrency());
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", o.model_type},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"hard_vocab_limit", "false"},  // small corpora: fewer pieces rather than an error
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      {"character_coverage", fmt::format("{}", o.character_coverage)},
      {"input_sentence_size", std::to_string(o.max_lines)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(threads)},
      {"minloglevel", "2"},
  };
  sentencepiece::SetRandomGeneratorSeed((unsigned)(o.seed ^ (o.seed >> 32)));
  LineIterator lines(next_line);
  if (lines.done()) throw Error("SentencePiece training: the text is empty");
  std::string model;
  const sentencepiece::util::Status st =
      sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  if (!st.ok()) {
    throw Error(fmt::format("SentencePiece training failed ({} model, vocabulary {}): {}",
                            o.model_type, o.vocab_size, st.ToString()));
  }
  return load_sentencepiece_bytes(model, "<trained model>");
}

#else  // no SentencePiece

namespace {
[[noreturn]] void no_sentencepiece() {
  throw Error("this fourbit was built without SentencePiece: install it (Debian/Ubuntu: apt-get "
              "install libsentencepiece-dev; tools/deps.sh does this) and rebuild, or use the "
              "byte-level tokenizer (--byte-level)");
}
}  // namespace

bool sentencepiece_available() { return false; }
std::unique_ptr<Tokenizer> load_sentencepiece_bytes(const std::string&, const std::string&) {
  no_sentencepiece();
}
std::unique_ptr<Tokenizer> train_sentencepiece(const std::function<bool(std::string&)>&,
                                               const SentencePieceTrainOptions&) {
  no_sentencepiece();
}

#endif

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  if (!sentencepiece_available()) return load_sentencepiece_bytes({}, model_path);
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot open the tokenizer model '{}'", model_path));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return load_sentencepiece_bytes(bytes.str(), model_path);
}

}  // namespace fourbit::io
