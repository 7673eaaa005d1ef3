// `fourbit sample`: generate completions of a text prompt with the RL sampler (rl/sampler.h):
// byte-level tokens (rl/byte_tokens.h; the prompt follows an end-of-document token, as in the
// corpus), the checkpoint's rl_sampler precision (or --sampler-recipe), temperature / top-p /
// top-k, stop tokens and a length limit. Prints each completion with its token count, summed
// log-probability and whether a stop token ended it.
#include "cli/commands.h"
#include "cli/run_rl_stage.h"
#include "core/check.h"
#include "core/log.h"
#include "model/config.h"
#include "rl/byte_tokens.h"
#include "rl/rl_trainer.h"
#include "rl/sampler.h"
#include "train/checkpoint.h"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

namespace fourbit::cli {

namespace {

struct SampleArgs {
  std::string ckpt;
  std::string preset = "tiny";
  std::string prompt;
  std::string sampler_recipe = "recipe";
  std::string device = "auto";
  std::string stop = "newline";
  rl::SamplingOptions sampling;
  int n = 4;
  uint64_t init_seed = 0;
  std::string csv;
  bool quiet = false;
};

// Printable form of a completion: bytes as text, other tokens as <id> (end of document:
// <|endoftext|>), newlines as \n.
std::string printable(const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) {
    if (t == rl::kEndOfDocumentToken) {
      s += rl::kEndOfDocumentText;
    } else if (t == '\n') {
      s += "\\n";
    } else if (t >= 32 && t < 127) {
      s.push_back((char)t);
    } else {
      s += fmt::format("<{}>", t);
    }
  }
  return s;
}

void run_sample(SampleArgs& a) {
  const Device device = parse_rl_device(a.device);
  std::unique_ptr<model::Model> loaded;
  model::ModelConfig config;
  recipe::Recipe r;
  if (!a.ckpt.empty()) {
    FOURBIT_CHECK(std::filesystem::exists(a.ckpt), "sample: --ckpt '{}' does not exist", a.ckpt);
    loaded = train::load_model_from_checkpoint(a.ckpt, device);
    config = loaded->config();
    r = loaded->recipe().recipe();
  } else {
    log_info("sample: no --ckpt: a fresh, untrained '{}' model (random text)", a.preset);
    config = model::preset(a.preset);
    if (config.vocab < rl::kByteVocabSize) config.vocab = 384;
    r = recipe::preset("e2e4");
  }
  FOURBIT_CHECK(config.vocab >= rl::kByteVocabSize, "sample: the model's vocabulary ({}) has no byte-level "
                "end-of-document token; a byte-level model needs vocab >= {}", config.vocab, rl::kByteVocabSize);
  FOURBIT_CHECK(!a.prompt.empty(), "sample: --prompt is empty");
  r = recipe::with_sampler_precision(std::move(r), a.sampler_recipe);
  if (a.stop == "newline") {
    a.sampling.stop_tokens = {'\n', rl::kEndOfDocumentToken};
  } else if (a.stop == "eod") {
    a.sampling.stop_tokens = {rl::kEndOfDocumentToken};
  } else {
    FOURBIT_CHECK(a.stop == "none", "sample: --stop '{}': use newline, eod or none", a.stop);
  }
  FOURBIT_CHECK(a.n >= 1, "sample: --n must be >= 1, got {}", a.n);
  std::vector<int32_t> prompt{rl::kEndOfDocumentToken};
  for (char ch : a.prompt) prompt.push_back((int32_t)(unsigned char)ch);
  const int max_len = std::min(config.max_seq, (int)prompt.size() + a.sampling.max_new_tokens);
  FOURBIT_CHECK((int)prompt.size() < max_len, "sample: the prompt ({} tokens) leaves no room in max_seq {}",
                prompt.size(), config.max_seq);
  rl::SamplerOptions so;
  so.device = device;
  so.max_batch = a.n;
  so.max_len = max_len;
  const std::string recipe_name = r.name;
  rl::Sampler sampler(config, recipe::resolve(r, config.recipe_shape()), so);
  if (loaded) {
    sampler.refresh(*loaded);
  } else {
    model::ModelOptions mo;
    mo.device = device;
    mo.seed = a.init_seed;
    model::Model fresh(config, recipe::resolve(r, config.recipe_shape()), mo);
    sampler.refresh(fresh);
  }
  const std::vector<std::vector<int32_t>> prompts((size_t)a.n, prompt);
  const std::vector<rl::Rollout> out = sampler.generate(prompts, a.sampling, 0);
  std::printf("model '%s', recipe '%s' (rl_sampler stage), device %s, temperature %g, top_p %g, top_k %d\n",
              config.name.c_str(), recipe_name.c_str(), std::string(device_name(device)).c_str(),
              a.sampling.temperature, a.sampling.top_p, a.sampling.top_k);
  for (size_t i = 0; i < (a.quiet ? 0 : out.size()); ++i) {
    double lp = 0;
    for (float x : out[i].logprobs) lp += x;
    std::printf("[%zu] %s%s  (%zu tokens, logprob %.3f%s)\n", i, a.prompt.c_str(), printable(out[i].tokens).c_str(),
                out[i].tokens.size(), lp, out[i].stopped ? ", stopped" : "");
  }
  const rl::SamplerStats& st = sampler.last_stats();
  std::printf("%lld tokens in %.3f s: %.0f tokens/s (%d decode steps, batch %lld; %d of %d passes on the decode "
              "GEMV)\n", (long long)st.generated_tokens, st.seconds, st.tokens_per_second(), st.decode_steps,
              (long long)st.sequences, st.fast_passes, st.prefill_passes + st.decode_steps);
  if (!a.csv.empty()) {
    std::FILE* f = std::fopen(a.csv.c_str(), "w");
    FOURBIT_CHECK(f != nullptr, "sample: cannot write --csv '{}'", a.csv);
    std::fprintf(f, "model,recipe,device,batch,prompt_tokens,generated_tokens,decode_steps,seconds,tokens_per_s\n");
    std::fprintf(f, "%s,%s,%s,%lld,%lld,%lld,%d,%.6f,%.1f\n", config.name.c_str(), recipe_name.c_str(),
                 std::string(device_name(device)).c_str(), (long long)st.sequences, (long long)st.prompt_tokens,
                 (long long)st.generated_tokens, st.decode_steps, st.seconds, st.tokens_per_second());
    std::fclose(f);
  }
}

}  // namespace

Command add_sample_command(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  a->sampling.max_new_tokens = 64;
  CLI::App* sub = app.add_subcommand("sample", "Generate completions of a prompt with the RL sampler");
  sub->add_option("--ckpt", a->ckpt, "checkpoint directory (default: a fresh, untrained model)");
  sub->add_option("--preset", a->preset, "fresh model preset (without --ckpt)")->capture_default_str();
  sub->add_option("--prompt,-p", a->prompt, "prompt text (byte-level tokens)")->required();
  sub->add_option("--n", a->n, "completions")->capture_default_str();
  sub->add_option("--temperature", a->sampling.temperature, "0: greedy")->capture_default_str();
  sub->add_option("--top-p", a->sampling.top_p)->capture_default_str();
  sub->add_option("--top-k", a->sampling.top_k, "0: every token")->capture_default_str();
  sub->add_option("--max-new-tokens", a->sampling.max_new_tokens)->capture_default_str();
  sub->add_option("--stop", a->stop, "newline (and end of document), eod, or none")->capture_default_str();
  sub->add_option("--seed", a->sampling.seed)->capture_default_str();
  sub->add_option("--sampler-recipe", a->sampler_recipe, "bf16, nvfp4, nvfp4-tensor-amax, nvfp4-weights, or recipe (the checkpoint's rl_sampler)")
      ->capture_default_str();
  sub->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str();
  sub->add_option("--init-seed", a->init_seed, "fresh model seed")->capture_default_str();
  sub->add_option("--csv", a->csv, "write the throughput as one CSV row here");
  sub->add_flag("--quiet,-q", a->quiet, "print only the throughput line, not the completions");
  return {sub, [a] { run_sample(*a); }};
}

}  // namespace fourbit::cli
