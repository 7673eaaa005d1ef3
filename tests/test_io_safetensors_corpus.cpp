// Replays the safetensors fuzz corpus (tests/fuzz_corpus/safetensors/) through the fuzz target's
// checks (fuzz_safetensors_body.h) with the ordinary compiler, so that every input the fuzzer ever
// found, and every hand-made seed, is a regression test in the cpu suite:
//   valid_*  (tests/fuzz_corpus/make_seeds.py) must be accepted and survive the round trip;
//   bad_*    must be rejected with a fourbit::Error whose message names the input;
//   others   (inputs tools/fuzz.sh --merge kept) must be accepted or rejected, nothing else.
// FOURBIT_FUZZ_CORPUS overrides the directory.
#include "fuzz_safetensors_body.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fourbit::io {
namespace {

std::filesystem::path corpus_dir() {
  if (const char* env = std::getenv("FOURBIT_FUZZ_CORPUS")) return env;
  return std::filesystem::path(__FILE__).parent_path() / "fuzz_corpus" / "safetensors";
}

std::vector<std::filesystem::path> corpus_files() {
  std::vector<std::filesystem::path> files;
  const std::filesystem::path dir = corpus_dir();
  if (!std::filesystem::is_directory(dir)) return files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<uint8_t> read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

TEST(SafetensorsCorpus, HasTheHandMadeSeeds) {
  const auto files = corpus_files();
  int valid = 0, bad = 0;
  for (const auto& p : files) {
    const std::string name = p.filename().string();
    valid += starts_with(name, "valid_");
    bad += starts_with(name, "bad_");
  }
  EXPECT_GE(valid, 5) << "corpus " << corpus_dir() << ": run tests/fuzz_corpus/make_seeds.py";
  EXPECT_GE(bad, 20) << "corpus " << corpus_dir();
}

TEST(SafetensorsCorpus, EveryInputIsAcceptedOrRejectedCleanly) {
  for (const auto& p : corpus_files()) {
    const std::string name = p.filename().string();
    SCOPED_TRACE(name);
    const std::vector<uint8_t> bytes = read_all(p);
    bool accepted = false;
    // Anything but fourbit::Error (rejection, caught inside) is a bug: std::logic_error from a
    // broken invariant, or another exception escaping the reader.
    ASSERT_NO_THROW(accepted = fuzz::exercise_safetensors(bytes));
    if (starts_with(name, "valid_")) EXPECT_TRUE(accepted) << "a valid file was rejected";
    if (starts_with(name, "bad_")) {
      EXPECT_FALSE(accepted) << "a malformed file was accepted";
      try {
        SafetensorsFile::from_bytes(bytes, name);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos)
            << "the error does not name the file: " << e.what();
      }
    }
  }
}

TEST(SafetensorsCorpus, ValidSeedsReadAsWritten) {
  const std::filesystem::path p = corpus_dir() / "valid_f32_2x3";
  ASSERT_TRUE(std::filesystem::exists(p)) << p;
  const std::vector<uint8_t> bytes = read_all(p);
  const SafetensorsFile f = SafetensorsFile::from_bytes(bytes, p.string());
  const Tensor w = f.to_tensor("w");
  ASSERT_EQ(w.dtype(), DType::kF32);
  ASSERT_EQ(w.shape(), (Shape{2, 3}));
  const float want[6] = {1.0f, -2.0f, 0.5f, 3.25f, -0.0f, 65504.0f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(w.ptr<float>()[i], want[i]);
}

}  // namespace
}  // namespace fourbit::io
