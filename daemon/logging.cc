#include "daemon/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

#include "absl/strings/escaping.h"

namespace dmuon::server {
namespace {

void AppendControl(unsigned char c, std::string* out) {
  switch (c) {
    case '\n':
      out->append("\\n");
      break;
    case '\r':
      out->append("\\r");
      break;
    case '\t':
      out->append("\\t");
      break;
    default:
      out->append("\\x").append(absl::BytesToHexString(
          absl::string_view(reinterpret_cast<const char*>(&c), 1)));
  }
}

bool IsControl(unsigned char c) { return c < 0x20 || c == 0x7f; }

std::string_view Payload(const spdlog::details::log_msg& msg) {
  return std::string_view(msg.payload.data(), msg.payload.size());
}

// %* in the text pattern: the message, control characters escaped.
class TextMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string out;
    AppendEscaped(Payload(msg), &out);
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TextMessageFlag>();
  }
};

// %* in the JSON pattern: the message, JSON-escaped.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    for (char c : Payload(msg)) {
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        default:
          if (IsControl(static_cast<unsigned char>(c))) {
            // \u00XX: control characters are below 0x80.
            const std::string hex =
                absl::BytesToHexString(absl::string_view(&c, 1));
            dest.append(std::string_view("\\u00"));
            dest.append(std::string_view(hex));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

}  // namespace

void AppendEscaped(std::string_view s, std::string* out) {
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (IsControl(u)) {
      AppendControl(u, out);
    } else {
      out->push_back(c);
    }
  }
}

std::string LogSafe(std::string_view s, size_t max_bytes) {
  std::string out;
  const std::string_view shown = s.substr(0, max_bytes);
  for (char c : shown) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\\') {
      out.append("\\\\");
    } else if (IsControl(u)) {
      AppendControl(u, &out);
    } else {
      out.push_back(c);
    }
  }
  if (shown.size() < s.size())
    out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

void SetUpLogging(bool json, const std::string& level) {
  auto logger = spdlog::stdout_logger_mt("dmuond");
  spdlog::set_default_logger(logger);
  auto f = std::make_unique<spdlog::pattern_formatter>();
  if (json) {
    f->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","logger":"%n","msg":"%*"})");
  } else {
    // spdlog's default pattern, the message escaped.
    f->add_flag<TextMessageFlag>('*').set_pattern(
        "[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %*");
  }
  spdlog::set_formatter(std::move(f));
  spdlog::set_level(spdlog::level::from_str(level));
  spdlog::flush_on(spdlog::level::info);
}

}  // namespace dmuon::server
