// The tokenizer interface's shared parts and the byte-level tokenizer.
#include "io/tokenizer.h"

#include "core/check.h"

#include <fstream>

namespace fourbit::io {

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 &&
         (id == special_.bos || id == special_.eos || id == special_.pad || id == special_.unk);
}

nlohmann::json Tokenizer::describe() const {
  return {{"kind", kind()},
          {"vocab_size", vocab_size()},
          {"bos", special_.bos},
          {"eos", special_.eos},
          {"pad", special_.pad},
          {"unk", special_.unk},
          {"end_of_answer", special_.end_of_answer}};
}

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer() {
    special_.eos = kByteEndOfText;
    special_.bos = kByteBos;
    special_.pad = kBytePad;
    special_.end_of_answer = '\n';
  }
  std::string kind() const override { return "byte-level"; }
  int64_t vocab_size() const override { return kByteTokenizerVocab; }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = (unsigned char)text[i];
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      if (id < 0 || id >= kByteTokenizerVocab) {
        throw Error(fmt::format("byte-level tokenizer: token {} at position {} is outside the "
                                "vocabulary [0, {})", id, i, kByteTokenizerVocab));
      }
      if (id < 256) text += (char)(unsigned char)id;
    }
    return text;
  }

  std::string piece(int32_t id) const override {
    static constexpr const char* kNames[] = {"<|endoftext|>", "<|bos|>", "<|pad|>"};
    if (id >= 256 && id < kByteTokenizerVocab) return kNames[id - 256];
    if (id < 0 || id >= kByteTokenizerVocab) {
      throw Error(fmt::format("byte-level tokenizer: no token {}", id));
    }
    if (id > 0x20 && id < 0x7F) return std::string(1, (char)id);
    return fmt::format("<0x{:02X}>", id);
  }
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> train_sentencepiece(const std::vector<std::string>& text_files,
                                               const SentencePieceTrainOptions& options) {
  if (text_files.empty()) throw Error("SentencePiece training: no text files given");
  size_t file = 0;
  std::ifstream in;
  auto next_line = [&](std::string& line) -> bool {
    for (;;) {
      if (in.is_open() && std::getline(in, line)) return true;
      if (file == text_files.size()) return false;
      in = std::ifstream(text_files[file]);
      if (!in) throw Error(fmt::format("cannot open '{}'", text_files[file]));
      ++file;
    }
  };
  return train_sentencepiece(next_line, options);
}

}  // namespace fourbit::io
