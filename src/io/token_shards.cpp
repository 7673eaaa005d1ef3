// Token shard writer, validating memory-mapped reader and shard discovery.
#include "io/token_shards.h"

#include "core/check.h"

#include <glob.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian; fourbit assumes a little-endian host");

namespace fourbit::io {

namespace {

[[noreturn]] void reject(const std::string& path, const std::string& what) {
  throw Error(fmt::format("{}: not a valid token shard: {}", path, what));
}

}  // namespace

void write_token_shard(const std::string& path, std::span<const int32_t> tokens, TokenWidth width,
                       const AtomicWriteOptions& options) {
  const int64_t n = (int64_t)tokens.size();
  if (n > kShardMaxTokens) {
    throw Error(fmt::format("{}: {} tokens do not fit one shard (the header's count is an int32: "
                            "at most {}); write several shards", path, n, kShardMaxTokens));
  }
  const int64_t max_id = width == TokenWidth::kU16 ? 65535 : std::numeric_limits<int32_t>::max();
  int32_t header[kShardHeaderInts] = {};
  header[0] = width == TokenWidth::kU16 ? kShardMagicU16 : kShardMagicU32;
  header[1] = width == TokenWidth::kU16 ? kShardVersionU16 : kShardVersionU32;
  header[2] = (int32_t)n;
  AtomicFile file(path, options);
  file.write(header, sizeof(header));
  // Converted and written in chunks, so that a large shard needs no second copy in memory.
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<uint8_t> buffer;
  for (int64_t chunk = 0; chunk < n; chunk += kChunk) {
    const int64_t m = std::min(kChunk, n - chunk);
    buffer.resize((size_t)(m * token_bytes(width)));
    for (int64_t i = 0; i < m; ++i) {
      const int32_t t = tokens[(size_t)(chunk + i)];
      if (t < 0 || t > max_id) {
        throw Error(fmt::format("{}: token {} at position {} does not fit a {} shard (ids 0..{})",
                                path, t, chunk + i, width == TokenWidth::kU16 ? "uint16" : "uint32",
                                max_id));
      }
      if (width == TokenWidth::kU16) {
        const uint16_t v = (uint16_t)t;
        std::memcpy(buffer.data() + 2 * i, &v, 2);
      } else {
        const uint32_t v = (uint32_t)t;
        std::memcpy(buffer.data() + 4 * i, &v, 4);
      }
    }
    file.write(buffer.data(), (int64_t)buffer.size());
  }
  file.commit();
}

TokenShard TokenShard::open(const std::string& path, int64_t vocab_size) {
  TokenShard s;
  s.file_ = MappedFile::open(path);
  const std::span<const uint8_t> bytes = s.file_.bytes();
  if ((int64_t)bytes.size() < kShardHeaderBytes) {
    reject(path, fmt::format("it is {} bytes long, shorter than the {}-byte header (truncated, or "
                             "not a shard)", bytes.size(), kShardHeaderBytes));
  }
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  const int32_t magic = header[0], version = header[1], count = header[2];
  if (magic == kShardMagicU16) {
    if (version != kShardVersionU16) {
      reject(path, fmt::format("magic {} with version {}: that magic's only version is {} (uint16 "
                               "tokens); uint32 shards use magic {} version {}", magic, version,
                               kShardVersionU16, kShardMagicU32, kShardVersionU32));
    }
    s.width_ = TokenWidth::kU16;
  } else if (magic == kShardMagicU32) {
    if (version != kShardVersionU32) {
      reject(path, fmt::format("magic {} with version {}: that magic's only version is {} (uint32 "
                               "tokens)", magic, version, kShardVersionU32));
    }
    s.width_ = TokenWidth::kU32;
  } else {
    reject(path, fmt::format("bad magic {} (expected {} for uint16 tokens or {} for uint32 tokens, "
                             "llm.c's formats): is this a token shard? Re-create it with `fourbit "
                             "prepare`", magic, kShardMagicU16, kShardMagicU32));
  }
  if (count < 0) reject(path, fmt::format("negative token count {} in the header", count));
  s.n_tokens_ = count;
  const int64_t width_bytes = token_bytes(s.width_);
  const int64_t token_area = (int64_t)bytes.size() - kShardHeaderBytes;
  if (token_area < s.n_tokens_ * width_bytes) {
    reject(path, fmt::format("the header announces {} tokens ({} bytes) but the file holds only {} "
                             "bytes of tokens (truncated?)", s.n_tokens_, s.n_tokens_ * width_bytes,
                             token_area));
  }
  if (token_area > s.n_tokens_ * width_bytes) {
    reject(path, fmt::format("the file has {} bytes after the {} tokens its header announces "
                             "(wrong token count, or wrong token width?)",
                             token_area - s.n_tokens_ * width_bytes, s.n_tokens_));
  }
  s.tokens_ = bytes.data() + kShardHeaderBytes;
  // uint32 ids become int32 model inputs, so they must be below 2^31 even without a vocabulary.
  const int64_t limit = vocab_size > 0 ? vocab_size
                                       : (s.width_ == TokenWidth::kU32 ? int64_t{1} << 31 : 0);
  if (limit > 0) {
    for (int64_t i = 0; i < s.n_tokens_; ++i) {
      uint32_t t;
      if (s.width_ == TokenWidth::kU16) {
        uint16_t v;
        std::memcpy(&v, s.tokens_ + 2 * i, 2);
        t = v;
      } else {
        std::memcpy(&t, s.tokens_ + 4 * i, 4);
      }
      if ((int64_t)t >= limit) {
        reject(path, vocab_size > 0
                         ? fmt::format("token {} at position {} is outside the vocabulary of {} "
                                       "tokens (made with another tokenizer?)", t, i, vocab_size)
                         : fmt::format("token {} at position {} does not fit an int32", t, i));
      }
    }
  }
  return s;
}

int32_t TokenShard::at(int64_t i) const {
  FOURBIT_CHECK(i >= 0 && i < n_tokens_, "{}: token index {} out of range [0, {})", path(), i,
                n_tokens_);
  int32_t out;
  read(i, 1, &out);
  return out;
}

void TokenShard::read(int64_t begin, int64_t n, int32_t* out) const {
  FOURBIT_CHECK(begin >= 0 && n >= 0 && begin + n <= n_tokens_,
                "{}: tokens [{}, {}) are out of range [0, {})", path(), begin, begin + n, n_tokens_);
  if (width_ == TokenWidth::kU16) {
    const uint8_t* p = tokens_ + 2 * begin;
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  } else {
    const uint8_t* p = tokens_ + 4 * begin;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = (int32_t)v;  // < 2^31: checked by open()
    }
  }
}

std::vector<std::string> find_shards(const std::string& pattern) {
  namespace fs = std::filesystem;
  std::vector<std::string> paths;
  std::error_code ec;
  if (fs::is_directory(pattern, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(pattern, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".bin") paths.push_back(e.path().string());
    }
    if (ec) throw Error(fmt::format("cannot list '{}': {}", pattern, ec.message()));
  } else {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    }
    ::globfree(&g);
  }
  std::sort(paths.begin(), paths.end());
  if (paths.empty()) {
    throw Error(fmt::format("no token shards match '{}' (give a directory of .bin shards, a glob "
                            "such as 'data/train_*.bin', or a file; `fourbit prepare` makes them)",
                            pattern));
  }
  return paths;
}

}  // namespace fourbit::io
