// The process launcher (dist/launcher.h) and the rank environment (dist/data_parallel.h), on the
// CPU with /bin/sh as the launched program: the variables every rank sees, a failing rank stopping
// the others, the file rendezvous of the NCCL unique id, torchrun / mpirun variables, and the
// errors of a multi-process run that cannot work.
#include "dist/data_parallel.h"
#include "dist/launcher.h"

#include "core/check.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace fourbit::dist {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fourbit_dist_launch_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(DistLauncher, EveryRankGetsItsEnvironment) {
  const std::string dir = temp_dir("env");
  const int rc = launch(3, "/bin/sh",
                        {"-c", "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE "
                               "$NCCL_NVLS_ENABLE $FOURBIT_NCCL_ID_FILE\" > " + dir + "/rank$RANK"});
  ASSERT_EQ(rc, 0);
  std::string id_file;
  for (int r = 0; r < 3; ++r) {
    std::istringstream in(read(dir + "/rank" + std::to_string(r)));
    int rank = -1, world = -1, local = -1, local_world = -1, nvls = -1;
    std::string file;
    in >> rank >> world >> local >> local_world >> nvls >> file;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(world, 3);
    EXPECT_EQ(local, r);
    EXPECT_EQ(local_world, 3);
    EXPECT_EQ(nvls, 0);
    if (r == 0) id_file = file;
    EXPECT_EQ(file, id_file) << "every rank must see the same unique-id file";
  }
  EXPECT_NE(id_file.find("/tmp/fourbit-launch-"), std::string::npos) << id_file;
  EXPECT_FALSE(fs::exists(fs::path(id_file).parent_path())) << "the temporary folder is removed";
  fs::remove_all(dir);
}

TEST(DistLauncher, AFailingRankStopsTheOthers) {
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = launch(3, "/bin/sh", {"-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 30"});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rc, 3);
  EXPECT_LT(s, 15.0) << "the sleeping ranks should have been terminated";
  EXPECT_NE(launch(1, "/nonexistent/program", {}), 0);
}

TEST(DistLauncher, UniqueIdFileRendezvous) {
  const std::string dir = temp_dir("id");
  const std::string path = dir + "/id";
  std::string got;
  std::thread waiter([&] { got = wait_for_file(path, 5, 10.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  publish_file(path, "abcde");
  waiter.join();
  EXPECT_EQ(got, "abcde");
  EXPECT_THROW(wait_for_file(path, 6, 1.0), Error);  // wrong size: a stale file
  EXPECT_THROW(wait_for_file(dir + "/never", 5, 0.2), Error);
  fs::remove_all(dir);
}

TEST(DistLauncher, RankEnvironmentFromTorchrunAndMpirunVariables) {
  for (const char* v : {"WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"})
    ::unsetenv(v);
  EXPECT_FALSE(rank_environment().has_value());
  EXPECT_EQ(communicator_from_environment(Device::kCpu), nullptr);  // single process
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "2", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  auto e = rank_environment();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 2);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 0);
  try {
    communicator_from_environment(Device::kCpu);
    FAIL() << "a multi-process CPU run must be refused";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("--device cuda"), std::string::npos) << err.what();
  }
  ::setenv("RANK", "4", 1);
  EXPECT_THROW(rank_environment(), Error);
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("LOCAL_RANK");
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  e = rank_environment();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 1);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_NE(e->source.find("OMPI"), std::string::npos);
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
}

}  // namespace
}  // namespace fourbit::dist
