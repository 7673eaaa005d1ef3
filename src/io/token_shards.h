// Token shards in the llm.c / nanoGPT binary format, the training data of `fourbit pretrain`.
//
// A shard is a header of 256 little-endian int32 followed by the tokens:
//   header[0] magic, header[1] version, header[2] number of tokens, header[3..255] zero;
//   magic 20240520, version 1: uint16 tokens (llm.c's GPT-2 format; vocabularies <= 65536);
//   magic 20240801, version 7: uint32 tokens (llm.c's newer Llama-3 format).
// These are exactly the two headers of llm.c's dev/data/data_common.py (HEADERS_INFO), so shards
// written by llm.c's scripts load here and ours load there. llm.c has no "version 2"; a file with
// magic 20240520 and any version other than 1 is rejected. The token count is an int32, so a
// shard holds fewer than 2^31 tokens.
//
// Reading memory-maps the file and validates it before use: magic, version, the token count
// against the file size, and (when a vocabulary size is given) every token id. Errors name the file
// and say what to do.
#pragma once

#include "io/atomic_file.h"
#include "io/mapped_file.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fourbit::io {

constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
constexpr int32_t kShardMagicU16 = 20240520;
constexpr int32_t kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801;
constexpr int32_t kShardVersionU32 = 7;
constexpr int64_t kShardMaxTokens = (int64_t{1} << 31) - 1;

enum class TokenWidth : uint8_t { kU16, kU32 };
constexpr int token_bytes(TokenWidth w) { return w == TokenWidth::kU16 ? 2 : 4; }
// uint16 when every id of a vocabulary of `vocab_size` tokens fits, else uint32.
constexpr TokenWidth token_width_for_vocab(int64_t vocab_size) {
  return vocab_size <= 65536 ? TokenWidth::kU16 : TokenWidth::kU32;
}

// Writes `tokens` as one shard at `path`, atomically. Throws when a token is negative or does not
// fit `width` (naming its position) or when there are more than kShardMaxTokens tokens.
void write_token_shard(const std::string& path, std::span<const int32_t> tokens, TokenWidth width,
                       const AtomicWriteOptions& options = {});

class TokenShard {
 public:
  TokenShard() = default;
  // Maps and validates the shard. With vocab_size > 0 every token must be < vocab_size (one pass
  // over the file); uint32 tokens must always fit an int32.
  static TokenShard open(const std::string& path, int64_t vocab_size = 0);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return n_tokens_; }
  TokenWidth width() const { return width_; }
  int32_t at(int64_t i) const;
  // Copies tokens [begin, begin + n) into out[0, n) as int32.
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  MappedFile file_;
  const uint8_t* tokens_ = nullptr;
  int64_t n_tokens_ = 0;
  TokenWidth width_ = TokenWidth::kU16;
};

// The shard files named by `pattern`: a directory (its *.bin files), a glob pattern
// ("data/train_*.bin") or one file; sorted by name. Throws when nothing matches.
std::vector<std::string> find_shards(const std::string& pattern);

}  // namespace fourbit::io
