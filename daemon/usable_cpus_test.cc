#include "daemon/usable_cpus.h"

#include <sched.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace dmuon {
namespace {

TEST(QuotaCores, V2) {
  EXPECT_EQ(QuotaCoresV2("max 100000\n"), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("100000 100000\n"), 1);
  EXPECT_EQ(QuotaCoresV2("150000 100000"), 2);  // 1.5 cores: rounded up
  EXPECT_EQ(QuotaCoresV2("50000 100000"), 1);   // half a core: at least 1
  EXPECT_EQ(QuotaCoresV2("800000 100000"), 8);
  EXPECT_EQ(QuotaCoresV2(""), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("garbage"), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("100000 0"), std::nullopt);
}

TEST(QuotaCores, V1) {
  EXPECT_EQ(QuotaCoresV1("-1\n", "100000\n"), std::nullopt);
  EXPECT_EQ(QuotaCoresV1("250000\n", "100000\n"), 3);
  EXPECT_EQ(QuotaCoresV1("x", "100000"), std::nullopt);
}

// A cgroup tree under a temporary directory: `files` maps paths below it to
// contents.
class FakeCgroups {
 public:
  FakeCgroups() {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = root_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  std::filesystem::path root_;
};

// The defect this replaced: only the hierarchy's root file was read, so a
// quota on the process's own cgroup (a systemd service, a pod's container
// without a cgroup namespace) or on a parent was missed.
TEST(QuotaCoresOnPath, V2ReadsTheOwnCgroupAndEveryParent) {
  FakeCgroups fs;
  fs.Write("cpu.max", "max 100000\n");
  fs.Write("kubepods/cpu.max", "max 100000\n");
  fs.Write("kubepods/pod1/cpu.max", "300000 100000\n");  // the pod: 3
  fs.Write("kubepods/pod1/ctr/cpu.max", "max 100000\n");
  EXPECT_EQ(QuotaCoresOnPath(fs.root(), "0::/kubepods/pod1/ctr\n"), 3);
  fs.Write("kubepods/pod1/ctr/cpu.max", "150000 100000\n");  // tighter: 2
  EXPECT_EQ(QuotaCoresOnPath(fs.root(), "0::/kubepods/pod1/ctr\n"), 2);
  // A cgroup namespace: the process's cgroup is the mount's root.
  fs.Write("cpu.max", "100000 100000\n");
  EXPECT_EQ(QuotaCoresOnPath(fs.root(), "0::/\n"), 1);
  // No file anywhere on the path, or none limited: no quota.
  EXPECT_EQ(QuotaCoresOnPath(fs.root(), "0::/elsewhere/x\n"), 1);
  FakeCgroups empty;
  EXPECT_EQ(QuotaCoresOnPath(empty.root(), "0::/a/b\n"), std::nullopt);
  EXPECT_EQ(QuotaCoresOnPath(empty.root(), ""), std::nullopt);
  EXPECT_EQ(QuotaCoresOnPath(empty.root(), "garbage"), std::nullopt);
}

TEST(QuotaCoresOnPath, V1FindsTheCpuControllersMount) {
  FakeCgroups fs;
  fs.Write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  fs.Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  fs.Write("cpu,cpuacct/svc/cpu.cfs_quota_us", "250000\n");
  fs.Write("cpu,cpuacct/svc/cpu.cfs_period_us", "100000\n");
  const std::string self =
      "4:memory:/svc\n3:cpu,cpuacct:/svc/unit\n0::/svc/unit\n";
  EXPECT_EQ(QuotaCoresOnPath(fs.root(), self), 3);  // the parent's 2.5
  // Mounted as "cpu" (a symlink on most hosts, the only name on some).
  FakeCgroups plain;
  plain.Write("cpu/cpu.cfs_quota_us", "200000\n");
  plain.Write("cpu/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(QuotaCoresOnPath(plain.root(), "2:cpu,cpuacct:/\n"), 2);
}

// Pinned to one core, the process may use one core, however many the
// machine has (the defect: hardware_concurrency() counted them all).
TEST(UsableCpus, FollowsTheAffinityMask) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  const int before = UsableCpus();
  EXPECT_GE(before, 1);
  EXPECT_LE(before, CPU_COUNT(&saved));
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(UsableCpus(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(saved), &saved), 0);
  EXPECT_EQ(UsableCpus(), before);
}

}  // namespace
}  // namespace dmuon
