// prepare_dataset: read text, pick or train the tokenizer, encode documents in parallel batches,
// write shards and meta.json (see prepare.h).
#include "io/prepare.h"

#include "core/check.h"
#include "core/log.h"
#include "io/atomic_file.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <mutex>
#include <thread>

namespace fourbit::io {

namespace fs = std::filesystem;

namespace {

constexpr size_t kChunkBytes = size_t{1} << 20;
constexpr const char* kMetaFile = "meta.json";
constexpr const char* kTokenizerFile = "tokenizer.model";

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The lines of one file with the offset where each starts; the newline stays on the line.
class LineReader {
 public:
  explicit LineReader(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    if (!in_) throw Error(fmt::format("cannot open the text file '{}'", path));
  }
  bool next(std::string& line, int64_t& start) {
    if (!std::getline(in_, line)) {
      if (in_.bad()) throw Error(fmt::format("error reading '{}'", path_));
      return false;
    }
    start = offset_;
    if (!in_.eof()) line += '\n';
    offset_ += (int64_t)line.size();
    return true;
  }

 private:
  std::string path_;
  std::ifstream in_;
  int64_t offset_ = 0;
};

// The first byte offset of a file's validation part: lines starting there or later are held out.
int64_t val_start(int64_t file_bytes, double val_fraction) {
  return file_bytes - (int64_t)std::floor((double)file_bytes * val_fraction);
}

std::string strip_newline(std::string s) {
  if (!s.empty() && s.back() == '\n') s.pop_back();
  if (!s.empty() && s.back() == '\r') s.pop_back();
  return s;
}

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

// A piece of a document to encode, and which split it goes to.
struct Job {
  std::string text;
  bool eos = false;  // the document ends here
  int split = 0;     // 0 train, 1 val
};

// Appends tokens to consecutive shards <prefix>_000000.bin, ... of shard_tokens tokens.
class ShardStream {
 public:
  ShardStream(std::string dir, std::string prefix, int64_t shard_tokens, TokenWidth width)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), width_(width) {}

  void append(const std::vector<int32_t>& tokens) {
    size_t i = 0;
    while (i < tokens.size()) {
      const size_t take = std::min(tokens.size() - i, (size_t)shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens.begin() + (ptrdiff_t)i, tokens.begin() + (ptrdiff_t)(i + take));
      i += take;
      if ((int64_t)buffer_.size() == shard_tokens_) flush();
    }
    total_ += (int64_t)tokens.size();
  }
  void finish() {
    if (!buffer_.empty()) flush();
  }
  int64_t total() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  void flush() {
    const std::string name = fmt::format("{}_{:06d}.bin", prefix_, files_.size());
    write_token_shard((fs::path(dir_) / name).string(), buffer_, width_);
    files_.push_back(name);
    buffer_.clear();
  }

  std::string dir_, prefix_;
  int64_t shard_tokens_;
  TokenWidth width_;
  std::vector<int32_t> buffer_;
  std::vector<std::string> files_;
  int64_t total_ = 0;
};

// Encodes a batch of jobs on `threads` threads (contiguous ranges of jobs, balanced by bytes).
std::vector<std::vector<int32_t>> encode_batch(const Tokenizer& tok, const std::vector<Job>& jobs,
                                               int threads) {
  std::vector<std::vector<int32_t>> out(jobs.size());
  auto work = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) out[i] = tok.encode(jobs[i].text);
  };
  size_t total = 0;
  for (const Job& j : jobs) total += j.text.size() + 1;
  if (threads <= 1 || jobs.size() < 2) {
    work(0, jobs.size());
    return out;
  }
  std::vector<size_t> bounds{0};
  size_t acc = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    acc += jobs[i].text.size() + 1;
    if (acc * (size_t)threads >= total * bounds.size() && bounds.size() < (size_t)threads) {
      bounds.push_back(i + 1);
    }
  }
  if (bounds.back() != jobs.size()) bounds.push_back(jobs.size());
  std::vector<std::thread> pool;
  std::exception_ptr error;
  std::mutex error_mutex;
  for (size_t t = 0; t + 1 < bounds.size(); ++t) {
    pool.emplace_back([&, t] {
      try {
        work(bounds[t], bounds[t + 1]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (std::thread& th : pool) th.join();
  if (error) std::rethrow_exception(error);
  return out;
}

// The dataset files a previous run left in `dir`.
std::vector<fs::path> dataset_files(const std::string& dir) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool shard = (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin");
    if (shard || name == kMetaFile || name == kTokenizerFile) found.push_back(e.path());
  }
  return found;
}

std::string width_name(TokenWidth w) { return w == TokenWidth::kU16 ? "uint16" : "uint32"; }

}  // namespace

PrepareSummary prepare_dataset(const PrepareOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  PrepareSummary summary;
  summary.out_dir = o.out_dir;

  // --- arguments ---------------------------------------------------------------------------------
  if (o.inputs.empty()) throw Error("prepare: no input text files given");
  if (o.out_dir.empty()) throw Error("prepare: no output folder given (--out DIR)");
  const int n_choices = (o.vocab_size > 0) + !o.tokenizer_path.empty() + o.byte_level;
  if (n_choices != 1) {
    throw Error(n_choices == 0
                    ? "prepare: choose a tokenizer: --vocab N (train SentencePiece on the input), "
                      "--tokenizer FILE (an existing SentencePiece .model) or --byte-level"
                    : "prepare: --vocab, --tokenizer and --byte-level exclude each other: give one");
  }
  if (o.shard_tokens < 1 || o.shard_tokens > kShardMaxTokens) {
    throw Error(fmt::format("prepare: --shard-tokens {} is not in [1, {}]", o.shard_tokens,
                            kShardMaxTokens));
  }
  if (o.documents == DocumentSplit::kSeparator &&
      (o.separator.empty() || o.separator.find('\n') != std::string::npos)) {
    throw Error("prepare: the document separator must be non-empty text without a newline");
  }
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    throw Error(fmt::format("prepare: --val-fraction {} is not in [0, 1)", o.val_fraction));
  }
  std::vector<int64_t> file_bytes;
  for (const std::string& path : o.inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      throw Error(fmt::format("prepare: input '{}' is not a readable file", path));
    }
    file_bytes.push_back((int64_t)fs::file_size(path));
    summary.input_bytes += file_bytes.back();
  }
  const std::vector<fs::path> previous = dataset_files(o.out_dir);
  if (!previous.empty() && !o.overwrite) {
    throw Error(fmt::format("prepare: '{}' already holds a prepared dataset ({} files such as '{}'); "
                            "pass --overwrite to replace it, or choose another --out",
                            o.out_dir, previous.size(), previous.front().filename().string()));
  }
  const int threads = o.threads > 0 ? o.threads
                                    : std::max(1, (int)std::thread::hardware_concurrency());

  // --- tokenizer ---------------------------------------------------------------------------------
  const auto t_tok = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tok;
  bool trained = false;
  if (o.byte_level) {
    tok = make_byte_tokenizer();
  } else if (!o.tokenizer_path.empty()) {
    tok = load_sentencepiece(o.tokenizer_path);
  } else {
    SentencePieceTrainOptions train;
    train.vocab_size = o.vocab_size;
    train.model_type = o.model_type;
    train.character_coverage = o.character_coverage;
    train.num_threads = threads;
    train.seed = o.seed;
    // Only the training part of each file.
    size_t file = 0;
    std::unique_ptr<LineReader> reader;
    auto next_line = [&](std::string& line) -> bool {
      for (;;) {
        int64_t start = 0;
        if (reader && reader->next(line, start)) {
          if (start < val_start(file_bytes[file - 1], o.val_fraction)) {
            line = strip_newline(std::move(line));
            return true;
          }
          reader.reset();  // the rest of this file is validation text
          continue;
        }
        if (file == o.inputs.size()) return false;
        reader = std::make_unique<LineReader>(o.inputs[file++]);
      }
    };
    log_info("prepare: training a SentencePiece {} tokenizer (vocabulary {}) on {} file(s)",
             o.model_type, o.vocab_size, o.inputs.size());
    tok = train_sentencepiece(next_line, train);
    trained = true;
  }
  summary.tokenizer_seconds = seconds_since(t_tok);
  summary.width = token_width_for_vocab(tok->vocab_size());

  // --- output folder -----------------------------------------------------------------------------
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) throw Error(fmt::format("prepare: cannot create '{}': {}", o.out_dir, ec.message()));
  for (const fs::path& p : previous) fs::remove(p, ec);  // after loading a --tokenizer from there
  summary.tokenizer = tok->describe();
  summary.tokenizer["trained"] = trained;
  if (trained) summary.tokenizer["model_type"] = o.model_type;
  const std::string model = tok->model_bytes();
  if (!model.empty()) {
    write_file_atomically((fs::path(o.out_dir) / kTokenizerFile).string(), model);
    summary.tokenizer["file"] = kTokenizerFile;
  }

  // --- documents -> jobs -> tokens -> shards ------------------------------------------------------
  ShardStream streams[2] = {ShardStream(o.out_dir, "train", o.shard_tokens, summary.width),
                            ShardStream(o.out_dir, "val", o.shard_tokens, summary.width)};
  const SpecialTokens& sp = tok->special();
  std::vector<Job> batch;
  size_t batch_bytes = 0;
  auto run_batch = [&] {
    const std::vector<std::vector<int32_t>> encoded = encode_batch(*tok, batch, threads);
    std::vector<int32_t> tokens;
    for (size_t i = 0; i < batch.size(); ++i) {
      tokens.clear();
      tokens.insert(tokens.end(), encoded[i].begin(), encoded[i].end());
      if (batch[i].eos && sp.eos >= 0) tokens.push_back(sp.eos);
      streams[batch[i].split].append(tokens);
    }
    batch.clear();
    batch_bytes = 0;
  };
  auto submit = [&](Job job) {
    if (job.eos) ++summary.n_documents;
    batch_bytes += job.text.size();
    batch.push_back(std::move(job));
    if (batch_bytes >= kChunkBytes * (size_t)threads || batch.size() >= 65536) run_batch();
  };

  for (size_t f = 0; f < o.inputs.size(); ++f) {
    LineReader reader(o.inputs[f]);
    const int64_t cut = o.val_fraction > 0 ? val_start(file_bytes[f], o.val_fraction) : file_bytes[f] + 1;
    std::string line, pending;
    int64_t start = 0;
    int split = 0;
    bool submitted = false;  // part of the current document has been submitted
    auto open = [&] { return submitted || !pending.empty(); };
    // Submits the pending text; end_of_doc closes the document (EOS).
    auto emit = [&](bool end_of_doc) {
      if (end_of_doc && o.documents == DocumentSplit::kParagraph) pending = strip_newline(std::move(pending));
      if (end_of_doc && o.documents == DocumentSplit::kSeparator && !submitted && is_blank(pending)) {
        pending.clear();  // nothing but whitespace between two separators
        return;
      }
      submit(Job{std::move(pending), end_of_doc, split});
      pending.clear();
      submitted = !end_of_doc;
    };
    while (reader.next(line, start)) {
      const int line_split = start >= cut ? 1 : 0;
      if (line_split != split) {  // the held-out tail begins: close the document
        if (open()) emit(true);
        split = line_split;
      }
      switch (o.documents) {
        case DocumentSplit::kLine: {
          std::string text = strip_newline(line);
          if (!text.empty()) submit(Job{std::move(text), true, split});
          break;
        }
        case DocumentSplit::kSeparator: {
          size_t from = 0;
          for (size_t at; (at = line.find(o.separator, from)) != std::string::npos;
               from = at + o.separator.size()) {
            pending.append(line, from, at - from);
            if (open()) emit(true);
          }
          pending.append(line, from);
          if (pending.size() >= kChunkBytes) emit(false);
          break;
        }
        case DocumentSplit::kParagraph:
          if (is_blank(line)) {
            if (open()) emit(true);
            break;
          }
          [[fallthrough]];
        case DocumentSplit::kFile:
          pending += line;
          if (pending.size() >= kChunkBytes) emit(false);
          break;
      }
    }
    if (open()) emit(true);
  }
  if (!batch.empty()) run_batch();
  streams[0].finish();
  streams[1].finish();
  summary.train_tokens = streams[0].total();
  summary.val_tokens = streams[1].total();
  if (summary.train_tokens == 0) {
    throw Error(fmt::format("prepare: the input gave no training tokens ({} bytes of text)",
                            summary.input_bytes));
  }
  if (o.val_fraction > 0 && summary.val_tokens == 0) {
    log_warn("prepare: --val-fraction {} held out no text (inputs too small); no validation shards",
             o.val_fraction);
  }
  for (const std::string& name : streams[0].files()) summary.train_shards.push_back((fs::path(o.out_dir) / name).string());
  for (const std::string& name : streams[1].files()) summary.val_shards.push_back((fs::path(o.out_dir) / name).string());

  // --- meta.json (last: its presence marks a complete folder) ---------------------------------------
  nlohmann::json sources = nlohmann::json::array();
  for (size_t f = 0; f < o.inputs.size(); ++f) {
    sources.push_back({{"path", o.inputs[f]}, {"bytes", file_bytes[f]}});
  }
  const char* docs[] = {"file", "line", "paragraph", "separator"};
  const nlohmann::json meta = {
      {"format", "fourbit-token-shards"},
      {"version", 1},
      {"shard_format", fmt::format("llm.c token shards: 256 int32 header, magic {} version {} "
                                   "(uint16) or magic {} version {} (uint32)", kShardMagicU16,
                                   kShardVersionU16, kShardMagicU32, kShardVersionU32)},
      {"token_width", width_name(summary.width)},
      {"vocab_size", tok->vocab_size()},
      {"tokenizer", summary.tokenizer},
      {"documents", docs[(int)o.documents]},
      {"n_documents", summary.n_documents},
      {"val_fraction", o.val_fraction},
      {"train", {{"tokens", summary.train_tokens}, {"shards", streams[0].files()}}},
      {"val", {{"tokens", summary.val_tokens}, {"shards", streams[1].files()}}},
      {"sources", sources},
  };
  write_file_atomically((fs::path(o.out_dir) / kMetaFile).string(), meta.dump(2) + "\n");
  summary.seconds = seconds_since(t0);
  return summary;
}

std::string PrepareSummary::report() const {
  const auto& t = tokenizer;
  std::string s;
  s += fmt::format("input:     {} bytes of text, {} documents\n", input_bytes, n_documents);
  s += fmt::format("tokenizer: {}{}, vocabulary {} (bos {}, eos {}, end of answer {}){}{}\n",
                   t.value("kind", std::string("?")),
                   t.contains("model_type") ? " " + t["model_type"].get<std::string>() : "",
                   t.value("vocab_size", 0), t.value("bos", -1), t.value("eos", -1),
                   t.value("end_of_answer", -1), t.value("trained", false) ? ", trained" : "",
                   t.contains("file") ? " -> " + (fs::path(out_dir) / t["file"].get<std::string>()).string() : "");
  const double total_tokens = (double)(train_tokens + val_tokens);
  s += fmt::format("train:     {} tokens in {} shard(s) ({})\n", train_tokens, train_shards.size(),
                   width_name(width));
  s += fmt::format("val:       {} tokens in {} shard(s)\n", val_tokens, val_shards.size());
  s += fmt::format("           {:.2f} bytes per token; {}/meta.json; {:.1f} s (tokenizer {:.1f} s)\n",
                   total_tokens > 0 ? (double)input_bytes / total_tokens : 0.0, out_dir, seconds,
                   tokenizer_seconds);
  return s;
}

DatasetInfo read_dataset(const std::string& dir) {
  const fs::path meta_path = fs::path(dir) / kMetaFile;
  std::ifstream in(meta_path);
  if (!in) {
    throw Error(fmt::format("'{}' has no {}: not a prepared dataset (make one with `fourbit "
                            "prepare`)", dir, kMetaFile));
  }
  DatasetInfo info;
  info.dir = dir;
  try {
    info.meta = nlohmann::json::parse(in);
    if (info.meta.at("format") != "fourbit-token-shards" || info.meta.at("version") != 1) {
      throw Error(fmt::format("{}: not a fourbit dataset description (version 1)", meta_path.string()));
    }
    info.vocab_size = info.meta.at("vocab_size").get<int64_t>();
    for (const auto& name : info.meta.at("train").at("shards")) {
      info.train_shards.push_back((fs::path(dir) / name.get<std::string>()).string());
    }
    for (const auto& name : info.meta.at("val").at("shards")) {
      info.val_shards.push_back((fs::path(dir) / name.get<std::string>()).string());
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed: {}", meta_path.string(), e.what()));
  }
  return info;
}

std::unique_ptr<Tokenizer> load_dataset_tokenizer(const DatasetInfo& dataset) {
  const nlohmann::json& t = dataset.meta.at("tokenizer");
  const std::string kind = t.value("kind", std::string());
  std::unique_ptr<Tokenizer> tok;
  if (kind == "byte-level") {
    tok = make_byte_tokenizer();
  } else if (kind == "sentencepiece") {
    tok = load_sentencepiece((fs::path(dataset.dir) / t.value("file", std::string(kTokenizerFile))).string());
  } else {
    throw Error(fmt::format("{}/meta.json: unknown tokenizer kind '{}'", dataset.dir, kind));
  }
  if (tok->vocab_size() != dataset.vocab_size) {
    throw Error(fmt::format("{}: the tokenizer has {} tokens but meta.json says {}: the folder was "
                            "modified; prepare it again", dataset.dir, tok->vocab_size(),
                            dataset.vocab_size));
  }
  return tok;
}

}  // namespace fourbit::io
