// The process launcher and the file rendezvous of the NCCL unique id (launcher.h).
#include "dist/launcher.h"

#include "core/check.h"
#include "core/log.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace fourbit::dist {

namespace {

std::vector<pid_t> g_children;  // the launcher's children, for the SIGTERM forwarder
constexpr int kKillAfterSeconds = 60;

extern "C" void forward_sigterm(int) {
  for (pid_t p : g_children) ::kill(p, SIGTERM);
}

}  // namespace

void publish_file(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  FOURBIT_CHECK(fd >= 0, "cannot create '{}': {}", tmp, std::strerror(errno));
  const ssize_t written = ::write(fd, bytes.data(), bytes.size());
  const bool ok = written == (ssize_t)bytes.size() && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  FOURBIT_CHECK(ok, "cannot write '{}': {}", tmp, std::strerror(err));
  FOURBIT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '{}' to '{}': {}", tmp,
                path, std::strerror(errno));
}

std::string wait_for_file(const std::string& path, size_t size, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in.good()) {
      std::stringstream ss;
      ss << in.rdbuf();
      std::string s = ss.str();
      FOURBIT_CHECK(s.size() == size,
                    "'{}' holds {} bytes, expected {}: a stale file of another run? remove it",
                    path, s.size(), size);
      return s;
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    FOURBIT_CHECK(waited < timeout_s,
                  "waited {:.0f} s for '{}' (rank 0 publishes it): did rank 0 start and reach "
                  "its communicator? (FOURBIT_NCCL_ID_FILE must be on a file system every rank "
                  "sees)",
                  waited, path);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int launch(int n, const std::string& program, const std::vector<std::string>& args) {
  FOURBIT_CHECK(n >= 1, "fourbit launch: -n must be >= 1, got {}", n);
  FOURBIT_CHECK(!args.empty() || !program.empty(), "fourbit launch: no command to run");
  char dir_template[] = "/tmp/fourbit-launch-XXXXXX";
  FOURBIT_CHECK(::mkdtemp(dir_template) != nullptr, "fourbit launch: cannot create a temporary "
                "folder in /tmp: {}", std::strerror(errno));
  const std::string dir = dir_template;
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  g_children.clear();
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    FOURBIT_CHECK(pid >= 0, "fourbit launch: fork failed: {}", std::strerror(errno));
    if (pid == 0) {
      const std::string rank = std::to_string(r), world = std::to_string(n);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", world.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", world.c_str(), 1);
      ::setenv("FOURBIT_NCCL_ID_FILE", (dir + "/nccl-unique-id").c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 1);
      ::execv(program.c_str(), argv.data());
      std::fprintf(stderr, "fourbit launch: cannot run '%s': %s\n", program.c_str(),
                   std::strerror(errno));
      std::_Exit(127);
    }
    g_children.push_back(pid);
  }
  auto old_int = std::signal(SIGINT, SIG_IGN);
  auto old_term = std::signal(SIGTERM, forward_sigterm);
  int result = 0;
  size_t alive = g_children.size();
  std::vector<bool> done(g_children.size(), false);
  std::chrono::steady_clock::time_point failed_at;
  bool killed = false;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid <= 0) {
      // Ranks blocked in a collective with a dead peer do not see SIGTERM between steps: after a
      // grace period (for their checkpoint), they are killed.
      if (result != 0 && !killed &&
          std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(kKillAfterSeconds)) {
        for (size_t j = 0; j < g_children.size(); ++j)
          if (!done[j]) ::kill(g_children[j], SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    size_t i = 0;
    while (i < g_children.size() && g_children[i] != pid) ++i;
    if (i == g_children.size()) continue;  // not ours
    done[i] = true;
    --alive;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status)
                                       : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (code != 0 && result == 0) {
      result = code;
      failed_at = std::chrono::steady_clock::now();
      log_warn("fourbit launch: rank {} (pid {}) failed ({} {}); stopping the other ranks", i, pid,
               WIFEXITED(status) ? "exit code" : "signal",
               WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      for (size_t j = 0; j < g_children.size(); ++j)
        if (!done[j]) ::kill(g_children[j], SIGTERM);
    }
  }
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  g_children.clear();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return result;
}

}  // namespace fourbit::dist
