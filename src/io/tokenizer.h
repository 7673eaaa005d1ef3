// Tokenizers: text <-> token ids, with the special tokens the trainer and the RL tasks need.
//
// Two implementations behind one interface:
//   - byte-level: ids 0..255 are the bytes of the UTF-8 text, then <|endoftext|> 256 (eos, the
//     end of a document), <|bos|> 257, <|pad|> 258; vocabulary 259. No dependency, always
//     available, exact round trip of any byte string. Ids 0..256 are the vocabulary of the
//     built-in synthetic corpus (rl/byte_tokens.h: 256 ends a document), so its token stream and
//     text files prepared with this tokenizer agree.
//   - SentencePiece (optional: Debian's libsentencepiece-dev; see sentencepiece_available()):
//     train a BPE or unigram model on the user's text, or load an existing .model file. Models
//     trained here use byte fallback (no unknown tokens), identity normalization, no dummy prefix
//     and keep every space, so decode(encode(text)) == text for any UTF-8 text; digits are split
//     into single tokens. Their special tokens: <unk> 0, <s> 1 (bos), </s> 2 (eos).
//
// End of answer: the RL tasks end an answer with a newline (rl/task.h, kEndOfAnswer = '\n'), so
// special().end_of_answer is the token of "\n": the byte 10 for byte-level, the byte-fallback
// piece <0x0A> for models trained here; for a loaded model whose "\n" is not a single token, eos.
// It is ordinary text (decode keeps it), unlike bos/eos/pad/unk.
//
// encode() never adds special tokens (the caller places BOS/EOS); decode() drops bos, eos, pad and
// unk, and refuses ids outside the vocabulary.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::io {

// Ids of the special tokens; -1 where a tokenizer has none.
struct SpecialTokens {
  int32_t bos = -1;            // starts a document
  int32_t eos = -1;            // ends a document
  int32_t pad = -1;            // padding (never trained on)
  int32_t unk = -1;            // unknown text (never produced with byte fallback)
  int32_t end_of_answer = -1;  // ends the answer of a task: the token of "\n" (see above)
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string kind() const = 0;  // "byte-level" or "sentencepiece"
  virtual int64_t vocab_size() const = 0;
  const SpecialTokens& special() const { return special_; }
  // bos, eos, pad or unk (end_of_answer is text).
  bool is_special(int32_t id) const;

  // Text to ids; never emits special tokens.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Ids to text; special tokens produce no text; an id outside [0, vocab_size) throws.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // A readable form of one token ("<0x0A>", "▁the", "<eos>").
  virtual std::string piece(int32_t id) const = 0;
  // The bytes of the model file a later run loads (SentencePiece's .model); empty for byte-level.
  virtual std::string model_bytes() const { return {}; }
  // {"kind", "vocab_size", "bos", "eos", "pad", "unk", "end_of_answer"}.
  nlohmann::json describe() const;

 protected:
  SpecialTokens special_;
};

constexpr int32_t kByteEndOfText = 256;  // eos
constexpr int32_t kByteBos = 257;
constexpr int32_t kBytePad = 258;
constexpr int32_t kByteTokenizerVocab = 259;
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// Whether this build has SentencePiece; without it the functions below throw an Error saying how
// to get it.
bool sentencepiece_available();

// Loads a SentencePiece .model file.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);
// From the bytes of a .model file; `name` stands for it in errors.
std::unique_ptr<Tokenizer> load_sentencepiece_bytes(const std::string& model_bytes,
                                                    const std::string& name);

struct SentencePieceTrainOptions {
  int64_t vocab_size = 8192;  // an upper bound: small corpora may give fewer pieces
  std::string model_type = "bpe";  // "bpe" or "unigram"
  double character_coverage = 0.9995;  // the rarest characters fall back to bytes
  int64_t max_lines = 2'000'000;  // lines sampled for training (memory bound)
  int num_threads = 0;            // 0: all hardware threads
  uint64_t seed = 1337;           // line sampling
};
// Trains a SentencePiece model on the lines that `next_line` yields (it returns false at the end;
// lines longer than 4096 bytes are cut at a space or a character boundary).
std::unique_ptr<Tokenizer> train_sentencepiece(const std::function<bool(std::string& line)>& next_line,
                                               const SentencePieceTrainOptions& options);
// Trains on whole text files.
std::unique_ptr<Tokenizer> train_sentencepiece(const std::vector<std::string>& text_files,
                                               const SentencePieceTrainOptions& options);

}  // namespace fourbit::io
