#include "daemon/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"

namespace dmuon::server {
namespace {

std::string Kebab(std::string s) {
  std::replace(s.begin(), s.end(), '_', '-');
  return s;
}

void PrintHelp(const std::string& usage, const std::string& source) {
  std::printf("%s\n\nflags:\n", usage.c_str());
  std::vector<absl::CommandLineFlag*> flags;
  for (auto& [name, f] : absl::GetAllFlags()) {
    if (f->Filename().find(source) != std::string::npos) flags.push_back(f);
  }
  std::sort(flags.begin(), flags.end(),
            [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (auto* f : flags) {
    std::printf("  --%s (default: %s)\n      %s\n",
                Kebab(std::string(f->Name())).c_str(),
                f->DefaultValue().empty() ? "\"\"" : f->DefaultValue().c_str(),
                std::string(f->Help()).c_str());
  }
}

}  // namespace

std::vector<std::string> ParseFlags(int argc, char** argv,
                                    const std::string& usage,
                                    const std::string& source) {
  std::vector<std::string> rewritten;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "--helpfull") {
      PrintHelp(usage, source);
      std::exit(0);
    }
    if (i > 0 && a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      std::string name =
          a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::replace(name.begin(), name.end(), '-', '_');
      a = "--" + name + (eq == std::string::npos ? "" : a.substr(eq));
    }
    rewritten.push_back(a);
  }
  std::vector<char*> ptrs;
  for (auto& s : rewritten) ptrs.push_back(s.data());
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(ptrs.size()), ptrs.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

}  // namespace dmuon::server
