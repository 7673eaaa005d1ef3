// Strict UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF) and
// a printable quoting of untrusted strings for error messages. Internal to the io module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fourbit::io::detail {

// The offset of the first byte that is not part of a valid UTF-8 sequence, or npos.
inline size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + (size_t)len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (int k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
    }
    i += (size_t)len;
  }
  return std::string_view::npos;
}

inline bool is_valid_utf8(std::string_view s) { return find_invalid_utf8(s) == std::string_view::npos; }

// 'name' with control characters and invalid bytes escaped as \xNN, cut after `max_bytes`.
inline std::string printable(std::string_view s, size_t max_bytes = 120) {
  std::string out = "'";
  const size_t n = s.size() < max_bytes ? s.size() : max_bytes;
  const bool valid = is_valid_utf8(s.substr(0, n));
  static const char* kHex = "0123456789abcdef";
  for (size_t i = 0; i < n; ++i) {
    const auto c = (unsigned char)s[i];
    if (c < 0x20 || c == 0x7F || c == '\'' || c == '\\' || (c >= 0x80 && !valid)) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += (char)c;
    }
  }
  out += "'";
  if (n < s.size()) out += "...";
  return out;
}

}  // namespace fourbit::io::detail
