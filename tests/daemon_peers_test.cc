// No peer can crash dmuond, take its port, or get a wrong answer from it
// (issue 14): the real daemon binary, abused over its metrics port and its
// gRPC port by this test process, while a real rank process keeps stepping.

#include <arpa/inet.h>
#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proto/dmuon.grpc.pb.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

uint64_t Seed() { return std::random_device{}(); }

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `bytes` to 127.0.0.1:port, half-closes, and returns what comes back
// within `seconds` ("" when nothing, or no connection).
std::string Raw(int port, const std::string& bytes, double seconds = 10) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  (void)!write(fd, bytes.data(), bytes.size());
  shutdown(fd, SHUT_WR);
  std::string resp;
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  char buf[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    resp.append(buf, n);
  }
  close(fd);
  return resp;
}

// The status line of the response to GET `path`.
std::string StatusLine(int port, const std::string& path) {
  const std::string r =
      Raw(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  return r.substr(0, r.find("\r\n"));
}

int64_t CompletedSteps(const Daemon& d, const std::string& job) {
  int code;
  const std::string json = Ctl(d.address(), {"status", "--json"}, &code);
  v1::StatusResponse s;
  if (code != 0 ||
      !google::protobuf::util::JsonStringToMessage(json, &s).ok()) {
    return -1;
  }
  for (const auto& j : s.jobs())
    if (j.job_id() == job) return j.completed_steps();
  return 0;
}

std::unique_ptr<Process> SteppingRank(const Daemon& d, const std::string& job) {
  return std::make_unique<Process>(std::vector<std::string>{
      Runfile("tests/rank_main"), "--server=" + d.address(), "--job=" + job,
      "--rank=0", "--world=1", "--transport=shm", "--steps=1000000",
      "--seed=" + std::to_string(Seed())});
}

// Waits until `job` has more than `than` completed steps; returns them.
int64_t StepsBeyond(const Daemon& d, const std::string& job, int64_t than) {
  int64_t n = -1;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {
    n = CompletedSteps(d, job);
    if (n > than) return n;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < end);
  return n;
}

// A literal's bytes, NULs included.
template <size_t N>
std::string Bytes(const char (&s)[N]) {
  return std::string(s, N - 1);
}

// Still running a moment later (a crashing process may take that long to die).
bool Alive(Daemon& d) { return d.process().Wait(0.3) == -1; }

TEST(Peers, NoHttpRequestCrashesTheDaemonAndAJobKeepsStepping) {
  const int mport = FreePort();
  Daemon d({"--metrics-port=" + std::to_string(mport)});
  ASSERT_NE(d.port(), 0) << d.log();
  auto rank = SteppingRank(d, "busy");
  int64_t steps = StepsBeyond(d, "busy", 0);
  ASSERT_GT(steps, 0) << d.log();

  // A client that sends half a request and sleeps holds one connection
  // through everything below.
  const int slow = Connect(mport);
  ASSERT_GE(slow, 0);
  const std::string half = "GET /metrics HTTP/1.1\r\nHo";
  ASSERT_EQ(write(slow, half.data(), half.size()),
            static_cast<ssize_t>(half.size()));

  struct Case {
    std::string name, request, expect;  // expect: the response starts so
  };
  const std::vector<Case> cases = {
      {"GET /", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404"},
      {"GET /healthz", "GET /healthz HTTP/1.0\r\n\r\n", "HTTP/1.1 404"},
      {"GET /favicon.ico", "GET /favicon.ico HTTP/1.1\r\nHost: x\r\n\r\n",
       "HTTP/1.1 404"},
      {"a 10 KB path",
       "GET /" + std::string(10240, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n",
       "HTTP/1.1 404"},
      {"a 40 KB header",
       "GET / HTTP/1.1\r\nX-Big: " + std::string(40960, 'b') + "\r\n\r\n",
       "HTTP/1.1 4"},
      {"POST /metrics",
       "POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
       "HTTP/1.1 405"},
      {"garbage bytes", Bytes("\x16\x03\x01\x00\xff garbage\0\r\n\r\n"),
       "HTTP/1.1 400"},
      {"binary noise", std::string(3000, '\x80') + "\r\n\r\n", "HTTP/1.1 4"},
      {"blank lines", "\r\n\r\n\r\n", ""},
      {"just connect and close", "", ""},
  };
  for (const Case& c : cases) {
    const std::string r = Raw(mport, c.request);
    EXPECT_EQ(r.rfind(c.expect, 0), 0u)
        << c.name << ": " << r.substr(0, r.find("\r\n"));
    ASSERT_TRUE(Alive(d)) << "dmuond died after " << c.name << "\n" << d.log();
  }
  // /metrics still answers, with the slow client still connected, and the
  // job kept stepping through all of it.
  EXPECT_EQ(StatusLine(mport, "/metrics"), "HTTP/1.1 200 OK");
  const std::string m = HttpGet(mport, "/metrics");
  EXPECT_NE(m.find("dmuon_steps_total"), std::string::npos) << m;
  steps = StepsBeyond(d, "busy", steps);
  EXPECT_GT(steps, 0) << d.log();
  close(slow);
  EXPECT_TRUE(Alive(d)) << d.log();
  EXPECT_GT(StepsBeyond(d, "busy", steps), steps) << d.log();
  EXPECT_EQ(rank->Wait(0), -1) << "the rank stopped stepping";
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
}

TEST(Peers, ASecondDaemonOnATakenPortFailsNamingTheAddress) {
  const int mport = FreePort();
  Daemon first({"--metrics-port=" + std::to_string(mport)});
  ASSERT_NE(first.port(), 0) << first.log();
  const std::string dir = TempDir("second");
  {  // the same gRPC address (no SO_REUSEPORT sharing)
    Process second({Runfile("daemon/dmuond"), "--listen=" + first.address(),
                    "--summary-every-secs=0"},
                   dir + "/grpc.log");
    EXPECT_EQ(second.Wait(30), 2);
    std::ifstream in(dir + "/grpc.log");
    std::stringstream log;
    log << in.rdbuf();
    EXPECT_NE(
        log.str().find("--listen=" + first.address() + ": cannot listen on " +
                       first.address() + ": Address already in use"),
        std::string::npos)
        << log.str();
    // Our one line, not gRPC's own multi-line error before it (issue 29).
    EXPECT_EQ(log.str().find("chttp2_server"), std::string::npos) << log.str();
  }
  {  // the same metrics port
    const std::string metrics = "127.0.0.1:" + std::to_string(mport);
    Process second(
        {Runfile("daemon/dmuond"), "--listen=127.0.0.1:0",
         "--metrics-port=" + std::to_string(mport), "--summary-every-secs=0"},
        dir + "/metrics.log");
    EXPECT_EQ(second.Wait(30), 2);
    std::ifstream in(dir + "/metrics.log");
    std::stringstream log;
    log << in.rdbuf();
    EXPECT_NE(log.str().find("--metrics-port=" + std::to_string(mport) +
                             ": cannot listen on " + metrics +
                             ": Address already in use"),
              std::string::npos)
        << log.str();
  }
  // The first one serves on, alone.
  auto rank = std::make_unique<Process>(std::vector<std::string>{
      Runfile("tests/rank_main"), "--server=" + first.address(), "--job=j",
      "--steps=3", "--seed=" + std::to_string(Seed())});
  EXPECT_EQ(rank->Wait(60), 0) << first.log();
  EXPECT_EQ(StatusLine(mport, "/metrics"), "HTTP/1.1 200 OK");
}

v1::OpenSessionRequest OneMatrixJob(const std::string& job) {
  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_1);
  req.set_job_id(job);
  req.set_world_size(1);
  req.set_transport(v1::TRANSPORT_INLINE);
  auto* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(8);
  p->add_shape(8);
  return req;
}

std::string HealthOf(const Daemon& d, const std::string& service) {
  int code;
  return Ctl(d.address(), {"--service=" + service, "health"}, &code);
}

TEST(Peers, LivenessStaysServingWhileDraining) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  EXPECT_EQ(HealthOf(d, ""), "SERVING\n");
  EXPECT_EQ(HealthOf(d, "dmuon.v1.Optimizer"), "SERVING\n");
  EXPECT_EQ(HealthOf(d, "dmuon.liveness"), "SERVING\n");
  int code;
  Ctl(d.address(), {"drain"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(HealthOf(d, ""), "NOT_SERVING\n");
  EXPECT_EQ(HealthOf(d, "dmuon.v1.Optimizer"), "NOT_SERVING\n");
  EXPECT_EQ(HealthOf(d, "dmuon.liveness"), "SERVING\n");
}

TEST(Peers, LivenessStaysServingWhileDrainingOnSigterm) {
  // Rank 0 of a two-rank job declares a gradient and rank 1 never comes:
  // the job is mid-step, so on SIGTERM the daemon waits for it (3/4 of
  // --exit-timeout-secs) while draining.
  Daemon d({"--exit-timeout-secs=8"});
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest req = OneMatrixJob("half");
  req.set_world_size(2);
  *req.add_parameters() = req.parameters(0);
  req.mutable_parameters(1)->set_name("w2");
  v1::OpenSessionResponse open;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub->OpenSession(&ctx, req, &open);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  grpc::ClientContext ctx;
  auto stream = stub->Step(&ctx);
  v1::StepRequest m;
  m.mutable_attach()->set_session_id(open.session_id());
  ASSERT_TRUE(stream->Write(m));
  auto chunk = [&](int param) {
    v1::StepRequest c;
    c.mutable_gradient()->set_step(open.next_step());
    c.mutable_gradient()->set_param_id(param);
    c.mutable_gradient()->set_data(std::string(8 * 8 * 4, '\0'));
    return c;
  };
  ASSERT_TRUE(stream->Write(chunk(0)));
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(open.next_step());
  ready.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(stream->Write(ready));
  ASSERT_TRUE(stream->Write(chunk(1)));
  // Both chunks in: the declaration between them was handled too.
  uint64_t received = 0;
  for (int i = 0; i < 500 && received < 2 * 8 * 8 * 4; ++i) {
    grpc::ClientContext sctx;
    v1::StatusResponse s;
    ASSERT_TRUE(stub->Status(&sctx, v1::StatusRequest(), &s).ok());
    for (const auto& x : s.sessions())
      if (x.job_id() == "half") received = x.bytes_received();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(received, 2u * 8 * 8 * 4) << d.log();
  d.process().Signal(SIGTERM);
  for (int i = 0; i < 200 && d.log().find("draining") == std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(Alive(d)) << d.log();
  EXPECT_EQ(HealthOf(d, "dmuon.liveness"), "SERVING\n") << d.log();
  EXPECT_EQ(HealthOf(d, ""), "NOT_SERVING\n") << d.log();
  EXPECT_EQ(HealthOf(d, "dmuon.v1.Optimizer"), "NOT_SERVING\n") << d.log();
  EXPECT_TRUE(Alive(d)) << "the checks ran after the drain window\n" << d.log();
  EXPECT_EQ(d.process().Wait(30), 0) << d.log();
  ctx.TryCancel();
}

TEST(Peers, AStreamProtocolErrorAlwaysReachesTheClientWithItsStatus) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  int cancelled = 0;
  for (int i = 0; i < 50; ++i) {
    v1::OpenSessionResponse open;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(stub->OpenSession(
                          &ctx, OneMatrixJob("err-" + std::to_string(i)), &open)
                      .ok());
    }
    grpc::ClientContext ctx;
    auto stream = stub->Step(&ctx);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open.session_id());
    ASSERT_TRUE(stream->Write(m));
    v1::StepRequest bad;  // skips steps: a protocol error
    bad.mutable_gradients_ready()->set_step(open.next_step() + 1000);
    bad.mutable_gradients_ready()->add_param_ids(0);
    stream->Write(bad);
    v1::StepResponse r;
    while (stream->Read(&r)) {
    }
    const grpc::Status st = stream->Finish();
    cancelled += st.error_code() == grpc::StatusCode::CANCELLED;
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << "try " << i << ": " << st.error_message();
    EXPECT_NE(st.error_message().find("skips step"), std::string::npos)
        << "try " << i << ": " << st.error_message();
  }
  EXPECT_EQ(cancelled, 0) << "of 50";
  EXPECT_TRUE(Alive(d)) << d.log();
}

// A client that truncates its own shm segment right after declaring its
// gradients ready (while the daemon gathers or computes) gets DATA_LOSS
// naming the segment; the daemon does not die of SIGBUS, and a real rank
// keeps stepping.
TEST(Peers, AShmSegmentShrunkMidStepIsDataLossNotACrash) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto rank = SteppingRank(d, "busy");
  int64_t steps = StepsBeyond(d, "busy", 0);
  ASSERT_GT(steps, 0) << d.log();
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  // Truncated at once (the daemon may see it at gradients_ready), or a
  // little later: while it gathers, computes (512x512) or delivers.
  const std::vector<int> delays_ms = {0, 1, 2, 5, 10, 20};
  for (size_t i = 0; i < delays_ms.size(); ++i) {
    v1::OpenSessionRequest req = OneMatrixJob("shrink-" + std::to_string(i));
    req.set_transport(v1::TRANSPORT_SHM);
    req.mutable_parameters(0)->set_shape(0, 512);
    req.mutable_parameters(0)->set_shape(1, 512);
    v1::OpenSessionResponse open;
    {
      grpc::ClientContext ctx;
      const grpc::Status st = stub->OpenSession(&ctx, req, &open);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
    // Opened by name before attaching (the daemon unlinks it then).
    const int fd = shm_open(open.shm_name().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0) << open.shm_name();
    grpc::ClientContext ctx;
    auto stream = stub->Step(&ctx);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open.session_id());
    ASSERT_TRUE(stream->Write(m));
    v1::StepRequest ready;  // gradients: the segment's zeros
    ready.mutable_gradients_ready()->set_step(open.next_step());
    ready.mutable_gradients_ready()->add_param_ids(0);
    ASSERT_TRUE(stream->Write(ready));
    std::this_thread::sleep_for(std::chrono::milliseconds(delays_ms[i]));
    ASSERT_EQ(ftruncate(fd, 64), 0);
    close(fd);
    v1::StepResponse r;
    bool completed = false;
    std::string in_band;  // the reason the daemon sent before ending it
    while (stream->Read(&r)) {
      if (r.has_error() && r.error().code() == grpc::StatusCode::DATA_LOSS)
        in_band = r.error().message();
      if (r.has_step_complete()) {
        // The whole step beat the truncation. The stream stays open for the
        // next step (this client sends none): end it from here, or Read
        // would wait for ever.
        completed = true;
        stream->WritesDone();
        break;
      }
    }
    if (completed) {
      stream->Finish();
      continue;
    }
    const grpc::Status st = stream->Finish();
    // DATA_LOSS naming the segment, as the stream's status whether the
    // daemon saw the shrink at gradients_ready or ended the stream itself
    // while the adapter waited for a read (then in-band too); never
    // CANCELLED (security.md, "Errors reach the client").
    ASSERT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS)
        << "try " << i << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(open.shm_name()), std::string::npos)
        << "try " << i << ": '" << st.error_message() << "'";
    EXPECT_TRUE(in_band.empty() || in_band == st.error_message())
        << "try " << i << ": '" << in_band << "'";
  }
  ASSERT_TRUE(Alive(d)) << d.log();
  EXPECT_GT(StepsBeyond(d, "busy", CompletedSteps(d, "busy")), 0) << d.log();
}

TEST(Peers, JobIdsCannotInjectLogLines) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  const std::string forged =
      "x\n[2026-01-01 00:00:00.000] [dmuond] [info] FORGED\r\x1b[2K";
  const std::string huge(100000, 'h');
  for (const std::string& job : {forged, huge, forged + "\n" + huge}) {
    // Refused (control characters; over --max-job-id-bytes), its error
    // quoting a cut, escaped id, and logged.
    grpc::ClientContext ctx;
    v1::OpenSessionResponse open;
    const grpc::Status st = stub->OpenSession(&ctx, OneMatrixJob(job), &open);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << st.error_message();
    // A failing call whose error quotes the job id, logged too.
    grpc::ClientContext ctx2;
    auto bad = OneMatrixJob(job);
    bad.mutable_parameters(0)->set_shape(1, 9);  // differs from rank 0's
    bad.set_world_size(2);
    stub->OpenSession(&ctx2, bad, &open);
  }
  const std::string log = d.log();
  // The forged id reached the log (escaped: "x\\n[2026-01-01 ... FORGED"),
  // inside a line of its own.
  EXPECT_NE(log.find("FORGED"), std::string::npos) << log;
  std::istringstream lines(log);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    ++n;
    EXPECT_EQ(line.rfind("[2026-01-01", 0), std::string::npos) << line;
    EXPECT_EQ(line.find('\r'), std::string::npos) << line;
    EXPECT_EQ(line.find('\x1b'), std::string::npos) << line;
    EXPECT_LT(line.size(), 4096u) << line.substr(0, 200);
  }
  EXPECT_GT(n, 2);
}

// --- The Step and state streams against peers that misbehave (hardening).

std::unique_ptr<v1::Optimizer::Stub> StubOf(const Daemon& d) {
  return v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
}

v1::OpenSessionResponse MustOpen(v1::Optimizer::Stub& stub,
                                 const v1::OpenSessionRequest& req) {
  grpc::ClientContext ctx;
  v1::OpenSessionResponse open;
  const grpc::Status st = stub.OpenSession(&ctx, req, &open);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return open;
}

v1::StatusResponse StatusOf(v1::Optimizer::Stub& stub) {
  grpc::ClientContext ctx;
  v1::StatusResponse s;
  (void)stub.Status(&ctx, v1::StatusRequest(), &s);
  return s;
}

// Open sessions of `job` on the daemon.
int SessionsOf(v1::Optimizer::Stub& stub, const std::string& job) {
  int n = 0;
  const v1::StatusResponse s = StatusOf(stub);
  for (const auto& x : s.sessions()) n += x.job_id() == job;
  return n;
}

// A field of /proc/<pid>/status in kB (VmRSS, VmHWM), -1 if unreadable.
int64_t ProcKb(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0)
      return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

TEST(Peers, AStepStreamThatNeverAttachesEndsWithDeadlineExceeded) {
  Daemon d({"--attach-timeout-seconds=1"});
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = StubOf(d);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Step(&ctx);  // and nothing sent on it
  v1::StepResponse r;
  EXPECT_FALSE(stream->Read(&r));
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--attach-timeout-seconds=1"),
            std::string::npos)
      << st.error_message();
  // A stream that attaches in time is not cut by it.
  auto open = MustOpen(*stub, OneMatrixJob("in-time"));
  grpc::ClientContext ctx2;
  auto ok = stub->Step(&ctx2);
  v1::StepRequest m;
  m.mutable_attach()->set_session_id(open.session_id());
  ASSERT_TRUE(ok->Write(m));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(SessionsOf(*stub, "in-time"), 1) << d.log();
  ok->WritesDone();
  while (ok->Read(&r)) {
  }
  EXPECT_TRUE(ok->Finish().ok());
  EXPECT_TRUE(Alive(d)) << d.log();
}

// The service ends a Step stream while its client neither reads nor writes:
// once the client looks, it gets the service's own status and message,
// never CANCELLED ("Cancelled on the server side") in their place. Two
// ways: CloseSession (OK), and another rank leaving mid-step (ABORTED).
TEST(Peers, AnIdleClientGetsTheStatusOfTheStreamTheServiceEnded) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = StubOf(d);
  int cancelled = 0;
  for (int i = 0; i < 20; ++i) {
    const std::string job = "idle-" + std::to_string(i);
    const bool close = i % 2 == 0;
    v1::OpenSessionRequest req = OneMatrixJob(job);
    if (!close) {
      req.set_world_size(2);
      *req.add_parameters() = req.parameters(0);
      req.mutable_parameters(1)->set_name("w2");
    }
    auto open0 = MustOpen(*stub, req);
    grpc::ClientContext ctx0;
    auto s0 = stub->Step(&ctx0);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open0.session_id());
    ASSERT_TRUE(s0->Write(m));
    if (close) {
      // Attached (its shm name is gone, the session has a sink): then
      // closed by the client's other channel while the stream is idle.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      grpc::ClientContext cctx;
      v1::CloseSessionRequest creq;
      creq.set_session_id(open0.session_id());
      v1::CloseSessionResponse cresp;
      ASSERT_TRUE(stub->CloseSession(&cctx, creq, &cresp).ok());
    } else {
      req.set_rank(1);
      auto open1 = MustOpen(*stub, req);
      grpc::ClientContext ctx1;
      auto s1 = stub->Step(&ctx1);
      v1::StepRequest a;
      a.mutable_attach()->set_session_id(open1.session_id());
      ASSERT_TRUE(s1->Write(a));
      auto chunk = [&](int param) {
        v1::StepRequest c;
        c.mutable_gradient()->set_step(open0.next_step());
        c.mutable_gradient()->set_param_id(param);
        c.mutable_gradient()->set_data(std::string(8 * 8 * 4, '\0'));
        return c;
      };
      ASSERT_TRUE(s0->Write(chunk(0)));
      v1::StepRequest ready;
      ready.mutable_gradients_ready()->set_step(open0.next_step());
      ready.mutable_gradients_ready()->add_param_ids(0);
      ASSERT_TRUE(s0->Write(ready));
      ASSERT_TRUE(s0->Write(chunk(1)));
      // Both chunks in: the declaration between them was handled (the
      // job is mid-step).
      uint64_t received = 0;
      for (int k = 0; k < 500 && received < 2 * 8 * 8 * 4; ++k) {
        const v1::StatusResponse s = StatusOf(*stub);
        for (const auto& x : s.sessions())
          if (x.job_id() == job && x.rank() == 0) received = x.bytes_received();
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ASSERT_EQ(received, 2u * 8 * 8 * 4) << d.log();
      ctx1.TryCancel();  // rank 1 leaves mid-step
      (void)s1->Finish();
    }
    // The daemon ended rank 0's stream; its client has been idle all along.
    for (int k = 0; k < 500 && SessionsOf(*stub, job) > 0; ++k)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(SessionsOf(*stub, job), 0) << d.log();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    v1::StepResponse r;
    while (s0->Read(&r)) {
    }
    const grpc::Status st = s0->Finish();
    cancelled += st.error_code() == grpc::StatusCode::CANCELLED;
    if (close) {
      EXPECT_TRUE(st.ok()) << "try " << i << ": " << st.error_code() << " "
                           << st.error_message();
    } else {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED)
          << "try " << i << ": " << st.error_message();
      EXPECT_NE(st.error_message().find("left mid-step"), std::string::npos)
          << "try " << i << ": " << st.error_message();
    }
  }
  EXPECT_EQ(cancelled, 0) << "of 20";
  EXPECT_TRUE(Alive(d)) << d.log();
}

// A client that sends steps and never reads what comes back: past
// --max-step-queue-bytes of its responses queued, the daemon stops reading
// its stream, so its next step does not run and the daemon does not grow
// by a step's updates per step; other jobs go on; when the client goes its
// session is reclaimed.
TEST(Peers, AClientThatNeverReadsIsHeldByTheStepQueueLimit) {
  Daemon d({"--max-step-queue-bytes=1048576"});
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = StubOf(d);
  v1::OpenSessionRequest req = OneMatrixJob("deaf");
  req.mutable_parameters(0)->set_shape(0, 1024);  // 4 MiB of update a step
  req.mutable_parameters(0)->set_shape(1, 1024);
  auto open = MustOpen(*stub, req);
  const std::string grad(1024 * 1024 * 4, '\0');
  grpc::ClientContext ctx;
  auto stream = stub->Step(&ctx);
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  constexpr int kSteps = 24;
  // Steps as a client that never reads: each once the previous completed
  // (seen through Status), as fast as the stream takes them.
  std::thread client([&] {
    auto watch = StubOf(d);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open.session_id());
    if (!stream->Write(m)) return;
    for (int s = 1; s <= kSteps && !stop; ++s) {
      v1::StepRequest c;
      c.mutable_gradient()->set_step(s);
      c.mutable_gradient()->set_param_id(0);
      c.mutable_gradient()->set_data(grad);
      if (!stream->Write(c)) return;
      v1::StepRequest ready;
      ready.mutable_gradients_ready()->set_step(s);
      ready.mutable_gradients_ready()->add_param_ids(0);
      if (!stream->Write(ready)) return;
      sent = s;
      while (!stop && CompletedSteps(d, "deaf") < s)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  ASSERT_GT(StepsBeyond(d, "deaf", 0), 0) << d.log();
  const int64_t rss0 = ProcKb(d.process().pid(), "VmRSS");
  // Until the steps stop for 3 s (or all ran).
  int64_t steps = CompletedSteps(d, "deaf");
  for (auto last = std::chrono::steady_clock::now();
       std::chrono::steady_clock::now() - last < std::chrono::seconds(3) &&
       steps < kSteps;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t n = CompletedSteps(d, "deaf");
    if (n != steps) last = std::chrono::steady_clock::now();
    steps = n;
  }
  const int64_t rss1 = ProcKb(d.process().pid(), "VmRSS");
  std::printf(
      "figure: never-reading client: %lld of %d steps taken, dmuond "
      "RSS +%lld kB\n",
      static_cast<long long>(steps), kSteps,
      static_cast<long long>(rss1 - rss0));
  // The limit, one step's responses and what gRPC's flow-control windows
  // hold between the two processes: a few steps, not all of them.
  EXPECT_LE(steps, 8) << "of " << kSteps << " sent to a client that reads "
                      << "nothing\n"
                      << d.log();
  EXPECT_LT(rss1 - rss0, 32 * 1024)
      << "kB: the daemon grew with the unread responses";
  // Other jobs step meanwhile.
  auto rank = std::make_unique<Process>(std::vector<std::string>{
      Runfile("tests/rank_main"), "--server=" + d.address(), "--job=other",
      "--steps=3", "--seed=" + std::to_string(Seed())});
  EXPECT_EQ(rank->Wait(60), 0) << d.log();
  stop = true;
  ctx.TryCancel();
  client.join();
  for (int k = 0; k < 500 && SessionsOf(*stub, "deaf") > 0; ++k)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(SessionsOf(*stub, "deaf"), 0) << d.log();
  EXPECT_TRUE(Alive(d)) << d.log();
}

// SetState checks its first message before it reads any more: a stream
// with a session id nobody has, followed by 256 MiB of momentum, is refused
// at once with NOT_FOUND, and the daemon's memory (its peak included) does
// not grow by the payload.
TEST(Peers, ASetStateWithABadSessionIsRefusedBeforeItsPayload) {
  Daemon d;
  ASSERT_NE(d.port(), 0) << d.log();
  auto stub = StubOf(d);
  // A plausible header: 64 parameters of 1024x1024 (no such session).
  v1::OpenSessionRequest req = OneMatrixJob("big");
  req.mutable_parameters(0)->set_shape(0, 1024);
  req.mutable_parameters(0)->set_shape(1, 1024);
  for (int i = 1; i < 64; ++i) {
    *req.add_parameters() = req.parameters(0);
    req.mutable_parameters(i)->set_name("w" + std::to_string(i));
  }
  const int64_t hwm0 = ProcKb(d.process().pid(), "VmHWM");
  ASSERT_GT(hwm0, 0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::SetStateResponse resp;
  auto w = stub->SetState(&ctx, &resp);
  v1::StateChunk h;
  h.set_session_id("not-a-session");
  h.mutable_header()->set_completed_steps(1);
  for (const auto& p : req.parameters())
    *h.mutable_header()->add_parameters() = p;
  const std::string data(4 << 20, '\x7f');
  int written = 0;
  if (w->Write(h)) {
    for (int i = 0; i < 64; ++i) {
      v1::StateChunk c;
      c.mutable_momentum()->set_param_id(i);
      c.mutable_momentum()->set_total_bytes(4 << 20);
      c.mutable_momentum()->set_data(data);
      if (!w->Write(c)) break;
      ++written;
    }
  }
  w->WritesDone();
  const grpc::Status st = w->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_NE(st.error_message().find("no open session"), std::string::npos)
      << st.error_message();
  EXPECT_LT(written, 64) << "the daemon read the whole payload";
  const int64_t hwm1 = ProcKb(d.process().pid(), "VmHWM");
  std::printf(
      "figure: SetState with a bad session + 256 MiB: %d of 64 4-MiB "
      "chunks written before the refusal, dmuond peak RSS +%lld kB\n",
      written, static_cast<long long>(hwm1 - hwm0));
  EXPECT_LT(hwm1 - hwm0, 64 * 1024)
      << "kB of peak memory for a refused 256 MiB payload";
  EXPECT_TRUE(Alive(d)) << d.log();
}

}  // namespace
}  // namespace dmuon::testing
