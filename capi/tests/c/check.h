/* CHECK / OK: the assertions the C test programs share (smoke.c,
 * device.c). CHECK counts a failure and goes on; OK exits on a failed call,
 * printing its status and treeattn_last_error(). */
#ifndef TREEATTN_TEST_CHECK_H
#define TREEATTN_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "treeattn.h"

static int failures = 0;
#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                   \
      fprintf(stderr, __VA_ARGS__);                                          \
      fprintf(stderr, "\n");                                                 \
      failures++;                                                            \
    }                                                                        \
  } while (0)
#define OK(call)                                                             \
  do {                                                                       \
    int32_t st_ = (call);                                                    \
    if (st_ != TREEATTN_OK) {                                                \
      fprintf(stderr, "FAIL %s:%d: %s -> %d (%s): %s\n", __FILE__, __LINE__, \
              #call, st_, treeattn_status_name(st_), treeattn_last_error()); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)
#endif
