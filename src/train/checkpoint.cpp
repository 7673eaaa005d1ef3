// Checkpoint directories: write to DIR.tmp-<pid>, fsync, swap atomically with DIR (checkpoint.h).
#include "train/checkpoint.h"

#include "core/check.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/config.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fourbit::train {
namespace fs = std::filesystem;

namespace {

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) {
    throw Error(fmt::format("checkpoint: cannot open '{}' to fsync it: {}", path,
                            std::strerror(errno)));
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL): the rename is then as durable as they get.
  if (rc != 0 && !(directory && (err == EINVAL || err == EROFS))) {
    throw Error(fmt::format("checkpoint: fsync of '{}' failed: {}", path, std::strerror(err)));
  }
}

std::string parent_of(const std::string& dir) {
  fs::path p = fs::absolute(fs::path(dir)).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "a/b/" -> "a/b"
  return p.parent_path().string();
}

std::string strip_slash(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// A host copy of a parameter-shaped buffer (one copy of the flat buffer, then row views).
model::ParamBuffer host_copy(const model::ParamTable& table, const model::ParamBuffer& b) {
  if (b.device() == Device::kCpu) return b;
  model::ParamBuffer h(table, b.dtype(), Device::kCpu);
  copy_tensor(h.flat(), b.flat());
  return h;
}

// Swaps `fresh` into place as `dir`; the previous `dir` (if any) is removed afterwards.
void swap_into_place(const std::string& fresh, const std::string& dir, const SaveOptions& opt) {
  if (opt.hook) opt.hook("swap");
  const std::string parent = parent_of(dir);
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (::rename(fresh.c_str(), dir.c_str()) != 0) {
      throw Error(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", fresh, dir,
                              std::strerror(errno)));
    }
    fsync_path(parent, true);
    return;
  }
  FOURBIT_CHECK(fs::is_directory(dir, ec),
                "checkpoint: '{}' exists and is not a directory: choose another checkpoint path",
                dir);
#if defined(RENAME_EXCHANGE)
  if (::renameat2(AT_FDCWD, fresh.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_path(parent, true);
    fs::remove_all(fresh, ec);  // now the previous checkpoint
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    throw Error(fmt::format("checkpoint: cannot swap '{}' with '{}': {}", fresh, dir,
                            std::strerror(errno)));
  }
#endif
  const std::string old = fmt::format("{}.old-{}", dir, ::getpid());
  fs::remove_all(old, ec);
  if (::rename(dir.c_str(), old.c_str()) != 0) {
    throw Error(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", dir, old,
                            std::strerror(errno)));
  }
  if (::rename(fresh.c_str(), dir.c_str()) != 0) {
    const int err = errno;
    ::rename(old.c_str(), dir.c_str());  // put the previous one back
    throw Error(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", fresh, dir,
                            std::strerror(err)));
  }
  fsync_path(parent, true);
  fs::remove_all(old, ec);
}

std::string json_brief(const nlohmann::json& j) {
  std::string s = j.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// Where a missing checkpoint directory may have gone: an interrupted fallback swap.
std::string missing_hint(const std::string& dir) {
  const fs::path p = fs::absolute(fs::path(dir)).lexically_normal();
  std::error_code ec;
  const std::string prefix = p.filename().string() + ".old-";
  for (const auto& e : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) {
      return fmt::format(" (a save was interrupted: the previous checkpoint is '{}'; rename it to "
                         "'{}' to use it)",
                         e.path().string(), dir);
    }
  }
  return "";
}

// Removes DIR.tmp-<pid> and DIR.old-<pid> directories left by saves of processes that no longer
// exist (crashed mid-save); those of live processes (another trainer saving now) are left alone.
void remove_stale_siblings(const std::string& dir) {
  const fs::path p = fs::absolute(fs::path(dir)).lexically_normal();
  const std::string name = p.filename().string();
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string n = e.path().filename().string();
    for (const char* tag : {".tmp-", ".old-"}) {
      const std::string prefix = name + tag;
      if (n.size() <= prefix.size() || n.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string digits = n.substr(prefix.size());
      if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) continue;
      const pid_t pid = (pid_t)std::stol(digits);
      if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) stale.push_back(e.path());
    }
  }
  for (const fs::path& s : stale) fs::remove_all(s, ec);
}

}  // namespace

std::optional<std::string> first_json_difference(const nlohmann::json& a, const nlohmann::json& b,
                                                 const std::string& path) {
  const std::string here = path.empty() ? "(root)" : path;
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string sub = path.empty() ? it.key() : path + "." + it.key();
      if (!b.contains(it.key())) return fmt::format("{}: {} vs (absent)", sub, json_brief(*it));
      if (auto d = first_json_difference(*it, b.at(it.key()), sub)) return d;
    }
    for (auto it = b.begin(); it != b.end(); ++it) {
      if (!a.contains(it.key())) {
        const std::string sub = path.empty() ? it.key() : path + "." + it.key();
        return fmt::format("{}: (absent) vs {}", sub, json_brief(*it));
      }
    }
    return std::nullopt;
  }
  if (a.is_array() && b.is_array() && a.size() == b.size()) {
    for (size_t i = 0; i < a.size(); ++i)
      if (auto d = first_json_difference(a[i], b[i], fmt::format("{}[{}]", path, i))) return d;
    return std::nullopt;
  }
  // Numbers: 1 and 1.0 are equal.
  if (a.is_number() && b.is_number()) {
    if (a.get<double>() == b.get<double>()) return std::nullopt;
    return fmt::format("{}: {} vs {}", here, json_brief(a), json_brief(b));
  }
  if (a == b) return std::nullopt;
  return fmt::format("{}: {} vs {}", here, json_brief(a), json_brief(b));
}

void save_checkpoint(const std::string& dir_in, const model::Model& model, const AdamW* optimizer,
                     const CheckpointState& state, const SaveOptions& options) {
  const std::string dir = strip_slash(dir_in);
  FOURBIT_CHECK(!dir.empty(), "save_checkpoint: empty checkpoint directory name");
  std::error_code ec;
  const std::string parent = parent_of(dir);
  fs::create_directories(parent, ec);
  FOURBIT_CHECK(!ec, "checkpoint: cannot create the directory '{}': {}", parent, ec.message());
  const std::string tmp = fmt::format("{}.tmp-{}", dir, ::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  FOURBIT_CHECK(!ec, "checkpoint: cannot create '{}': {}", tmp, ec.message());
  try {
    const model::ParamTable& table = model.table();
    // model.safetensors
    {
      const model::ParamBuffer params = host_copy(table, model.params());
      io::SafetensorsWriter w;
      for (int i = 0; i < table.size(); ++i) w.add(table.row(i).name, params.view(i));
      w.set_metadata("format", std::string(kCheckpointFormat));
      w.write(tmp + "/model.safetensors");
      if (options.hook) options.hook("model.safetensors");
    }
    // optimizer.safetensors
    if (optimizer != nullptr) {
      const model::ParamBuffer m = host_copy(table, optimizer->exp_avg());
      const model::ParamBuffer v = host_copy(table, optimizer->exp_avg_sq());
      io::SafetensorsWriter w;
      for (int i = 0; i < table.size(); ++i) {
        if (!table.row(i).trainable) continue;
        w.add(table.row(i).name + ".exp_avg", m.view(i));
        w.add(table.row(i).name + ".exp_avg_sq", v.view(i));
      }
      w.set_metadata("format", std::string(kCheckpointFormat));
      w.set_metadata("step", std::to_string(optimizer->steps()));
      w.write(tmp + "/optimizer.safetensors");
      if (options.hook) options.hook("optimizer.safetensors");
    }
    // state.json
    nlohmann::json j;
    j["format"] = std::string(kCheckpointFormat);
    j["model"] = model::to_json(model.config());
    j["recipe"] = recipe::to_json(model.recipe());
    j["optimizer"] = optimizer ? to_json(optimizer->config()) : nlohmann::json(nullptr);
    j["optimizer_steps"] = optimizer ? optimizer->steps() : 0;
    j["step"] = state.step;
    j["tokens_seen"] = state.tokens_seen;
    j["train"] = state.train;
    j["rng"] = state.rng;
    j["data"] = state.data;
    j["metrics"] = state.metrics;
    io::write_file_atomically(tmp + "/state.json", j.dump(2) + "\n");
    if (options.hook) options.hook("state.json");
    fsync_path(tmp, true);
    swap_into_place(tmp, dir, options);
    remove_stale_siblings(dir);
  } catch (...) {
    // The previous checkpoint at `dir` is untouched; drop the partial new one.
    fs::remove_all(tmp, ec);
    throw;
  }
}

CheckpointInfo read_checkpoint_info(const std::string& dir_in) {
  const std::string dir = strip_slash(dir_in);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw Error(fmt::format("checkpoint '{}' does not exist or is not a directory{}", dir,
                            missing_hint(dir)));
  }
  const std::string path = dir + "/state.json";
  std::ifstream in(path);
  FOURBIT_CHECK(in.good(), "checkpoint '{}': cannot read state.json ({}): not a fourbit "
                "checkpoint directory?", dir, path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("checkpoint '{}': state.json is not valid JSON: {}", dir, e.what()));
  }
  FOURBIT_CHECK(j.is_object() && j.contains("format") && j["format"] == kCheckpointFormat,
                "checkpoint '{}': state.json has format {} but this fourbit reads \"{}\"", dir,
                j.is_object() && j.contains("format") ? j["format"].dump() : "(none)",
                kCheckpointFormat);
  CheckpointInfo info;
  info.dir = dir;
  try {
    info.config = model::config_from_json(j.at("model"));
    info.recipe = recipe::resolved_from_json(j.at("recipe"));
    if (!j.at("optimizer").is_null()) info.optimizer = adamw_config_from_json(j.at("optimizer"));
    info.state.step = j.at("step").get<int64_t>();
    info.state.tokens_seen = j.at("tokens_seen").get<int64_t>();
    info.state.train = j.at("train");
    info.state.rng = j.at("rng");
    info.state.data = j.at("data");
    info.state.metrics = j.at("metrics");
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("checkpoint '{}': state.json is missing a field or has a wrong type: "
                            "{}",
                            dir, e.what()));
  }
  return info;
}

namespace {

void load_params(const CheckpointInfo& info, model::Model& model) {
  const io::SafetensorsFile f = io::SafetensorsFile::open(info.dir + "/model.safetensors");
  const model::ParamTable& table = model.table();
  for (int i = 0; i < table.size(); ++i) {
    const std::string& name = table.row(i).name;
    FOURBIT_CHECK(f.contains(name), "checkpoint '{}': model.safetensors has no tensor '{}'",
                  info.dir, name);
    f.copy_into(name, model.params().view(i));
  }
  FOURBIT_CHECK((int)f.tensors().size() == table.size(),
                "checkpoint '{}': model.safetensors holds {} tensors but the model has {}",
                info.dir, f.tensors().size(), table.size());
  model.params_changed();
}

}  // namespace

CheckpointInfo load_checkpoint(const std::string& dir, model::Model& model, AdamW* optimizer) {
  CheckpointInfo info = read_checkpoint_info(dir);
  if (auto d = first_json_difference(model::to_json(info.config), model::to_json(model.config()))) {
    throw Error(fmt::format("checkpoint '{}' does not match this run's model config: {} "
                            "(checkpoint vs this run); use the checkpoint's settings or start a "
                            "new run directory",
                            info.dir, *d));
  }
  if (auto d = first_json_difference(recipe::to_json(info.recipe), recipe::to_json(model.recipe()))) {
    throw Error(fmt::format("checkpoint '{}' does not match this run's recipe: {} (checkpoint vs "
                            "this run); use the checkpoint's recipe or start a new run directory",
                            info.dir, *d));
  }
  if (optimizer != nullptr) {
    FOURBIT_CHECK(info.optimizer.has_value(),
                  "checkpoint '{}' was saved without optimizer state: it cannot resume training "
                  "(load it with load_model_from_checkpoint to start a new run from its weights)",
                  info.dir);
    if (auto d = first_json_difference(to_json(*info.optimizer), to_json(optimizer->config()))) {
      throw Error(fmt::format("checkpoint '{}' does not match this run's optimizer config: {} "
                              "(checkpoint vs this run)",
                              info.dir, *d));
    }
  }
  load_params(info, model);
  if (optimizer != nullptr) {
    const io::SafetensorsFile f = io::SafetensorsFile::open(info.dir + "/optimizer.safetensors");
    const model::ParamTable& table = model.table();
    for (int i = 0; i < table.size(); ++i) {
      if (!table.row(i).trainable) continue;
      f.copy_into(table.row(i).name + ".exp_avg", optimizer->exp_avg().view(i));
      f.copy_into(table.row(i).name + ".exp_avg_sq", optimizer->exp_avg_sq().view(i));
    }
    const auto it = f.metadata().find("step");
    FOURBIT_CHECK(it != f.metadata().end(),
                  "checkpoint '{}': optimizer.safetensors has no 'step' metadata", info.dir);
    optimizer->set_steps(std::stoll(it->second));
  }
  return info;
}

std::unique_ptr<model::Model> load_model_from_checkpoint(const std::string& dir, Device device,
                                                         model::ModelOptions options) {
  const CheckpointInfo info = read_checkpoint_info(dir);
  options.device = device;
  auto model = std::make_unique<model::Model>(info.config, info.recipe, options);
  load_params(info, *model);
  return model;
}

}  // namespace fourbit::train
