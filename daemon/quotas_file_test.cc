// --quotas-file (quotas_file.h): its lines, its errors naming the line, and
// a reload that keeps the old lines when the new file is bad.

#include "daemon/quotas_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace dmuon::server {
namespace {

std::string TempFile(const std::string& text) {
  char path[] = "/tmp/dmuon-quotas-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(QuotasFile, ParsesEachPrincipalsOptions) {
  auto q = ParseQuotas(
      "# comment\n\nteam-a weight=3 max_device_share=0.25\n"
      "  uri:spiffe://x/y\tmax_jobs=2 max_state_bytes=4096  \n");
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->size(), 2u);
  const PrincipalLimits& a = q->at("team-a");
  EXPECT_EQ(a.weight, 3);
  EXPECT_EQ(a.max_device_share, 0.25);
  EXPECT_FALSE(a.max_jobs.has_value());
  const PrincipalLimits& m = q->at("uri:spiffe://x/y");
  EXPECT_EQ(m.max_jobs, 2);
  EXPECT_EQ(m.max_state_bytes, 4096u);
  EXPECT_FALSE(m.weight.has_value());
}

TEST(QuotasFile, ErrorsNameTheLineAndTheOption) {
  for (const auto& [text, want] :
       std::vector<std::pair<std::string, std::string>>{
           {"a\nb max_device_share=0\n",
            "line 2: max_device_share '0' is not a number in [0.01, 1]"},
           {"a max_device_share=1.5\n", "line 1: max_device_share '1.5'"},
           {"a max_device_share=nan\n", "line 1: max_device_share 'nan'"},
           {"a weight=0\n", "line 1: weight '0' is not a number"},
           {"a max_jobs=0\n", "line 1: max_jobs '0' is not a positive"},
           {"a max_state_bytes=-1\n", "line 1: max_state_bytes '-1'"},
           {"a speed=2\n", "line 1: unknown option 'speed'"},
           {"a extra\n", "line 1: unknown option 'extra'"},
           {"weight=2\n", "line 1: expected '<principal>"},
           {"a\n# x\na max_jobs=1\n", "line 3: principal 'a' again"},
       }) {
    auto q = ParseQuotas(text);
    ASSERT_FALSE(q.ok()) << text;
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(q.status().message().find(want), absl::string_view::npos)
        << q.status() << " want " << want;
  }
}

TEST(QuotasFile, OverridesOnlyWhatItsLineGives) {
  const std::string path = TempFile("team-a max_jobs=1\n");
  auto q = QuotasFile::Create(path);
  ASSERT_TRUE(q.ok()) << q.status();
  Principal a;
  a.name = "team-a";
  a.weight = 2;  // from the token file: kept
  a.quotas.max_state_bytes = 100;
  (*q)->ApplyTo(&a);
  EXPECT_EQ(a.weight, 2);
  EXPECT_EQ(a.quotas.max_jobs, 1);
  EXPECT_EQ(a.quotas.max_state_bytes, 100u);
  Principal b;
  b.name = "team-b";  // no line: unchanged
  (*q)->ApplyTo(&b);
  EXPECT_EQ(b.quotas, Quotas{});
  std::remove(path.c_str());
}

TEST(QuotasFile, ReloadKeepsTheOldLinesWhenTheNewFileIsBad) {
  const std::string path = TempFile("team-a max_device_share=0.5\n");
  auto q = QuotasFile::Create(path);
  ASSERT_TRUE(q.ok()) << q.status();
  std::ofstream(path) << "team-a max_device_share=0.3\nteam-b weight=x\n";
  auto bad = (*q)->Reload();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--quotas-file=" + path + ": line 2"),
            absl::string_view::npos)
      << bad.status();
  Principal a;
  a.name = "team-a";
  (*q)->ApplyTo(&a);
  EXPECT_EQ(a.quotas.max_device_share, 0.5);
  std::ofstream(path) << "team-a max_device_share=0.3\n";
  auto good = (*q)->Reload();
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, 1u);
  (*q)->ApplyTo(&a);
  EXPECT_EQ(a.quotas.max_device_share, 0.3);
  std::remove(path.c_str());
}

TEST(QuotasFile, AMissingFileNamesTheFlag) {
  auto q = QuotasFile::Create("/nonexistent/quotas");
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("--quotas-file=/nonexistent/quotas"),
            absl::string_view::npos)
      << q.status();
}

}  // namespace
}  // namespace dmuon::server
