// Command-line flags in kebab-case over absl flags.
//
// absl names flags with underscores; our binaries document and accept
// kebab-case (--metrics-port), as operators and Helm charts expect. This
// rewrites "--a-b[=v]" to "--a_b[=v]" before absl parses, and serves --help
// itself, listing the program's own flags in kebab-case with their defaults.

#ifndef DMUON_DAEMON_FLAGS_H_
#define DMUON_DAEMON_FLAGS_H_

#include <string>
#include <vector>

namespace dmuon::server {

// Parses argv (exits 0 after printing help for --help/-h, exits 1 on an
// unknown or malformed flag). Returns the positional arguments, argv[0]
// first. `source` is the file that defines the program's flags (help lists
// only those).
std::vector<std::string> ParseFlags(int argc, char** argv,
                                    const std::string& usage,
                                    const std::string& source);

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_FLAGS_H_
