// LogSafe and the text format's escaping: what a peer names cannot add a
// log line or fill the log.

#include "daemon/logging.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <string>

namespace dmuon::server {
namespace {

TEST(LogSafe, EscapesControlCharactersAndBackslashes) {
  EXPECT_EQ(LogSafe("job-1"), "job-1");
  EXPECT_EQ(LogSafe("a\nINJECTED [dmuond] [info] b"),
            "a\\nINJECTED [dmuond] [info] b");
  EXPECT_EQ(LogSafe(std::string("\r\t\x1b[31m\x7f\\", 9)),
            "\\r\\t\\x1b[31m\\x7f\\\\");
  EXPECT_EQ(LogSafe(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(LogSafe("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 kept
}

TEST(LogSafe, CapsTheLength) {
  const std::string s = LogSafe(std::string(10000, 'x'), 128);
  EXPECT_EQ(s, std::string(128, 'x') + "...(10000 bytes)");
  EXPECT_EQ(LogSafe(std::string(128, 'y'), 128), std::string(128, 'y'));
}

// The JSON format escapes control characters as \u00XX (and only those).
TEST(SetUpLogging, JsonEscapesControlCharacters) {
  SetUpLogging(/*json=*/true, "info");
  ::testing::internal::CaptureStdout();
  spdlog::info("a{}b", std::string("\x01\x1f\x7f\n\"", 5));
  spdlog::default_logger()->flush();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find(R"("msg":"a\u0001\u001f\u007f\n\"b")"), std::string::npos)
      << out;
}

TEST(AppendEscaped, KeepsBackslashesEscapesControls) {
  std::string out = "> ";
  AppendEscaped("C:\\dir\nnext\x01", &out);
  EXPECT_EQ(out, "> C:\\dir\\nnext\\x01");
}

}  // namespace
}  // namespace dmuon::server
