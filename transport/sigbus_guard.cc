#include "transport/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <cstring>
#include <mutex>

namespace dmuon::transport {
namespace {

// The copy in progress on this thread: what the handler may repair. Set
// and cleared around each copy, only on its own thread, so the handler (on
// the faulting thread) reads it without a lock.
struct ActiveCopy {
  std::byte* base;
  size_t size;
  std::atomic<bool>* broken;
};
thread_local ActiveCopy* t_active = nullptr;

struct sigaction g_previous;  // SIGBUS's disposition before ours

// Hands a fault that is not a guarded copy's to the previous disposition.
void Chain(int sig, siginfo_t* info, void* context) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler == SIG_DFL ||
             g_previous.sa_handler == SIG_IGN) {
    // A fault ignored would repeat forever: the default, as the kernel
    // would apply to a SIGBUS it must deliver. Returning re-runs the
    // faulting instruction, which now kills the process.
    ::signal(sig, SIG_DFL);
  } else {
    g_previous.sa_handler(sig);
  }
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  ActiveCopy* a = t_active;
  auto* addr = static_cast<std::byte*>(info->si_addr);
  if (a != nullptr && addr >= a->base && addr < a->base + a->size) {
    // Broken before the pages change, so a copy on another thread that
    // reads the zero pages sees the flag when it checks after its copy.
    a->broken->store(true);
    if (::mmap(a->base, a->size, PROT_READ | PROT_WRITE,
               MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
      return;  // the copy resumes on the zero pages
    }
  }
  Chain(sig, info, context);
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous);
  });
}

// t_active for the life of one copy. The signal fences keep the compiler
// from moving the copy out of the window the handler sees.
class Guard {
 public:
  explicit Guard(ActiveCopy* a) {
    InstallOnce();
    t_active = a;
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  ~Guard() {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    t_active = nullptr;
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
};

}  // namespace

GuardedMapping::GuardedMapping(void* base, size_t size)
    : base_(static_cast<std::byte*>(base)), size_(size) {}

bool GuardedMapping::CopyOut(size_t offset, void* out, size_t n) {
  return Copy(out, base_ + offset, n);
}

bool GuardedMapping::CopyIn(size_t offset, const void* in, size_t n) {
  return Copy(base_ + offset, in, n);
}

template <typename F>
bool GuardedMapping::Run(F f) {
  if (broken()) return false;
  ActiveCopy a{base_, size_, &broken_};
  {
    Guard g(&a);
    f();
  }
  return !broken();
}

bool GuardedMapping::Copy(void* to, const void* from, size_t n) {
  if (n == 0) return !broken();
  return Run([&] { std::memcpy(to, from, n); });
}

bool GuardedMapping::Store64(size_t offset, uint64_t value) {
  auto* word = reinterpret_cast<std::atomic<uint64_t>*>(base_ + offset);
  return Run([&] { word->store(value, std::memory_order_release); });
}

bool GuardedMapping::Load64s(size_t offset, uint64_t* out, size_t count) {
  auto* words = reinterpret_cast<const std::atomic<uint64_t>*>(base_ + offset);
  return Run([&] {
    for (size_t i = 0; i < count; ++i)
      out[i] = words[i].load(std::memory_order_acquire);
  });
}

bool GuardedMapping::Gather64s(size_t offset, const int* index, size_t count,
                               uint64_t* out) {
  auto* words = reinterpret_cast<const std::atomic<uint64_t>*>(base_ + offset);
  return Run([&] {
    for (size_t k = 0; k < count; ++k)
      out[k] = words[index[k]].load(std::memory_order_acquire);
  });
}

bool GuardedMapping::Load32(size_t offset, uint32_t* out) {
  auto* word = reinterpret_cast<const std::atomic<uint32_t>*>(base_ + offset);
  return Run([&] { *out = word->load(std::memory_order_acquire); });
}

bool GuardedMapping::Increment32(size_t offset) {
  auto* word = reinterpret_cast<std::atomic<uint32_t>*>(base_ + offset);
  return Run([&] { word->fetch_add(1, std::memory_order_release); });
}

bool GuardedMapping::Or64(size_t offset, uint64_t bits) {
  auto* word = reinterpret_cast<std::atomic<uint64_t>*>(base_ + offset);
  return Run([&] { word->fetch_or(bits, std::memory_order_release); });
}

bool GuardedMapping::Take64s(size_t offset, uint64_t* out, size_t count) {
  auto* words = reinterpret_cast<std::atomic<uint64_t>*>(base_ + offset);
  return Run([&] {
    for (size_t i = 0; i < count; ++i)
      out[i] = words[i].exchange(0, std::memory_order_acq_rel);
  });
}

}  // namespace dmuon::transport
