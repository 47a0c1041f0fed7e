/* Shared by the C tests in this folder: pass/fail counting with the library's last error, and DLTensor
 * views of CPU buffers. Each test prints "N passed, M failed" and exits non-zero on any failure. */
#ifndef KVS_TEST_CHECK_H
#define KVS_TEST_CHECK_H

#include "kvsparse.h"

#include <stdio.h>
#include <string.h>

static int passed, failed;
#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (cond) {                                                   \
      passed++;                                                   \
    } else {                                                      \
      failed++;                                                   \
      printf("FAIL line %d: ", __LINE__);                         \
      printf(__VA_ARGS__);                                        \
      printf(" (last error: %s)\n", kvs_last_error());            \
    }                                                             \
  } while (0)

/* A CPU DLTensor; strides NULL = compact row-major. */
static DLTensor dl_tensor(void *data, int ndim, int64_t *shape, int64_t *strides, uint8_t code, uint8_t bits) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = 1; /* kDLCPU */
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = strides;
  return t;
}
#define F32 2, 32
#define I32 0, 32
#define I64 0, 64

#endif
