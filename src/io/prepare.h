// Dataset preparation (`fourbit prepare`): text files -> tokenizer -> token shards in a folder.
//
// The output folder holds
//   train_000000.bin, train_000001.bin, ...  training shards (token_shards.h format)
//   val_000000.bin, ...                      validation shards (absent with val_fraction 0)
//   tokenizer.model                          the SentencePiece model (absent for byte-level)
//   meta.json                                tokenizer, vocabulary, special ids, shard lists,
//                                            token counts, sources (read_dataset() reads it)
// Every file is written atomically; meta.json last, so a folder with a meta.json is complete.
//
// Documents: each becomes its tokens followed by EOS (one delimiter per document, as in llm.c's
// GPT-2 shards and the built-in synthetic corpus; no BOS). With DocumentSplit::kFile a whole input
// file is one document, kLine makes every non-empty line one (without its newline), kParagraph
// splits at blank lines, kSeparator at a separator text (default "<|endoftext|>", which `fourbit
// corpus` writes after every document; the separator itself is not encoded; empty documents are
// skipped). Text is encoded in chunks of about 1 MiB cut at line boundaries, in parallel, in a
// deterministic order.
//
// Validation split: the last val_fraction of every input file's bytes, starting at a line
// boundary, goes to the val_ shards (a document that straddles the cut becomes two). A trained
// tokenizer sees only the training part.
#pragma once

#include "io/token_shards.h"
#include "io/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fourbit::io {

enum class DocumentSplit { kFile, kLine, kParagraph, kSeparator };

struct PrepareOptions {
  std::vector<std::string> inputs;  // UTF-8 text files
  std::string out_dir;
  // The tokenizer: exactly one of these three.
  int64_t vocab_size = 0;       // train a SentencePiece model with this vocabulary
  std::string tokenizer_path;   // load this SentencePiece .model
  bool byte_level = false;      // the byte-level tokenizer
  std::string model_type = "bpe";       // SentencePiece training: bpe or unigram
  double character_coverage = 0.9995;   // SentencePiece training
  int64_t shard_tokens = 100'000'000;   // tokens per shard (the last one may hold fewer)
  double val_fraction = 0.05;
  DocumentSplit documents = DocumentSplit::kFile;
  std::string separator = "<|endoftext|>";  // with DocumentSplit::kSeparator
  bool overwrite = false;  // replace a dataset already in out_dir
  uint64_t seed = 1337;    // tokenizer training (line sampling)
  int threads = 0;         // 0: all hardware threads
};

struct PrepareSummary {
  std::string out_dir;
  nlohmann::json tokenizer;  // Tokenizer::describe(), plus "file" and "trained"
  int64_t input_bytes = 0;
  int64_t n_documents = 0;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::vector<std::string> train_shards;  // paths
  std::vector<std::string> val_shards;
  TokenWidth width = TokenWidth::kU16;
  double tokenizer_seconds = 0;
  double seconds = 0;

  std::string report() const;  // a few lines for the terminal
};

PrepareSummary prepare_dataset(const PrepareOptions& options);

// A prepared folder, from its meta.json.
struct DatasetInfo {
  std::string dir;
  nlohmann::json meta;
  std::vector<std::string> train_shards;  // paths
  std::vector<std::string> val_shards;
  int64_t vocab_size = 0;
};
DatasetInfo read_dataset(const std::string& dir);
// The tokenizer a prepared folder was made with.
std::unique_ptr<Tokenizer> load_dataset_tokenizer(const DatasetInfo& dataset);

}  // namespace fourbit::io
