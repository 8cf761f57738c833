// Error messages for the checks of the fused ops. Numbers are turned into text with std::to_string and the message
// reaches TORCH_CHECK as one std::string, so that no ostream built by this extension formats a number: on a GPU machine
// (its gcc, torch 2.11) formatting a number into such a stream crashed the process, while messages of text alone raised
// as they should.
#pragma once
#include <string>
#include <type_traits>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace mixedprec {

inline std::string msg_piece(const char* s) { return s; }
inline std::string msg_piece(const std::string& s) { return s; }
inline std::string msg_piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string msg_piece(const c10::Device& d) { return d.str(); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0> std::string msg_piece(T v) { return std::to_string(v); }

template <typename... Parts> std::string msg(const Parts&... parts) {
  std::string s;
  ((s += msg_piece(parts)), ...);
  return s;
}

}  // namespace mixedprec
