/* Uses only include/kvsparse.h: engine lifecycle, a cache write and a decode step checked against a
 * double-precision reference, merge of two halves, statistics, and every bad-input class the ABI promises
 * to reject without writing anything. Prints "N passed, M failed" and exits non-zero on any failure. */
#include "check.h"

#include <math.h>
#include <stdlib.h>

enum { HQ = 4, HK = 2, D = 64, BS = 16, NB = 8, NSEQ = 2, MAXB = 4 };

static DLTensor tensor(void *data, int ndim, int64_t *shape, uint8_t code, uint8_t bits) {
  return dl_tensor(data, ndim, shape, NULL, code, bits);
}

static double frand(void) { return (double)rand() / RAND_MAX * 2.0 - 1.0; }

int main(void) {
  srand(12345);
  CHECK(kvs_version() == KVS_ABI_VERSION, "version %u", kvs_version());
  CHECK(kvs_last_error() != NULL, "last_error never NULL");
  kvs_engine_destroy(NULL); /* no-op */

  kvs_engine_config cfg;
  CHECK(kvs_engine_config_init(&cfg) == KVS_OK, "config_init");
  cfg.num_layers = 1;
  cfg.num_q_heads = HQ;
  cfg.num_kv_heads = HK;
  cfg.head_dim = D;
  cfg.block_size = BS;
  cfg.dtype = KVS_DTYPE_FLOAT32;

  kvs_engine *e = (kvs_engine *)0x1;
  CHECK(kvs_engine_create(NULL, &e) == KVS_ERR_INVALID_ARGUMENT && e == NULL, "NULL config");
  CHECK(kvs_engine_create(&cfg, NULL) == KVS_ERR_INVALID_ARGUMENT, "NULL out");
  kvs_engine_config bad = cfg;
  bad.head_dim = 100;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_UNSUPPORTED, "head_dim 100");
  bad = cfg;
  bad.num_q_heads = 5;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_INVALID_ARGUMENT, "5 q heads over 2 kv heads");
  bad = cfg;
  bad.block_size = 24;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_UNSUPPORTED, "block size 24");
  bad = cfg;
  bad.policy = "nonsense(x=1)";
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_INVALID_ARGUMENT, "bad policy");
  bad = cfg;
  bad.device_type = 2; /* CUDA: not in this build or no device here */
  kvs_status st_cuda = kvs_engine_create(&bad, &e);
  if (st_cuda == KVS_OK) kvs_engine_destroy(e);
  else CHECK(st_cuda == KVS_ERR_UNSUPPORTED || st_cuda == KVS_ERR_DEVICE, "cuda without device: %d", st_cuda);
  bad = cfg;
  bad.device_type = 7;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_UNSUPPORTED, "unknown device");
  bad = cfg;
  bad.struct_size = 8;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_INVALID_ARGUMENT, "struct_size too small");
  /* `validate` was appended: a caller whose struct ends before it gets the default; a bad value fails. */
  bad = cfg;
  bad.struct_size = (uint32_t)offsetof(kvs_engine_config, validate);
  bad.validate = (kvs_validate)77; /* beyond the caller's struct: never read */
  CHECK(kvs_engine_create(&bad, &e) == KVS_OK, "config without the validate field");
  CHECK(kvs_engine_check(e, NULL) == KVS_OK, "a CPU engine has no deferred checks");
  kvs_engine_destroy(e);
  bad = cfg;
  *(int32_t *)&bad.validate = 7;
  CHECK(kvs_engine_create(&bad, &e) == KVS_ERR_INVALID_ARGUMENT, "validate 7");
  bad = cfg;
  bad.validate = KVS_VALIDATE_SYNC;
  CHECK(kvs_engine_create(&bad, &e) == KVS_OK, "validate = sync on a CPU engine");
  kvs_engine_destroy(e);
  CHECK(kvs_engine_check(NULL, NULL) == KVS_ERR_INVALID_ARGUMENT, "check of a NULL engine");

  CHECK(kvs_engine_create(&cfg, &e) == KVS_OK && e != NULL, "create");

  /* Cache and a write of every position through slot mapping (block table shuffled). */
  static float kc[NB * BS * HK * D], vc[NB * BS * HK * D];
  int64_t cshape[4] = {NB, BS, HK, D};
  DLTensor kct = tensor(kc, 4, cshape, F32), vct = tensor(vc, 4, cshape, F32);
  int32_t seq_lens[NSEQ] = {40, 17};
  int32_t table[NSEQ * MAXB] = {5, 1, 6, -1, /**/ 3, 0, -1, -1};
  int total = seq_lens[0] + seq_lens[1];
  float *nk = malloc(sizeof(float) * total * HK * D), *nv = malloc(sizeof(float) * total * HK * D);
  int64_t *slots = malloc(sizeof(int64_t) * total);
  int w = 0;
  for (int s = 0; s < NSEQ; s++)
    for (int j = 0; j < seq_lens[s]; j++, w++) {
      slots[w] = (int64_t)table[s * MAXB + j / BS] * BS + j % BS;
      for (int i = 0; i < HK * D; i++) nk[w * HK * D + i] = (float)frand(), nv[w * HK * D + i] = (float)frand();
    }
  int64_t nshape[3] = {total, HK, D}, sshape[1] = {total};
  DLTensor nkt = tensor(nk, 3, nshape, F32), nvt = tensor(nv, 3, nshape, F32), slt = tensor(slots, 1, sshape, I64);
  kvs_cache_write_args cw = {sizeof cw, 0, &nkt, &nvt, &kct, &vct, &slt, NULL};
  CHECK(kvs_cache_write(e, &cw) == KVS_OK, "cache write");
  int64_t bad_slot = slots[3];
  slots[3] = NB * BS; /* out of range: nothing may be written */
  float before = kc[0];
  CHECK(kvs_cache_write(e, &cw) == KVS_ERR_OUT_OF_RANGE && kc[0] == before, "slot out of range");
  slots[3] = bad_slot;

  /* Decode step: one query per sequence. */
  float q[NSEQ * HQ * D], out[NSEQ * HQ * D], lse[NSEQ * HQ];
  for (int i = 0; i < NSEQ * HQ * D; i++) q[i] = (float)frand() * 2.0f, out[i] = NAN;
  for (int i = 0; i < NSEQ * HQ; i++) lse[i] = NAN;
  int64_t qshape[3] = {NSEQ, HQ, D}, tshape[2] = {NSEQ, MAXB}, lshape[1] = {NSEQ}, qslshape[1] = {NSEQ + 1},
          lseshape[2] = {NSEQ, HQ};
  int32_t qsl[NSEQ + 1] = {0, 1, 2};
  uint64_t ids[NSEQ] = {77, 78};
  DLTensor qt = tensor(q, 3, qshape, F32), ot = tensor(out, 3, qshape, F32), lt = tensor(lse, 2, lseshape, F32);
  DLTensor tt = tensor(table, 2, tshape, I32), slens = tensor(seq_lens, 1, lshape, I32), qslt = tensor(qsl, 1, qslshape, I32);
  DLTensor idt = tensor(ids, 1, lshape, 1, 64);
  kvs_stats call;
  memset(&call, 0, sizeof call);
  call.struct_size = sizeof call;
  kvs_forward_args fa = {sizeof fa, 0, &qt, &kct, &vct, &tt, &slens, &qslt, &idt, &ot, &lt, 0.125f, 0, 0.0f, 1, 40, NULL, &call};
  CHECK(kvs_attention_forward(e, &fa) == KVS_OK, "forward");
  CHECK(call.calls == 1 && call.decode_rows == 2, "call stats %llu %llu", (unsigned long long)call.calls, (unsigned long long)call.decode_rows);

  double worst = 0, worst_lse = 0;
  w = 0;
  for (int s = 0; s < NSEQ; s++) {
    for (int h = 0; h < HQ; h++) {
      int kh = h / (HQ / HK);
      double logit[64], m = -INFINITY, l = 0, o[D];
      for (int j = 0; j < seq_lens[s]; j++) {
        double x = 0;
        for (int i = 0; i < D; i++) x += (double)q[(s * HQ + h) * D + i] * nk[((w + j) * HK + kh) * D + i];
        logit[j] = x * 0.125;
        if (logit[j] > m) m = logit[j];
      }
      for (int i = 0; i < D; i++) o[i] = 0;
      for (int j = 0; j < seq_lens[s]; j++) {
        double p = exp(logit[j] - m);
        l += p;
        for (int i = 0; i < D; i++) o[i] += p * nv[((w + j) * HK + kh) * D + i];
      }
      for (int i = 0; i < D; i++) {
        double err = fabs(o[i] / l - out[(s * HQ + h) * D + i]);
        if (!(err <= worst)) worst = err; /* NaN propagates */
      }
      double le = fabs(m + log(l) - lse[s * HQ + h]);
      if (!(le <= worst_lse)) worst_lse = le;
    }
    w += seq_lens[s];
  }
  CHECK(worst < 1e-5, "decode output max abs error %g", worst);
  CHECK(worst_lse < 1e-4, "decode lse max abs error %g", worst_lse);

  /* Merge: attention over sequence 0's blocks {5,1} (32 keys) and {6} (8 keys), merged, equals the whole. */
  float oa[HQ * D], ob[HQ * D], om[HQ * D], la[HQ], lb[HQ], lm[HQ];
  int32_t ta[MAXB] = {5, 1, -1, -1}, tb[MAXB] = {6, -1, -1, -1}, la_len[1] = {32}, lb_len[1] = {8}, qsl1[2] = {0, 1};
  int64_t q1shape[3] = {1, HQ, D}, t1shape[2] = {1, MAXB}, one[1] = {1}, two[1] = {2}, l1shape[2] = {1, HQ};
  DLTensor q1 = tensor(q, 3, q1shape, F32), tat = tensor(ta, 2, t1shape, I32), tbt = tensor(tb, 2, t1shape, I32);
  DLTensor lat = tensor(la_len, 1, one, I32), lbt = tensor(lb_len, 1, one, I32), q1l = tensor(qsl1, 1, two, I32);
  DLTensor oat = tensor(oa, 3, q1shape, F32), obt = tensor(ob, 3, q1shape, F32), omt = tensor(om, 3, q1shape, F32);
  DLTensor lat2 = tensor(la, 2, l1shape, F32), lbt2 = tensor(lb, 2, l1shape, F32), lmt = tensor(lm, 2, l1shape, F32);
  kvs_forward_args fa1 = {sizeof fa1, 0, &q1, &kct, &vct, &tat, &lat, &q1l, NULL, &oat, &lat2, 0.125f, 0, 0.0f, 1, 32, NULL, NULL};
  CHECK(kvs_attention_forward(e, &fa1) == KVS_OK, "forward half a");
  fa1.block_table = &tbt;
  fa1.seq_lens = &lbt;
  fa1.out = &obt;
  fa1.lse = &lbt2;
  CHECK(kvs_attention_forward(e, &fa1) == KVS_OK, "forward half b");
  kvs_merge_args ma = {sizeof ma, &oat, &lat2, &obt, &lbt2, &omt, &lmt, NULL};
  CHECK(kvs_merge_states(e, &ma) == KVS_OK, "merge");
  double merr = 0;
  for (int i = 0; i < HQ * D; i++) merr = fmax(merr, fabs(om[i] - out[i]));
  for (int h = 0; h < HQ; h++) merr = fmax(merr, fabs(lm[h] - lse[h]));
  CHECK(merr < 1e-5, "merge of halves differs from whole by %g", merr);

  /* Bad inputs: each must fail with its status and leave `out` untouched. */
  float sentinel = out[0];
  kvs_forward_args b;
#define EXPECT_FORWARD(status, what) \
  CHECK(kvs_attention_forward(e, &b) == (status) && out[0] == sentinel, "%s", what)
  CHECK(kvs_attention_forward(NULL, &fa) == KVS_ERR_INVALID_ARGUMENT, "NULL engine");
  CHECK(kvs_attention_forward(e, NULL) == KVS_ERR_INVALID_ARGUMENT, "NULL args");
  b = fa; b.query = NULL; EXPECT_FORWARD(KVS_ERR_INVALID_ARGUMENT, "NULL query");
  DLTensor q2d = qt; q2d.ndim = 2; b = fa; b.query = &q2d; EXPECT_FORWARD(KVS_ERR_INVALID_SHAPE, "2-D query");
  DLTensor qf16 = qt; qf16.dtype.bits = 16; b = fa; b.query = &qf16; EXPECT_FORWARD(KVS_ERR_INVALID_DTYPE, "fp16 query on fp32 engine");
  int64_t badstr[3] = {-1, D, 1}; DLTensor qneg = qt; qneg.strides = badstr; b = fa; b.query = &qneg; EXPECT_FORWARD(KVS_ERR_INVALID_SHAPE, "negative stride");
  DLTensor qgpu = qt; qgpu.device.device_type = 2; b = fa; b.query = &qgpu; EXPECT_FORWARD(KVS_ERR_INVALID_ARGUMENT, "query on another device");
  table[1] = NB; b = fa; EXPECT_FORWARD(KVS_ERR_OUT_OF_RANGE, "block id == num_blocks"); table[1] = 1;
  table[4] = -2; b = fa; EXPECT_FORWARD(KVS_ERR_OUT_OF_RANGE, "negative block id"); table[4] = 3;
  seq_lens[1] = MAXB * BS + 1; b = fa; EXPECT_FORWARD(KVS_ERR_OUT_OF_RANGE, "seq_len beyond the table"); seq_lens[1] = 17;
  qsl[1] = 0; qsl[2] = 2; seq_lens[1] = 1; b = fa; EXPECT_FORWARD(KVS_ERR_OUT_OF_RANGE, "query longer than sequence");
  qsl[1] = 1; seq_lens[1] = 17;
  b = fa; b.scale = -1.0f; EXPECT_FORWARD(KVS_ERR_INVALID_ARGUMENT, "negative scale");
  b = fa; b.layer = 3; EXPECT_FORWARD(KVS_ERR_OUT_OF_RANGE, "layer out of range");
  b = fa; b.struct_size = 4; EXPECT_FORWARD(KVS_ERR_INVALID_ARGUMENT, "struct_size too small");

  /* Statistics and sequence lifecycle. */
  kvs_stats tot;
  memset(&tot, 0, sizeof tot);
  tot.struct_size = sizeof tot;
  CHECK(kvs_engine_stats(e, -1, &tot) == KVS_OK && tot.calls == 3 && tot.live_sequences == 2, "stats calls %llu live %llu",
        (unsigned long long)tot.calls, (unsigned long long)tot.live_sequences);
  CHECK(kvs_engine_stats(e, 5, &tot) == KVS_ERR_OUT_OF_RANGE, "stats of a missing layer");
  CHECK(tot.pending_status == 0 && tot.sequences_created == 2, "pending %llu created %llu", (unsigned long long)tot.pending_status,
        (unsigned long long)tot.sequences_created);
  CHECK(kvs_engine_check(e, NULL) == KVS_OK, "check of a CPU engine after calls");
  CHECK(kvs_sequence_release(e, 77) == KVS_OK, "release 77");
  CHECK(kvs_sequence_release(e, 77) == KVS_ERR_UNKNOWN_SEQUENCE, "release 77 twice");
  CHECK(kvs_sequence_release(e, 12345) == KVS_ERR_UNKNOWN_SEQUENCE, "release unknown");
  CHECK(strcmp(kvs_status_name(KVS_ERR_UNKNOWN_SEQUENCE), "KVS_ERR_UNKNOWN_SEQUENCE") == 0, "status name");

  kvs_engine_destroy(e);
  free(nk);
  free(nv);
  free(slots);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
