// dmuond: the dmuon optimizer daemon, CPU executors only (daemon_main.h).
// dmuond_cuda (dmuond_cuda.cc) is the same daemon with CUDA executors.

#include "daemon/daemon_main.h"

int main(int argc, char** argv) {
  return dmuon::server::DaemonMain(argc, argv, nullptr);
}
