/* The hardening classes of issue 12, as a C caller meets them (header only): sizes that overflow, limits,
 * deep policy specs, layouts that alias, broadcast inputs with huge extents, NaN and infinity. Every bad call
 * must return its documented status quickly (< 1 s) and write nothing; NaN must come out as NaN.
 * Prints "N passed, M failed"; runs under valgrind in CI. */
#include "check.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

enum { HQ = 4, HK = 2, D = 64, BS = 16, NB = 4 };
#define BIG (INT64_C(1) << 62)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Calls `call` (an expression giving a kvs_status), checks its status and that it took < 1 s. */
#define EXPECT(call, status, what)                                                                     \
  do {                                                                                                 \
    double t0_ = now();                                                                                \
    kvs_status st_ = (call);                                                                           \
    double dt_ = now() - t0_;                                                                          \
    CHECK(st_ == (status) && dt_ < 1.0, "%s: status %s (want %s) in %.3f s", what, kvs_status_name(st_), \
          kvs_status_name(status), dt_);                                                               \
    if (st_ != KVS_OK) CHECK(strlen(kvs_last_error()) > 10, "%s: a message", what);                    \
  } while (0)

static kvs_engine_config base_config(void) {
  kvs_engine_config cfg;
  kvs_engine_config_init(&cfg);
  cfg.num_layers = 1;
  cfg.num_q_heads = HQ;
  cfg.num_kv_heads = HK;
  cfg.head_dim = D;
  cfg.block_size = BS;
  cfg.dtype = KVS_DTYPE_FLOAT32;
  cfg.num_threads = 1;
  return cfg;
}

static void engine_limits(void) {
  kvs_engine *e = NULL;
  kvs_engine_config c = base_config();
  c.num_layers = 0xFFFFFFFFu;
  EXPECT(kvs_engine_create(&c, &e), KVS_ERR_UNSUPPORTED, "num_layers 2^32-1");
  CHECK(e == NULL, "no engine");
  c = base_config();
  c.num_layers = 4096;
  EXPECT(kvs_engine_create(&c, &e), KVS_OK, "num_layers 4096 (the limit)");
  kvs_engine_destroy(e);
  e = NULL;
  c = base_config();
  c.num_threads = 5000;
  EXPECT(kvs_engine_create(&c, &e), KVS_ERR_UNSUPPORTED, "num_threads 5000");
  c.num_threads = 100000;
  EXPECT(kvs_engine_create(&c, &e), KVS_ERR_UNSUPPORTED, "num_threads 100000");
  c = base_config();
  c.num_q_heads = 0xFFFFFFFFu;
  c.num_kv_heads = 1;
  EXPECT(kvs_engine_create(&c, &e), KVS_ERR_UNSUPPORTED, "num_q_heads 2^32-1");

  /* Policy specs: nesting past the bound inside the length limit, and far past both. */
  size_t levels[2] = {400, 15000};
  for (int i = 0; i < 2; i++) {
    size_t n = levels[i];
    char *spec = malloc(n * 9 + 1);
    for (size_t j = 0; j < n; j++) memcpy(spec + j * 8, "quest(a=", 8);
    memset(spec + n * 8, ')', n);
    spec[n * 9] = 0;
    c = base_config();
    c.policy = spec;
    EXPECT(kvs_engine_create(&c, &e), KVS_ERR_INVALID_ARGUMENT, "deeply nested policy spec");
    CHECK(strstr(kvs_last_error(), i == 0 ? "nested" : "bytes long") != NULL, "the message says why: %.120s", kvs_last_error());
    free(spec);
  }
}

int main(void) {
  engine_limits();

  kvs_engine_config cfg = base_config();
  kvs_engine *e = NULL;
  CHECK(kvs_engine_create(&cfg, &e) == KVS_OK, "create");

  /* A cache written through kvsparse: 4 blocks, every slot. */
  static float kc[NB * BS * HK * D], vc[NB * BS * HK * D], nk[NB * BS * HK * D], nv[NB * BS * HK * D];
  int64_t slots[NB * BS];
  srand(7);
  for (int i = 0; i < NB * BS * HK * D; i++) nk[i] = (float)rand() / RAND_MAX - 0.5f, nv[i] = (float)rand() / RAND_MAX - 0.5f;
  for (int i = 0; i < NB * BS; i++) slots[i] = i;
  int64_t cshape[4] = {NB, BS, HK, D}, nshape[3] = {NB * BS, HK, D}, sshape[1] = {NB * BS};
  DLTensor kct = dl_tensor(kc, 4, cshape, NULL, F32), vct = dl_tensor(vc, 4, cshape, NULL, F32);
  DLTensor nkt = dl_tensor(nk, 3, nshape, NULL, F32), nvt = dl_tensor(nv, 3, nshape, NULL, F32), slt = dl_tensor(slots, 1, sshape, NULL, I64);
  kvs_cache_write_args cw = {sizeof cw, 0, &nkt, &nvt, &kct, &vct, &slt, NULL};
  EXPECT(kvs_cache_write(e, &cw), KVS_OK, "cache write");

  /* Cache write: a key cache with block stride 0 aliases itself (forward rejects the same layout). */
  int64_t zero_block[4] = {0, HK * D, D, 1};
  DLTensor kc0 = dl_tensor(kc, 4, cshape, zero_block, F32);
  kvs_cache_write_args cw0 = cw;
  cw0.key_cache = &kc0;
  float before = kc[0];
  EXPECT(kvs_cache_write(e, &cw0), KVS_ERR_INVALID_SHAPE, "cache_write: key cache with block stride 0");
  CHECK(kc[0] == before, "nothing written");

  /* Forward: one decode row of 40 keys. */
  float q[HQ * D], out[HQ * D], lse[HQ];
  for (int i = 0; i < HQ * D; i++) q[i] = (float)rand() / RAND_MAX - 0.5f;
  int32_t table[3] = {2, 0, 3}, lens[1] = {40}, qsl[2] = {0, 1};
  int64_t qshape[3] = {1, HQ, D}, tshape[2] = {1, 3}, one[1] = {1}, two[1] = {2}, lshape[2] = {1, HQ};
  DLTensor qt = dl_tensor(q, 3, qshape, NULL, F32), ot = dl_tensor(out, 3, qshape, NULL, F32), lt = dl_tensor(lse, 2, lshape, NULL, F32);
  DLTensor tt = dl_tensor(table, 2, tshape, NULL, I32), lent = dl_tensor(lens, 1, one, NULL, I32), qslt = dl_tensor(qsl, 1, two, NULL, I32);
  kvs_forward_args fa = {sizeof fa, 0, &qt, &kct, &vct, &tt, &lent, &qslt, NULL, &ot, &lt, 0.125f, 0, 0.0f, 1, 40, NULL, NULL};
  EXPECT(kvs_attention_forward(e, &fa), KVS_OK, "forward");
  int finite = 1;
  for (int i = 0; i < HQ * D; i++) finite &= isfinite(out[i]) != 0;
  CHECK(finite && isfinite(lse[0]), "finite output");
  for (int i = 0; i < HQ * D; i++) out[i] = 1234.0f;
  kvs_forward_args b;

  /* Sizes whose arithmetic overflows: a NULL cache of 2^62 blocks; out strides 2^62 (every row the same bytes). */
  int64_t huge_cache[4] = {BIG, BS, HK, D};
  DLTensor kbig = dl_tensor(NULL, 4, huge_cache, NULL, F32);
  b = fa;
  b.key_cache = &kbig;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_SHAPE, "NULL key cache with 2^62 blocks");
  int64_t huge_cache_strided[4] = {INT64_C(1) << 40, BS, HK, D}, zeros4[4] = {0, 0, 0, 0};
  kbig = dl_tensor(NULL, 4, huge_cache_strided, zeros4, F32);
  b.key_cache = &kbig;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_ARGUMENT, "NULL key cache with 2^40 blocks, zero strides");
  CHECK(strstr(kvs_last_error(), "NULL") != NULL, "names the NULL data: %s", kvs_last_error());
  int64_t ostr[3] = {BIG, BIG, 1};
  DLTensor obig = dl_tensor(out, 3, qshape, ostr, F32);
  int64_t q2shape[3] = {2, HQ, D};
  obig.shape = q2shape;
  b = fa;
  b.out = &obig;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_SHAPE, "out strides 2^62");
  CHECK(strstr(kvs_last_error(), "out") && strstr(kvs_last_error(), "address"), "names the overflowing extent: %s", kvs_last_error());
  int64_t ostr0[3] = {0, 0, 1};
  DLTensor oalias = dl_tensor(out, 3, qshape, ostr0, F32);
  b = fa;
  b.out = &oalias;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_SHAPE, "out rows aliasing each other");
  DLTensor qoff = qt;
  qoff.byte_offset = UINT64_MAX - 8;
  b = fa;
  b.query = &qoff;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_ARGUMENT, "byte_offset wrapping the address space");
  qoff.byte_offset = 2;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_INVALID_ARGUMENT, "query not aligned to its elements");
  CHECK(out[0] == 1234.0f, "nothing written by the failing calls");

  /* Broadcast inputs with huge extents are valid and cheap: the table row [1, 2^62] with stride 0. */
  int64_t bt_shape[2] = {1, BIG}, bt_str[2] = {0, 0};
  int32_t block0 = 1;
  DLTensor btab = dl_tensor(&block0, 2, bt_shape, bt_str, I32);
  b = fa;
  b.block_table = &btab;
  EXPECT(kvs_attention_forward(e, &b), KVS_OK, "broadcast block table with 2^62 columns");
  /* 65536 empty sequences (the limit) through broadcast metadata, and one more. */
  int64_t ns_shape[1] = {65536}, nq_shape[1] = {65537}, z1[1] = {0}, tbl_shape[2] = {65536, 1}, z2[2] = {0, 0};
  int32_t zero32 = 0;
  int64_t q0shape[3] = {0, HQ, D};
  DLTensor q0 = dl_tensor(q, 3, q0shape, NULL, F32), o0 = dl_tensor(out, 3, q0shape, NULL, F32);
  DLTensor lens_b = dl_tensor(&zero32, 1, ns_shape, z1, I32), qsl_b = dl_tensor(&zero32, 1, nq_shape, z1, I32), tbl_b = dl_tensor(&zero32, 2, tbl_shape, z2, I32);
  b = fa;
  b.query = &q0;
  b.out = &o0;
  b.lse = NULL;
  b.seq_lens = &lens_b;
  b.query_start_loc = &qsl_b;
  b.block_table = &tbl_b;
  EXPECT(kvs_attention_forward(e, &b), KVS_OK, "65536 broadcast empty sequences");
  int64_t ns2[1] = {65537}, nq2[1] = {65538}, tbl2[2] = {65537, 1};
  lens_b.shape = ns2;
  qsl_b.shape = nq2;
  tbl_b.shape = tbl2;
  EXPECT(kvs_attention_forward(e, &b), KVS_ERR_UNSUPPORTED, "65537 sequences");
  /* A zero-token output with all-zero strides (numpy's empty arrays) is valid. */
  int64_t z3[3] = {0, 0, 0};
  DLTensor o0z = dl_tensor(NULL, 3, q0shape, z3, F32);
  int32_t qsl00[2] = {0, 0};
  DLTensor qslz = dl_tensor(qsl00, 1, two, NULL, I32);
  b = fa;
  b.query = &q0;
  b.out = &o0z;
  b.lse = NULL;
  b.query_start_loc = &qslz;
  EXPECT(kvs_attention_forward(e, &b), KVS_OK, "zero-token out with all-zero strides");

  /* NaN and infinity propagate: NaN in one query head, +inf in one key row of KV head 1. */
  float q_saved = q[0];
  q[0] = NAN;
  EXPECT(kvs_attention_forward(e, &fa), KVS_OK, "forward with a NaN query element");
  int nan_row = 1, other_finite = 1;
  for (int i = 0; i < D; i++) nan_row &= isnan(out[i]) != 0;
  for (int i = D; i < HQ * D; i++) other_finite &= isfinite(out[i]) != 0;
  CHECK(nan_row && isnan(lse[0]), "head 0: NaN row and NaN lse");
  CHECK(other_finite && isfinite(lse[1]) && isfinite(lse[2]) && isfinite(lse[3]), "other heads finite");
  q[0] = q_saved;
  /* Key of position 20 (block 0, offset 4), KV head 1 = query heads 2 and 3. */
  float k_saved = kc[(0 * BS + 4) * HK * D + 1 * D + 5];
  kc[(0 * BS + 4) * HK * D + 1 * D + 5] = INFINITY;
  EXPECT(kvs_attention_forward(e, &fa), KVS_OK, "forward with an infinite key element");
  CHECK(isnan(out[2 * D]) && isnan(out[3 * D + 7]) && isnan(lse[2]) && isnan(lse[3]), "heads 2, 3: NaN");
  CHECK(isfinite(out[0]) && isfinite(out[D]) && isfinite(lse[0]) && isfinite(lse[1]), "heads 0, 1: finite");
  kc[(0 * BS + 4) * HK * D + 1 * D + 5] = k_saved;

  /* Merge: a NaN lse poisons, a -inf lse is an empty side, lse_out with stride 0 is rejected. */
  float oa[2 * D], ob[2 * D], om[2 * D], la[2] = {NAN, -INFINITY}, lb[2] = {0.5f, 1.0f}, lm[2];
  for (int i = 0; i < 2 * D; i++) oa[i] = 1.0f, ob[i] = 2.0f;
  oa[D] = NAN; /* row 1 of a is empty: its output must not be read */
  int64_t mshape[3] = {2, 1, D}, mlshape[2] = {2, 1}, lzero[2] = {0, 0};
  DLTensor oat = dl_tensor(oa, 3, mshape, NULL, F32), obt = dl_tensor(ob, 3, mshape, NULL, F32), omt = dl_tensor(om, 3, mshape, NULL, F32);
  DLTensor lat = dl_tensor(la, 2, mlshape, NULL, F32), lbt = dl_tensor(lb, 2, mlshape, NULL, F32), lmt = dl_tensor(lm, 2, mlshape, NULL, F32);
  kvs_merge_args ma = {sizeof ma, &oat, &lat, &obt, &lbt, &omt, &lmt, NULL};
  EXPECT(kvs_merge_states(e, &ma), KVS_OK, "merge");
  CHECK(isnan(om[0]) && isnan(om[D - 1]) && isnan(lm[0]), "NaN lse: NaN row");
  CHECK(om[D] == 2.0f && om[2 * D - 1] == 2.0f && lm[1] == 1.0f, "empty side ignored: %g %g", om[D], lm[1]);
  DLTensor lm0 = dl_tensor(lm, 2, mlshape, lzero, F32);
  ma.lse_out = &lm0;
  lm[1] = 42.0f;
  EXPECT(kvs_merge_states(e, &ma), KVS_ERR_INVALID_SHAPE, "merge: lse_out with stride 0");
  CHECK(lm[1] == 42.0f, "nothing written");

  /* Statistics: -1 is the totals, other negative layers are out of range. */
  kvs_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  EXPECT(kvs_engine_stats(e, -1, &s), KVS_OK, "stats totals");
  EXPECT(kvs_engine_stats(e, -2, &s), KVS_ERR_OUT_OF_RANGE, "stats layer -2");
  EXPECT(kvs_engine_stats(e, INT32_MIN, &s), KVS_ERR_OUT_OF_RANGE, "stats layer INT32_MIN");

  kvs_engine_destroy(e);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
