// Test-only: a fresh directory for a test's files (a --state-dir, tuning
// results). Header-only, testonly.

#ifndef DMUON_SERVER_TESTING_TEMP_DIR_H_
#define DMUON_SERVER_TESTING_TEMP_DIR_H_

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace dmuon::server::testing {

// A new, empty directory named dmuon-<name>-XXXXXX under $TEST_TMPDIR,
// which Bazel gives each test and empties before the next run (so nothing
// piles up in /tmp run after run), or under /tmp outside Bazel. Aborts the
// test binary when it cannot be made: every caller writes into it next.
inline std::string NewTempDir(std::string_view name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = (base != nullptr && *base != '\0') ? base : "/tmp";
  dir.append("/dmuon-").append(name).append("-XXXXXX");
  if (mkdtemp(dir.data()) == nullptr) {
    std::perror(("mkdtemp " + dir).c_str());
    std::abort();
  }
  return dir;
}

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_TEMP_DIR_H_
