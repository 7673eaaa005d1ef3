// train/checkpoint.h: save/load round trip (parameters and moments bitwise, step, state), the
// files' layout (names and shapes of the parameter table), a crash at every stage of a save
// leaving the previous checkpoint intact and loadable, refusal of a mismatching model config or
// recipe naming the field, and load_model_from_checkpoint.
#include "train/checkpoint.h"

#include "io/safetensors.h"
#include "model_test_util.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

namespace fourbit::train {
namespace {

namespace fs = std::filesystem;
using model::testing::make_batch;
using model::testing::resolved;
using model::testing::small_dense;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / fmt::format("fourbit_ckpt_{}_{}", ::getpid(), name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<uint8_t> bytes_of(const TensorView& v) {
  std::vector<uint8_t> out((size_t)v.nbytes());
  std::memcpy(out.data(), v.data, out.size());
  return out;
}

// One training step on a fixed batch.
void train_step(model::Model& m, AdamW& opt, uint64_t seed) {
  model::testing::Batch b = make_batch(2, 8, m.config().vocab, seed);
  m.zero_grads();
  m.forward(b.tokens, b.targets);
  m.backward();
  ASSERT_TRUE(opt.step(1e-2).applied);
}

CheckpointState some_state(int64_t step) {
  CheckpointState s;
  s.step = step;
  s.tokens_seen = 16 * step;
  s.train = {{"batch_size", 2}, {"seq_len", 8}};
  s.rng = {{"generator", "philox4x32-10"}, {"seed", 5}};
  s.data = {{"document", 3}, {"offset", 17}};
  s.metrics = {{"last_loss", 1.5}};
  return s;
}

TEST(Checkpoint, RoundTripAndLayout) {
  const std::string root = temp_dir("roundtrip");
  const model::ModelConfig c = small_dense(false);
  model::Model m(c, resolved(c), model::ModelOptions{.max_batch = 2});
  AdamW opt(m, {});
  train_step(m, opt, 1);
  train_step(m, opt, 2);
  const std::string dir = root + "/ckpt";
  save_checkpoint(dir, m, &opt, some_state(2));

  // Layout: tensor names and shapes of the table, F32.
  const io::SafetensorsFile f = io::SafetensorsFile::open(dir + "/model.safetensors");
  ASSERT_EQ((int)f.tensors().size(), m.table().size());
  for (const model::ParamSpec& s : m.table().rows()) {
    const io::StTensor& t = f.get(s.name);
    EXPECT_EQ(t.dtype, io::StDType::kF32);
    ASSERT_EQ((int)t.shape.size(), s.shape.ndim) << s.name;
    for (int d = 0; d < s.shape.ndim; ++d) EXPECT_EQ(t.shape[(size_t)d], s.shape[d]) << s.name;
  }
  const io::SafetensorsFile o = io::SafetensorsFile::open(dir + "/optimizer.safetensors");
  EXPECT_TRUE(o.contains("blocks.0.attn.qkv.weight.exp_avg"));
  EXPECT_TRUE(o.contains("lm_head.weight.exp_avg_sq"));
  EXPECT_FALSE(fs::exists(dir + ".tmp-" + std::to_string(::getpid())));

  model::Model m2(c, resolved(c), model::ModelOptions{.seed = 99, .max_batch = 2});
  AdamW opt2(m2, {});
  const CheckpointInfo info = load_checkpoint(dir, m2, &opt2);
  EXPECT_EQ(info.state.step, 2);
  EXPECT_EQ(info.state.tokens_seen, 32);
  EXPECT_EQ(info.state.data["offset"], 17);
  EXPECT_EQ(info.config, c);
  EXPECT_EQ(opt2.steps(), 2);
  EXPECT_EQ(bytes_of(m2.params().flat()), bytes_of(m.params().flat()));
  EXPECT_EQ(bytes_of(opt2.exp_avg().flat()), bytes_of(opt.exp_avg().flat()));
  EXPECT_EQ(bytes_of(opt2.exp_avg_sq().flat()), bytes_of(opt.exp_avg_sq().flat()));
  // The next step is identical.
  train_step(m, opt, 3);
  train_step(m2, opt2, 3);
  EXPECT_EQ(bytes_of(m2.params().flat()), bytes_of(m.params().flat()));

  std::unique_ptr<model::Model> m3 = load_model_from_checkpoint(dir, Device::kCpu);
  EXPECT_EQ(m3->config(), c);
  fs::remove_all(root);
}

// The interrupted-save tests' starting point: a model one step in, saved to ROOT/ckpt as step 1,
// then stepped once more so that its live state differs from the checkpoint.
struct SavedThenStepped {
  explicit SavedThenStepped(const std::string& root) : dir(root + "/ckpt") {
    train_step(m, opt, 1);
    save_checkpoint(dir, m, &opt, some_state(1));
    saved = bytes_of(m.params().flat());
    train_step(m, opt, 2);
  }
  // A fresh model loads the step-1 save, bit for bit.
  void expect_first_save_loads(const std::string& stage) const {
    model::Model r(c, resolved(c), model::ModelOptions{.max_batch = 2});
    AdamW ropt(r, {});
    const CheckpointInfo info = load_checkpoint(dir, r, &ropt);
    EXPECT_EQ(info.state.step, 1) << stage;
    EXPECT_EQ(ropt.steps(), 1) << stage;
    EXPECT_EQ(bytes_of(r.params().flat()), saved) << stage;
  }
  const model::ModelConfig c = small_dense();
  model::Model m{c, resolved(c), model::ModelOptions{.max_batch = 2}};
  AdamW opt{m, {}};
  const std::string dir;
  std::vector<uint8_t> saved;
};

TEST(Checkpoint, CrashMidSaveKeepsPreviousCheckpoint) {
  const std::string root = temp_dir("crash");
  SavedThenStepped f(root);
  const std::string& dir = f.dir;
  model::Model& m = f.m;
  AdamW& opt = f.opt;
  for (const char* stage : {"model.safetensors", "optimizer.safetensors", "state.json", "swap"}) {
    SaveOptions crash;
    crash.hook = [&](std::string_view s) {
      if (s == stage) throw std::runtime_error(fmt::format("simulated crash at {}", s));
    };
    EXPECT_THROW(save_checkpoint(dir, m, &opt, some_state(2), crash), std::runtime_error) << stage;
    f.expect_first_save_loads(stage);
    EXPECT_FALSE(fs::exists(dir + ".tmp-" + std::to_string(::getpid()))) << stage;
  }
  // A completed save replaces it.
  save_checkpoint(dir, m, &opt, some_state(2));
  EXPECT_EQ(read_checkpoint_info(dir).state.step, 2);
  // A stale temporary directory of a killed save (e.g. another pid) does not disturb loading.
  fs::create_directories(dir + ".tmp-1");
  EXPECT_EQ(read_checkpoint_info(dir).state.step, 2);
  fs::remove_all(root);
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    FAIL() << "no error";
  } catch (const Error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\nlacks " << n;
  }
}

TEST(Checkpoint, RefusesMismatchNamingTheField) {
  const std::string root = temp_dir("mismatch");
  const model::ModelConfig c = small_dense();
  model::Model m(c, resolved(c), model::ModelOptions{.max_batch = 2});
  AdamW opt(m, {});
  const std::string dir = root + "/ckpt";
  save_checkpoint(dir, m, &opt, some_state(0));

  model::ModelConfig wider = c;
  wider.d_ff = 32;
  model::Model m2(wider, resolved(wider), {});
  expect_error([&] { load_checkpoint(dir, m2, nullptr); }, {"d_ff", "24", "32", dir});

  model::Model m3(c, resolved(c, "fp8"), {});
  expect_error([&] { load_checkpoint(dir, m3, nullptr); }, {"recipe", dir});

  model::Model m4(c, resolved(c), {});
  AdamW opt4(m4, AdamWConfig{.weight_decay = 0.5});
  expect_error([&] { load_checkpoint(dir, m4, &opt4); }, {"weight_decay"});

  expect_error([&] { read_checkpoint_info(root + "/nothing"); }, {"nothing", "does not exist"});
  fs::remove_all(root);
}

TEST(Checkpoint, JsonDifferenceNamesPath) {
  nlohmann::json a = {{"x", 1}, {"y", {{"z", {1, 2}}}}};
  nlohmann::json b = a;
  EXPECT_FALSE(first_json_difference(a, b).has_value());
  b["y"]["z"][1] = 3;
  EXPECT_EQ(*first_json_difference(a, b), "y.z[1]: 2 vs 3");
  b = a;
  b["w"] = true;
  EXPECT_EQ(*first_json_difference(a, b), "w: (absent) vs true");
}

TEST(Checkpoint, ProcessKilledMidSaveKeepsPreviousCheckpoint) {
  // A real crash: a child process dies (_exit, no unwinding, no clean-up) at each stage of a save
  // over an existing checkpoint; the parent then loads the previous checkpoint intact, and its own
  // next save succeeds despite the child's stale temporary directory.
  const std::string root = temp_dir("killed");
  SavedThenStepped f(root);
  const std::string& dir = f.dir;
  model::Model& m = f.m;
  AdamW& opt = f.opt;
  for (const char* stage : {"model.safetensors", "optimizer.safetensors", "state.json", "swap"}) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      SaveOptions die;
      die.hook = [&](std::string_view s) {
        if (s == stage) ::_exit(0);
      };
      save_checkpoint(dir, m, &opt, some_state(2), die);
      ::_exit(3);  // not reached when the hook fires
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << stage;
    EXPECT_TRUE(fs::exists(fmt::format("{}.tmp-{}", dir, pid))) << "the crash left its temp dir";
    f.expect_first_save_loads(stage);
  }
  fs::create_directories(dir + ".tmp-1");  // pid 1 (init) is alive: not ours to remove
  save_checkpoint(dir, m, &opt, some_state(2));
  EXPECT_EQ(read_checkpoint_info(dir).state.step, 2);
  // The dead children's temporary directories are gone; the live process' one stays.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(root)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt", "ckpt.tmp-1"}));
  fs::remove_all(root);
}

}  // namespace
}  // namespace fourbit::train
