// `fourbit prepare`: text files -> tokenizer (trained SentencePiece, a loaded .model, or
// byte-level) -> token shards and meta.json in a folder (io/prepare.h does the work).
#include "cli/commands.h"
#include "io/prepare.h"

#include <cstdio>
#include <map>

namespace fourbit::cli {

Command add_prepare_command(CLI::App& app) {
  auto o = std::make_shared<io::PrepareOptions>();
  CLI::App* sub = app.add_subcommand(
      "prepare", "Tokenize text files into training and validation token shards (llm.c format) "
                 "with a SentencePiece tokenizer trained on them, a given one, or bytes");
  sub->add_option("inputs", o->inputs, "UTF-8 text files")->required()->check(CLI::ExistingFile);
  sub->add_option("--out", o->out_dir, "output folder (shards, tokenizer.model, meta.json)")
      ->required();
  auto* vocab = sub->add_option("--vocab", o->vocab_size,
                                "train a SentencePiece tokenizer with this vocabulary size on the "
                                "input (its training part)");
  auto* tokenizer = sub->add_option("--tokenizer", o->tokenizer_path,
                                    "use this SentencePiece .model file")
                        ->check(CLI::ExistingFile);
  auto* byte_level = sub->add_flag("--byte-level", o->byte_level,
                                   "byte-level tokenizer (256 bytes + <|endoftext|>, <|bos|>, "
                                   "<|pad|>); needs no training");
  vocab->excludes(tokenizer)->excludes(byte_level);
  tokenizer->excludes(byte_level);
  sub->add_option("--model-type", o->model_type, "SentencePiece model to train")
      ->check(CLI::IsMember({"bpe", "unigram"}))
      ->capture_default_str();
  sub->add_option("--character-coverage", o->character_coverage,
                  "SentencePiece training: fraction of characters that get their own pieces (the "
                  "rest fall back to bytes)")
      ->capture_default_str();
  sub->add_option("--shard-tokens", o->shard_tokens, "tokens per shard")->capture_default_str();
  sub->add_option("--val-fraction", o->val_fraction,
                  "the last fraction of each input file (from a line boundary) goes to validation "
                  "shards")
      ->capture_default_str();
  const std::map<std::string, io::DocumentSplit> documents = {
      {"file", io::DocumentSplit::kFile},
      {"line", io::DocumentSplit::kLine},
      {"paragraph", io::DocumentSplit::kParagraph},
      {"separator", io::DocumentSplit::kSeparator}};
  sub->add_option("--documents", o->documents,
                  "what a document is (each ends with EOS): a whole file, a line, a paragraph "
                  "(blank-line separated) or the text between separators")
      ->transform(CLI::CheckedTransformer(documents))
      ->default_str("file");
  sub->add_option("--separator", o->separator, "document separator for --documents separator")
      ->capture_default_str();
  sub->add_flag("--overwrite", o->overwrite, "replace a dataset already in --out");
  sub->add_option("--seed", o->seed, "seed of the tokenizer training's line sampling")
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "encoding and training threads (0: all cores)")
      ->capture_default_str();
  return {sub, [o] {
            const io::PrepareSummary summary = io::prepare_dataset(*o);
            std::fputs(summary.report().c_str(), stdout);
          }};
}

}  // namespace fourbit::cli
