// Token shards: round trips in both widths, the exact llm.c header, malformed files with clear
// errors, vocabulary checks, atomic writes and shard discovery.
#include "io/token_shards.h"

#include "io_test_util.h"

#include <gtest/gtest.h>

#include <cstring>

namespace fourbit::io {
namespace {

using test::TempDir;

std::vector<int32_t> read_all(const TokenShard& s) {
  std::vector<int32_t> out((size_t)s.size());
  s.read(0, s.size(), out.data());
  return out;
}

// A shard file from raw header ints and token bytes.
void write_raw(const std::string& path, int32_t magic, int32_t version, int32_t count,
               const std::vector<uint8_t>& tokens) {
  std::vector<uint8_t> bytes((size_t)kShardHeaderBytes);
  const int32_t header[3] = {magic, version, count};
  std::memcpy(bytes.data(), header, sizeof(header));
  bytes.resize(bytes.size() + tokens.size());
  if (!tokens.empty()) std::memcpy(bytes.data() + kShardHeaderBytes, tokens.data(), tokens.size());
  test::write_bytes(path, bytes);
}

TEST(TokenShards, RoundTripUint16) {
  TempDir dir;
  const std::vector<int32_t> tokens = {0, 1, 255, 256, 50256, 65535, 7};
  write_token_shard(dir.file("a.bin"), tokens, TokenWidth::kU16);
  const TokenShard s = TokenShard::open(dir.file("a.bin"));
  EXPECT_EQ(s.width(), TokenWidth::kU16);
  EXPECT_EQ(s.size(), 7);
  EXPECT_EQ(read_all(s), tokens);
  EXPECT_EQ(s.at(4), 50256);
  std::vector<int32_t> mid(3);
  s.read(2, 3, mid.data());
  EXPECT_EQ(mid, (std::vector<int32_t>{255, 256, 50256}));
  EXPECT_ERROR_CONTAINS(s.read(5, 3, mid.data()), "a.bin", "tokens [5, 8) are out of range [0, 7)");
}

TEST(TokenShards, RoundTripUint32) {
  TempDir dir;
  const std::vector<int32_t> tokens = {0, 65536, 128255, 2147483647, 3};
  write_token_shard(dir.file("b.bin"), tokens, TokenWidth::kU32);
  const TokenShard s = TokenShard::open(dir.file("b.bin"));
  EXPECT_EQ(s.width(), TokenWidth::kU32);
  EXPECT_EQ(read_all(s), tokens);
}

TEST(TokenShards, EmptyShard) {
  TempDir dir;
  write_token_shard(dir.file("e.bin"), std::vector<int32_t>{}, TokenWidth::kU16);
  EXPECT_EQ(TokenShard::open(dir.file("e.bin")).size(), 0);
  EXPECT_EQ(test::read_bytes(dir.file("e.bin")).size(), (size_t)kShardHeaderBytes);
}

// The bytes are llm.c's: 256 int32 (magic, version, count, zeros), then little-endian tokens.
TEST(TokenShards, HeaderIsLlmcFormat) {
  TempDir dir;
  write_token_shard(dir.file("u16.bin"), std::vector<int32_t>{1, 2, 3}, TokenWidth::kU16);
  write_token_shard(dir.file("u32.bin"), std::vector<int32_t>{1, 2, 3}, TokenWidth::kU32);
  for (const auto& [name, magic, version, width] :
       {std::tuple{"u16.bin", 20240520, 1, 2}, std::tuple{"u32.bin", 20240801, 7, 4}}) {
    const std::vector<uint8_t> bytes = test::read_bytes(dir.file(name));
    ASSERT_EQ(bytes.size(), (size_t)(1024 + 3 * width));
    int32_t header[256];
    std::memcpy(header, bytes.data(), sizeof(header));
    EXPECT_EQ(header[0], magic);
    EXPECT_EQ(header[1], version);
    EXPECT_EQ(header[2], 3);
    for (int i = 3; i < 256; ++i) EXPECT_EQ(header[i], 0);
    EXPECT_EQ(bytes[1024], 1);
    EXPECT_EQ(bytes[1024 + width], 2);
  }
  EXPECT_EQ(token_width_for_vocab(65536), TokenWidth::kU16);
  EXPECT_EQ(token_width_for_vocab(65537), TokenWidth::kU32);
  EXPECT_EQ(token_width_for_vocab(128256), TokenWidth::kU32);
}

TEST(TokenShards, WriterRefusesTokensThatDoNotFit) {
  TempDir dir;
  EXPECT_ERROR_CONTAINS(write_token_shard(dir.file("x.bin"), std::vector<int32_t>{1, 65536}, TokenWidth::kU16),
                        "token 65536 at position 1 does not fit a uint16 shard");
  EXPECT_ERROR_CONTAINS(write_token_shard(dir.file("x.bin"), std::vector<int32_t>{-1}, TokenWidth::kU32),
                        "token -1 at position 0");
  EXPECT_TRUE(dir.entries().empty());  // nothing half-written left behind
}

TEST(TokenShards, RejectsMalformedFilesNamingThem) {
  TempDir dir;
  const std::string p = dir.file("bad.bin");
  const std::vector<uint8_t> four_u16(8);

  write_raw(p, 12345, 1, 4, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), p + ": not a valid token shard: bad magic 12345",
                        "expected 20240520 for uint16 tokens or 20240801 for uint32");
  write_raw(p, 20240520, 2, 4, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "magic 20240520 with version 2",
                        "uint32 shards use magic 20240801 version 7");
  write_raw(p, 20240801, 1, 2, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "magic 20240801 with version 1");
  write_raw(p, 20240520, 1, 5, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "announces 5 tokens (10 bytes) but the file holds only 8",
                        "truncated");
  write_raw(p, 20240520, 1, 3, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "2 bytes after the 3 tokens its header announces");
  write_raw(p, 20240801, 7, 3, four_u16);  // 8 bytes hold 2 uint32 tokens, not 3
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "announces 3 tokens (12 bytes)");
  write_raw(p, 20240520, 1, -4, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "negative token count -4");
  test::write_bytes(p, four_u16);
  EXPECT_ERROR_CONTAINS(TokenShard::open(p), "8 bytes long, shorter than the 1024-byte header");
  EXPECT_ERROR_CONTAINS(TokenShard::open(dir.file("missing.bin")), "cannot open", "missing.bin");
}

TEST(TokenShards, ChecksTokenIdsAgainstTheVocabulary) {
  TempDir dir;
  write_token_shard(dir.file("v.bin"), std::vector<int32_t>{1, 2, 300, 4}, TokenWidth::kU16);
  EXPECT_NO_THROW(TokenShard::open(dir.file("v.bin"), 301));
  EXPECT_ERROR_CONTAINS(TokenShard::open(dir.file("v.bin"), 300),
                        "token 300 at position 2 is outside the vocabulary of 300 tokens");
  // uint32 ids at or above 2^31 cannot be int32 model inputs, vocabulary or not.
  const uint32_t big[2] = {5, 0x80000000u};
  std::vector<uint8_t> bytes(8);
  std::memcpy(bytes.data(), big, 8);
  write_raw(dir.file("big.bin"), 20240801, 7, 2, bytes);
  EXPECT_ERROR_CONTAINS(TokenShard::open(dir.file("big.bin")),
                        "token 2147483648 at position 1 does not fit an int32");
}

TEST(TokenShards, AtomicWriteKeepsThePreviousShard) {
  TempDir dir;
  const std::string p = dir.file("s.bin");
  write_token_shard(p, std::vector<int32_t>{1, 2, 3}, TokenWidth::kU16);
  const std::vector<uint8_t> before = test::read_bytes(p);
  AtomicWriteOptions crash;
  crash.after_write = [](int64_t) { throw Error("simulated crash"); };
  EXPECT_ERROR_CONTAINS(write_token_shard(p, std::vector<int32_t>{4, 5, 6, 7}, TokenWidth::kU16, crash), "simulated crash");
  EXPECT_EQ(test::read_bytes(p), before);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"s.bin"});
}

TEST(TokenShards, FindShards) {
  TempDir dir;
  for (const char* name : {"train_000001.bin", "train_000000.bin", "val_000000.bin"}) {
    write_token_shard(dir.file(name), std::vector<int32_t>{1}, TokenWidth::kU16);
  }
  test::write_text(dir.file("notes.txt"), "not a shard");
  EXPECT_EQ(find_shards(dir.path()),
            (std::vector<std::string>{dir.file("train_000000.bin"), dir.file("train_000001.bin"),
                                      dir.file("val_000000.bin")}));
  EXPECT_EQ(find_shards(dir.file("train_*.bin")),
            (std::vector<std::string>{dir.file("train_000000.bin"), dir.file("train_000001.bin")}));
  EXPECT_EQ(find_shards(dir.file("val_000000.bin")), std::vector<std::string>{dir.file("val_000000.bin")});
  EXPECT_ERROR_CONTAINS(find_shards(dir.file("test_*.bin")), "no token shards match", "fourbit prepare");
}

}  // namespace
}  // namespace fourbit::io
