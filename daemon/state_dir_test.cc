// StateDirLock: one --state-dir, one daemon.

#include "daemon/state_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

namespace dmuon::server {
namespace {

std::string Fresh(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/" + name + "-" +
         std::to_string(std::random_device{}());
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(StateDirLock, MakesTheDirectoryPrivateAndNamesItsHolder) {
  const std::string dir = Fresh("made") + "/a/b";
  auto lock = StateDirLock::Acquire(dir);
  ASSERT_TRUE(lock.ok()) << lock.status();
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(Read(lock->path()), std::to_string(::getpid()) + "\n");
}

TEST(StateDirLock, ASecondHolderIsRefusedNamingTheFirst) {
  const std::string dir = Fresh("taken");
  {
    auto first = StateDirLock::Acquire(dir);
    ASSERT_TRUE(first.ok()) << first.status();
    // flock locks belong to the open file: a second open conflicts even in
    // this process, as another daemon's would.
    auto second = StateDirLock::Acquire(dir);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(second.status().message());
    EXPECT_EQ(msg.rfind("--state-dir=" + dir + ": in use by another dmuond", 0),
              0u)
        << msg;
    EXPECT_NE(msg.find("pid " + std::to_string(::getpid())), std::string::npos)
        << msg;
    // Moving the lock keeps it held.
    StateDirLock moved = *std::move(first);
    EXPECT_FALSE(StateDirLock::Acquire(dir).ok());
  }
  // Released with its holder.
  EXPECT_TRUE(StateDirLock::Acquire(dir).ok());
}

TEST(StateDirLock, AFileInThePathIsRefusedNamingIt) {
  const std::string file = Fresh("file");
  std::ofstream(file) << "x";
  auto lock = StateDirLock::Acquire(file + "/sub");
  ASSERT_FALSE(lock.ok());
  EXPECT_NE(std::string(lock.status().message()).find("cannot create " + file),
            std::string::npos)
      << lock.status();
  EXPECT_FALSE(StateDirLock::Acquire(file).ok());  // not a directory
}

TEST(StateDirLock, AFifoPlantedAsTheLockFileDoesNotHang) {
  const std::string dir = Fresh("fifo");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::mkfifo((dir + "/.dmuond.lock").c_str(), 0600), 0);
  auto lock = StateDirLock::Acquire(dir);
  ASSERT_FALSE(lock.ok());
  EXPECT_NE(std::string(lock.status().message()).find("not a regular file"),
            std::string::npos)
      << lock.status();
}

}  // namespace
}  // namespace dmuon::server
