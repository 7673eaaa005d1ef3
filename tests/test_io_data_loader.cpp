// io/data_loader.h: every sequence exactly once per epoch (with and without shuffling and random
// phase), different orders per epoch and seed, resume bit for bit from state() (also across epoch
// boundaries, through JSON text, with another batch size), refusal of a state of other data /
// seed / seq_len naming the field, and malformed shards (magic, version, truncation, token out of
// the vocabulary, too short for one sequence) refused naming the file.
#include "io/data_loader.h"

#include "io/token_shards.h"
#include "io_test_util.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <set>

namespace fourbit::io {
namespace {

using test::TempDir;

// Shard s holds tokens 10000 * s + i at position i, so a token names its shard and position.
std::vector<std::string> make_shards(const TempDir& dir, const std::vector<int>& sizes) {
  std::vector<std::string> paths;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<int32_t> tokens((size_t)sizes[s]);
    for (int i = 0; i < sizes[s]; ++i) tokens[(size_t)i] = (int32_t)(10000 * s + (size_t)i);
    paths.push_back(dir.file(fmt::format("shard_{:02}.bin", s)));
    write_token_shard(paths.back(), tokens, TokenWidth::kU16);
  }
  return paths;
}

// Takes n sequences (batch size 1) and returns their first input tokens; checks the targets.
std::vector<int32_t> take(DataLoader& dl, int64_t n) {
  const int64_t B = dl.options().batch_size, T = dl.options().seq_len;
  std::vector<int32_t> starts, in((size_t)(B * T)), tg((size_t)(B * T));
  for (int64_t got = 0; got < n; got += B) {
    dl.next_batch(in, tg);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(tg[(size_t)(b * T + t)], in[(size_t)(b * T + t)] + 1) << "target = next token";
        if (t > 0) EXPECT_EQ(in[(size_t)(b * T + t)], in[(size_t)(b * T + t - 1)] + 1);
      }
      starts.push_back(in[(size_t)(b * T)]);
    }
  }
  return starts;
}

TEST(DataLoader, EverySequenceOncePerEpoch) {
  TempDir dir;
  const std::vector<int> sizes = {1000, 537, 129, 2048};
  auto shards = ShardSet::open(make_shards(dir, sizes));
  const int64_t T = 16;
  // Without random phase: the sequences start at k * T with k * T + T + 1 <= L.
  std::set<int32_t> expected;
  for (size_t s = 0; s < sizes.size(); ++s)
    for (int64_t k = 0; k * T + T + 1 <= sizes[s]; ++k) expected.insert((int32_t)(10000 * s + k * T));
  for (bool shuffle : {false, true}) {
    LoaderOptions o;
    o.batch_size = 1;
    o.seq_len = T;
    o.shuffle = shuffle;
    o.random_phase = false;
    DataLoader dl(shards, all_spans(*shards), o);
    for (uint64_t epoch = 0; epoch < 3; ++epoch) {
      ASSERT_EQ(dl.sequences_in_epoch(epoch), (int64_t)expected.size());
      const std::vector<int32_t> got = take(dl, (int64_t)expected.size());
      EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), expected) << "epoch " << epoch;
      EXPECT_EQ(got.size(), expected.size());
      if (!shuffle) EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      if (shuffle) EXPECT_FALSE(std::is_sorted(got.begin(), got.end()));
    }
    take(dl, 1);  // the epoch counter moves when the next epoch's first sequence is taken
    EXPECT_EQ(dl.epoch(), 3u);
  }
}

TEST(DataLoader, RandomPhaseStillCoversEachSpanOnce) {
  TempDir dir;
  const std::vector<int> sizes = {1000, 700};
  auto shards = ShardSet::open(make_shards(dir, sizes));
  LoaderOptions o;
  o.batch_size = 1;
  o.seq_len = 32;
  DataLoader dl(shards, all_spans(*shards), o);
  std::set<int64_t> phases;
  for (uint64_t epoch = 0; epoch < 4; ++epoch) {
    const int64_t n = dl.sequences_in_epoch(epoch);
    const std::vector<int32_t> got = take(dl, n);
    std::map<int, std::set<int32_t>> per_shard;
    for (int32_t s : got) EXPECT_TRUE(per_shard[s / 10000].insert(s % 10000).second) << "duplicate";
    for (auto& [shard, starts] : per_shard) {
      const int64_t phase = *starts.begin() % 32;
      phases.insert(phase);
      int64_t k = 0;
      for (int32_t s : starts) {  // consecutive, non-overlapping, within the shard
        EXPECT_EQ(s, phase + 32 * k++);
        EXPECT_LE(s + 33, sizes[(size_t)shard]);
      }
      EXPECT_GE(k, (sizes[(size_t)shard] - 32) / 32 - 1);  // all that fit, give or take the phase
    }
  }
  EXPECT_GT(phases.size(), 1u) << "the phase never moved";
}

TEST(DataLoader, OrderDependsOnSeedAndEpoch) {
  TempDir dir;
  auto shards = ShardSet::open(make_shards(dir, {4000}));
  LoaderOptions o;
  o.batch_size = 1;
  o.seq_len = 8;
  DataLoader a(shards, all_spans(*shards), o), b(shards, all_spans(*shards), o);
  o.seed = 7;
  DataLoader c(shards, all_spans(*shards), o);
  const std::vector<int32_t> a0 = take(a, 50), b0 = take(b, 50), c0 = take(c, 50);
  EXPECT_EQ(a0, b0);
  EXPECT_NE(a0, c0);
  a.reset();
  EXPECT_EQ(take(a, 50), a0);
}

TEST(DataLoader, ResumeIsBitExact) {
  TempDir dir;
  auto shards = ShardSet::open(make_shards(dir, {900, 333, 1200}));
  LoaderOptions o;
  o.batch_size = 4;
  o.seq_len = 16;
  const int64_t per_epoch = DataLoader(shards, all_spans(*shards), o).sequences_in_epoch(0);
  // Stop points: early, mid-span, just before and after an epoch boundary.
  for (int64_t stop : {int64_t{1}, int64_t{7}, per_epoch / 4 - 1, per_epoch / 4 + 1}) {
    SCOPED_TRACE(stop);
    DataLoader a(shards, all_spans(*shards), o);
    for (int64_t i = 0; i < stop; ++i) a.next_batch();
    const std::string saved = a.state().dump();
    std::vector<int32_t> want_in, want_tg;
    for (int i = 0; i < 40; ++i) {
      DataLoader::Batch batch = a.next_batch();
      want_in.insert(want_in.end(), batch.inputs.ptr<int32_t>(), batch.inputs.ptr<int32_t>() + 64);
      want_tg.insert(want_tg.end(), batch.targets.ptr<int32_t>(), batch.targets.ptr<int32_t>() + 64);
    }
    DataLoader b(shards, all_spans(*shards), o);
    b.next_batch();  // anywhere: restore moves it
    b.restore(nlohmann::json::parse(saved));
    EXPECT_EQ(b.sequences_served(), stop * 4);
    std::vector<int32_t> got_in, got_tg;
    for (int i = 0; i < 40; ++i) {
      DataLoader::Batch batch = b.next_batch();
      got_in.insert(got_in.end(), batch.inputs.ptr<int32_t>(), batch.inputs.ptr<int32_t>() + 64);
      got_tg.insert(got_tg.end(), batch.targets.ptr<int32_t>(), batch.targets.ptr<int32_t>() + 64);
    }
    EXPECT_EQ(got_in, want_in);
    EXPECT_EQ(got_tg, want_tg);
    // Another batch size continues the same sequence stream.
    LoaderOptions o2 = o;
    o2.batch_size = 2;
    DataLoader c(shards, all_spans(*shards), o2);
    c.restore(nlohmann::json::parse(saved));
    std::vector<int32_t> c_in;
    for (int i = 0; i < 80; ++i) {
      DataLoader::Batch batch = c.next_batch();
      c_in.insert(c_in.end(), batch.inputs.ptr<int32_t>(), batch.inputs.ptr<int32_t>() + 32);
    }
    EXPECT_EQ(c_in, want_in);
  }
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\nlacks: " << n;
  }
}

TEST(DataLoader, RefusesForeignState) {
  TempDir dir;
  const std::vector<std::string> paths = make_shards(dir, {900, 500});
  auto shards = ShardSet::open(paths);
  LoaderOptions o;
  o.batch_size = 2;
  o.seq_len = 16;
  DataLoader a(shards, all_spans(*shards), o);
  a.next_batch();
  const nlohmann::json s = a.state();
  const nlohmann::json before = a.state();

  LoaderOptions other_seed = o;
  other_seed.seed = 1;
  DataLoader b(shards, all_spans(*shards), other_seed);
  const nlohmann::json b_before = b.state();
  expect_error([&] { b.restore(s); }, {"seed"});
  EXPECT_EQ(b.state(), b_before) << "a refused state must leave the loader unchanged";
  LoaderOptions other_t = o;
  other_t.seq_len = 32;
  DataLoader c(shards, all_spans(*shards), other_t);
  expect_error([&] { c.restore(s); }, {"seq_len"});
  auto one = ShardSet::open({paths[0]});
  DataLoader d(one, all_spans(*one), o);
  expect_error([&] { d.restore(s); }, {"data"});
  expect_error([&] { a.restore(nlohmann::json{{"epoch", 0}}); }, {"state"});
  EXPECT_EQ(a.state(), before);
}

TEST(DataLoader, MalformedShardsAreRefusedNamingTheFile) {
  TempDir dir;
  const std::string good = make_shards(dir, {300})[0];
  const std::vector<uint8_t> bytes = test::read_bytes(good);

  std::vector<uint8_t> bad_magic = bytes;
  bad_magic[0] ^= 0xFF;
  test::write_bytes(dir.file("bad_magic.bin"), bad_magic);
  expect_error([&] { ShardSet::open({dir.file("bad_magic.bin")}); }, {"bad_magic.bin", "magic"});

  std::vector<uint8_t> bad_version = bytes;
  bad_version[4] = 2;
  test::write_bytes(dir.file("bad_version.bin"), bad_version);
  expect_error([&] { ShardSet::open({dir.file("bad_version.bin")}); }, {"bad_version.bin", "version"});

  std::vector<uint8_t> truncated(bytes.begin(), bytes.end() - 10);
  test::write_bytes(dir.file("truncated.bin"), truncated);
  expect_error([&] { ShardSet::open({dir.file("truncated.bin")}); }, {"truncated.bin"});

  std::vector<uint8_t> header_only(bytes.begin(), bytes.begin() + 100);
  test::write_bytes(dir.file("short_header.bin"), header_only);
  expect_error([&] { ShardSet::open({dir.file("short_header.bin")}); }, {"short_header.bin"});

  // Tokens 256.. are outside a vocabulary of 256: the first is named.
  expect_error([&] { ShardSet::open({good}, 256); }, {"shard_00.bin", "token 256 at position 256"});
  EXPECT_NO_THROW(ShardSet::open({good}, 300));

  // A shard too short for one sequence of T + 1 tokens.
  auto tiny = ShardSet::open(make_shards(dir, {10}));
  LoaderOptions o;
  o.seq_len = 16;
  EXPECT_THROW(DataLoader(tiny, all_spans(*tiny), o), Error);
  expect_error([&] { ShardSet::open({}); }, {"no token shards"});
}

}  // namespace
}  // namespace fourbit::io
