// The core's C++ test programs' one assertion: CHECK(cond) counts a pass or prints the
// failed condition with its place and the case that g_case names, and report() ends main.
#pragma once

#include <cstdio>
#include <string>

namespace groupgemm_tests {

inline int passed = 0, failed = 0;
inline std::string g_case;  // what the checks that follow are about, set by each test

// main's return: the counts, and whether every check passed.
inline int report(const char* program) {
  std::printf("%s: %d passed, %d failed\n", program, passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace groupgemm_tests

#define CHECK(cond)                                                                           \
  do {                                                                                        \
    if (cond) {                                                                               \
      ++groupgemm_tests::passed;                                                              \
    } else {                                                                                  \
      ++groupgemm_tests::failed;                                                              \
      std::printf("FAILED %s:%d [%s]: %s\n", __FILE__, __LINE__, groupgemm_tests::g_case.c_str(), \
                  #cond);                                                                     \
    }                                                                                         \
  } while (0)
