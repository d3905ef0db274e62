#include "tests/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

extern char** environ;

namespace dmuon::testing {

std::string Runfile(const std::string& path) {
  const char* src = std::getenv("TEST_SRCDIR");
  return std::string(src ? src : ".") + "/dmuon/" + path;
}

std::string TempDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  std::string dir =
      std::string(t ? t : "/tmp") + "/" + name + "." +
      std::to_string(getpid()) + "." +
      std::to_string(
          std::chrono::steady_clock::now().time_since_epoch().count());
  mkdir(dir.c_str(), 0700);
  return dir;
}

Process::Process(std::vector<std::string> argv, const std::string& log) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  }
  if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0)
    pid_ = -1;
  posix_spawn_file_actions_destroy(&fa);
}

Process::~Process() {
  if (pid_ > 0 && !done_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
}

int Process::Wait(double seconds) {
  if (pid_ <= 0) return -1;
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done_) {
    pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) {
      done_ = true;
      break;
    }
    if (std::chrono::steady_clock::now() > end) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
  return -1;
}

void Process::Signal(int sig) {
  if (pid_ > 0 && !done_) kill(pid_, sig);
}

Daemon::Daemon(std::vector<std::string> flags, const std::string& binary) {
  const std::string dir = TempDir("dmuond");
  const std::string port_file = dir + "/port";
  log_path_ = dir + "/log";
  std::vector<std::string> argv = {Runfile(binary), "--listen=127.0.0.1:0",
                                   "--port-file=" + port_file,
                                   "--summary-every-secs=0"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  process_ = std::make_unique<Process>(argv, log_path_);
  for (int i = 0; i < 1000 && port_ == 0; ++i) {
    std::ifstream in(port_file);
    if (!(in >> port_)) port_ = 0;
    if (port_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  address_ = "127.0.0.1:" + std::to_string(port_);
}

std::string Daemon::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Ctl(const std::string& address,
                const std::vector<std::string>& args, int* code) {
  const std::string out = TempDir("ctl") + "/out";
  std::vector<std::string> argv = {Runfile("daemon/dmuonctl"),
                                   "--server=" + address};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, out);
  *code = p.Wait(30);
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t n = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  const std::string req =
      "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string resp;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

}  // namespace dmuon::testing
