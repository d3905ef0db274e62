// The main() of a fuzz harness in builds without libFuzzer (gcc, or clang
// without --config=fuzz): runs LLVMFuzzerTestOneInput once on every file
// named on the command line, or inside a directory named there, so that the
// seed corpus is a plain regression test in every configuration.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

int RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
    return 1;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                         bytes.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int files = 0, bad = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!arg.empty() && arg[0] == '-') continue;  // a libFuzzer flag: ignored
    const std::filesystem::path p(arg);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        if (!e.is_regular_file()) continue;
        bad += RunFile(e.path());
        ++files;
      }
    } else {
      bad += RunFile(p);
      ++files;
    }
  }
  std::printf("replay: %d inputs, %d unreadable\n", files, bad);
  return bad == 0 && files > 0 ? 0 : 1;
}
