// `fourbit launch -n N -- <subcommand ...>`: one process per GPU on this host, without MPI.
//
// launch() makes a fresh temporary folder, forks N children and execs `program args...` in each
// with the environment of a torchrun-style run:
//   RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = N,
//   FOURBIT_NCCL_ID_FILE = <temp folder>/nccl-unique-id  (rank 0 publishes the ncclUniqueId there,
//                          the others wait for it: publish_file / wait_for_file below),
//   NCCL_NVLS_ENABLE = 0  (NVLink multicast off, issue #8).
// The parent ignores SIGINT (Ctrl-C reaches the children through the terminal's process group,
// and they stop and save as `fourbit pretrain` does) and forwards SIGTERM to them. When a child
// fails (non-zero exit or a signal) the others are sent SIGTERM (by pid), since they would wait
// forever in their next collective, and SIGKILL 60 s later if they are still running (a rank
// blocked inside a collective never reaches the between-steps stop check). Returns 0 when every child exited 0, else the first failure's
// exit code (128 + signal for a signal). The temporary folder is removed at the end.
#pragma once

#include <string>
#include <vector>

namespace fourbit::dist {

int launch(int n_processes, const std::string& program, const std::vector<std::string>& args);

// Writes `bytes` to `path` atomically (a temporary file in the same folder, fsynced, renamed).
void publish_file(const std::string& path, const std::string& bytes);
// Waits until `path` exists and returns its content, which must be `size` bytes; throws after
// timeout_s seconds naming the file.
std::string wait_for_file(const std::string& path, size_t size, double timeout_s);

}  // namespace fourbit::dist
