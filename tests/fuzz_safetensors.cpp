// libFuzzer target: arbitrary bytes into the safetensors reader, from memory (tools/fuzz.sh builds
// it with clang, ASan and UBSan and runs it on tests/fuzz_corpus/safetensors/; CI runs it for a
// bounded time). See fuzz_safetensors_body.h for what counts as a bug.
//
// Findings: FILLED IN BELOW after the first runs.
#include "fuzz_safetensors_body.h"

#include <cstdio>
#include <cstdlib>
#include <exception>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    fourbit::io::fuzz::exercise_safetensors(std::span<const uint8_t>(data, size));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_safetensors: accepted input broke an invariant: %s\n", e.what());
    std::abort();
  }
  return 0;
}
