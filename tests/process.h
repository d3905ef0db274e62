// Real processes for integration tests: dmuond and rank processes started
// from the test's runfiles, waited for with deadlines, killed if they hang.

#ifndef DMUON_TESTS_PROCESS_H_
#define DMUON_TESTS_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

namespace dmuon::testing {

// $TEST_SRCDIR/dmuon/<path>: a binary the test depends on as data.
std::string Runfile(const std::string& path);

class Process {
 public:
  // Starts argv[0] with the arguments; stdout and stderr go to `log` (empty:
  // inherited).
  Process(std::vector<std::string> argv, const std::string& log = "");
  ~Process();  // SIGKILLs a process still running
  pid_t pid() const { return pid_; }
  // Exit code, 128 + signal if killed, -1 if still running at the deadline.
  int Wait(double seconds);
  void Signal(int sig);

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  bool done_ = false;
};

// A dmuond on 127.0.0.1 with a free port (a --listen in `flags` overrides
// it). `binary`: the runfile to start (Runfile's path), e.g.
// "daemon/dmuond_prev".
class Daemon {
 public:
  explicit Daemon(std::vector<std::string> flags = {},
                  const std::string& binary = "daemon/dmuond");
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  Process& process() { return *process_; }
  std::string log() const;  // what it printed so far

 private:
  std::string address_, log_path_;
  int port_ = 0;
  std::unique_ptr<Process> process_;
};

// A fresh directory under $TEST_TMPDIR.
std::string TempDir(const std::string& name);
// Runs dmuonctl with `args`; returns its stdout and sets *code.
std::string Ctl(const std::string& address,
                const std::vector<std::string>& args, int* code);
// GET http://127.0.0.1:port/path, the body ("" on failure).
std::string HttpGet(int port, const std::string& path);
// A TCP port free right now on 127.0.0.1 (the kernel's pick).
int FreePort();

}  // namespace dmuon::testing

#endif  // DMUON_TESTS_PROCESS_H_
