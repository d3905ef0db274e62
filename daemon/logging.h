// dmuond's log: spdlog to stdout, one line per event in --log-format=text or
// json. Nothing a peer sends can add a line: every message's control
// characters are escaped (text: \n, \r, \t, \xNN; json: JSON escapes), and
// what a peer names (job ids) is logged through LogSafe, capped in length.

#ifndef DMUON_DAEMON_LOGGING_H_
#define DMUON_DAEMON_LOGGING_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace dmuon::server {

// Makes the "dmuond" stdout logger the default one, with `json` lines or
// text lines, at `level` (spdlog::level::from_str's names; validated by
// ValidateConfig).
void SetUpLogging(bool json, const std::string& level);

// `s` as one printable token for a log line: control characters (< 0x20,
// 0x7f) and backslashes escaped as \n, \r, \t, \\ or \xNN; longer than
// `max_bytes`: cut there, with "...(N bytes)" added. Bytes >= 0x80 (UTF-8)
// are kept.
std::string LogSafe(std::string_view s, size_t max_bytes = 128);

// Appends `s` to `out` with its control characters escaped as LogSafe
// escapes them (backslashes kept, no cap): what the text format does to
// every message.
void AppendEscaped(std::string_view s, std::string* out);

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_LOGGING_H_
