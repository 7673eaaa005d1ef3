// The byte-level vocabulary of the default job: the one place its token ids are defined.
//
// Ids 0..255 are the bytes themselves (token id = unsigned byte value); id 256 ends a document.
// The built-in synthetic corpus (rl/synthetic_corpus.h) emits exactly this, and so must the
// byte-level tokenizer (io) and the sampler's stop tokens, so all of them include this header
// rather than repeating the numbers. A model for this vocabulary needs vocab >= kByteVocabSize
// (pad it, e.g. to 384, for speed; the padding ids never occur in the data).
//
// Text form. Where documents are written as one text (`fourbit corpus`, a text file handed to
// the tokenizer), each document is followed by kEndOfDocumentText; a byte-level tokenizer that
// maps that exact string to kEndOfDocumentToken and every other byte to itself reproduces the
// token stream of SyntheticCorpus::fill_tokens bit for bit (tests/test_rl_synthetic_corpus.cpp).
//
// Header-only with no dependencies, so that lower modules can share it; when the tokenizer lands
// in io, this header can move there unchanged (only the include path changes).
#pragma once

#include <cstdint>
#include <string_view>

namespace fourbit::rl {

inline constexpr int32_t kByteTokenCount = 256;       // ids 0..255: byte values
inline constexpr int32_t kEndOfDocumentToken = 256;   // after every document
inline constexpr int32_t kByteVocabSize = 257;        // smallest vocabulary that holds both
inline constexpr std::string_view kEndOfDocumentText = "<|endoftext|>";

}  // namespace fourbit::rl
