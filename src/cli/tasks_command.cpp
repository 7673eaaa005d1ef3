// `fourbit tasks`: print examples of a verifiable task (prompt and reference answer) and
// `fourbit corpus`: print or write a sample of the built-in synthetic pretraining corpus, or
// measure it (--stats: document mixture, bytes per kind, generation speed).
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "rl/synthetic_corpus.h"
#include "rl/task.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>

namespace fourbit::cli {

namespace {

struct TasksArgs {
  std::string spec = "add";
  int64_t n = 5;
  uint64_t seed = 1;
  uint64_t start = 0;
  bool text = false;
  bool list = false;
};

// C-style quoting so that spaces and the '\n' end marker stay visible.
std::string escaped(std::string_view s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '\n') {
      q += "\\n";
    } else if (c == '"' || c == '\\') {
      q += '\\';
      q += c;
    } else {
      q += c;
    }
  }
  return q + "\"";
}

void run_tasks(const TasksArgs& a) {
  if (a.list) {
    std::fputs(rl::describe_tasks().c_str(), stdout);
    return;
  }
  const std::unique_ptr<rl::Task> task = rl::make_task(a.spec);
  if (!a.text) std::printf("# %s, seed %llu\n", task->spec().c_str(), (unsigned long long)a.seed);
  rl::Example e;
  for (int64_t i = 0; i < a.n; ++i) {
    task->make_example(a.seed, a.start + (uint64_t)i, e);
    if (a.text) {
      std::fputs(e.text().c_str(), stdout);
    } else {
      std::printf("%-6llu %-36s %s\n", (unsigned long long)(a.start + i), escaped(e.prompt).c_str(),
                  escaped(e.answer + rl::kEndOfAnswer).c_str());
    }
  }
}

struct CorpusArgs {
  uint64_t bytes = 4096;
  uint64_t seed = 0;
  std::string split = "train";
  uint64_t first = 0;
  std::string output_path;
  bool stats = false;
};

void run_corpus(const CorpusArgs& a) {
  rl::CorpusOptions options;
  options.seed = a.seed;
  const rl::SyntheticCorpus corpus(options);
  const rl::CorpusSplit split = a.split == "validation" ? rl::CorpusSplit::kValidation : rl::CorpusSplit::kTrain;
  if (a.stats) {
    uint64_t docs[rl::kDocumentKindCount] = {}, bytes[rl::kDocumentKindCount] = {}, total = 0;
    std::string doc;
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t i = a.first;
    for (; total < a.bytes; ++i) {
      const int k = (int)corpus.document(split, i, doc);
      ++docs[k];
      bytes[k] += doc.size() + 1;  // + its end-of-document token
      total += doc.size() + 1;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const uint64_t n_docs = i - a.first;
    std::printf("synthetic corpus, seed %llu, %s split: %llu documents, %llu tokens, %.1f tokens "
                "per document\n",
                (unsigned long long)a.seed, a.split.c_str(), (unsigned long long)n_docs,
                (unsigned long long)total, (double)total / (double)n_docs);
    std::printf("%-10s %10s %10s %10s\n", "kind", "weight", "documents", "tokens");
    double weight_sum = 0;
    for (double w : options.weights) weight_sum += w;
    for (int k = 0; k < rl::kDocumentKindCount; ++k) {
      std::printf("%-10s %10.3f %9.1f%% %9.1f%%\n",
                  std::string(rl::document_kind_name((rl::DocumentKind)k)).c_str(),
                  options.weights[k] / weight_sum, 100.0 * (double)docs[k] / (double)n_docs,
                  100.0 * (double)bytes[k] / (double)total);
    }
    std::printf("task documents teach: %s\n", fmt::format("{}", fmt::join(corpus.options().task_specs, " ")).c_str());
    std::printf("generation: %.1f MB/s on one core (%.3f s)\n", (double)total / s / 1e6, s);
    return;
  }
  const std::string text = corpus.text(split, a.bytes, a.first);
  if (a.output_path.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  std::ofstream f(a.output_path, std::ios::binary);
  FOURBIT_CHECK(f.good(), "cannot write '{}'", a.output_path);
  f.write(text.data(), (std::streamsize)text.size());
  FOURBIT_CHECK(f.good(), "failed writing '{}'", a.output_path);
  log_info("wrote {} bytes of the {} split to {}", text.size(), a.split, a.output_path);
}

}  // namespace

Command add_tasks_command(CLI::App& app) {
  auto args = std::make_shared<TasksArgs>();
  CLI::App* sub = app.add_subcommand(
      "tasks", "Print examples of a verifiable RL task: prompt and reference answer (the answer "
               "ends with the end-of-answer marker \\n)");
  sub->add_option("--task", args->spec,
                  "task spec: name or name:key=value,... (e.g. add:digits=3; --list shows them)")
      ->capture_default_str();
  sub->add_option("--n", args->n, "how many examples")->capture_default_str()->check(CLI::NonNegativeNumber);
  sub->add_option("--seed", args->seed, "seed of the example sequence")->capture_default_str();
  sub->add_option("--start", args->start, "index of the first example")->capture_default_str();
  sub->add_flag("--text", args->text, "print each example's text exactly as the corpus writes it");
  sub->add_flag("--list", args->list, "describe every task, its options and its easy spec, and exit");
  return {sub, [args] { run_tasks(*args); }};
}

Command add_corpus_command(CLI::App& app) {
  auto args = std::make_shared<CorpusArgs>();
  CLI::App* sub = app.add_subcommand(
      "corpus", "Print a sample of the built-in synthetic pretraining corpus (documents separated "
                "by <|endoftext|>), or measure it with --stats");
  sub->add_option("--bytes", args->bytes, "at least this many bytes (whole documents)")->capture_default_str();
  sub->add_option("--seed", args->seed, "corpus seed")->capture_default_str();
  sub->add_option("--split", args->split, "train or validation (held-out streams)")
      ->capture_default_str()
      ->check(CLI::IsMember({"train", "validation"}));
  sub->add_option("--first", args->first, "index of the first document")->capture_default_str();
  sub->add_option("--output", args->output_path, "write to this file instead of stdout");
  sub->add_flag("--stats", args->stats,
                "instead of the text: the mixture (documents and tokens per kind) and the "
                "generation speed over --bytes");
  return {sub, [args] { run_corpus(*args); }};
}

}  // namespace fourbit::cli
