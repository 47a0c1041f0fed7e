/* One decode step of a 4-layer model through kvsparse's C ABI, with the Quest policy: each layer's
 * prompt K/V (random bfloat16 here; your model's in practice) goes into a paged cache by slot mapping,
 * then the new token of each of two sequences is written and attended. Prints the KV blocks each layer
 * read (policies run dense on the first `dense_layers`, 2 by default). Build: README.md, "Using the
 * library from C". */
#include "kvsparse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 4, HQ = 8, HK = 2, D = 128, BS = 16, NUM_BLOCKS = 64, SEQS = 2, MAX_BLOCKS = 32 };

#define CHECK(call)                                                                              \
  do {                                                                                           \
    kvs_status st_ = (call);                                                                     \
    if (st_ != KVS_OK) {                                                                         \
      fprintf(stderr, "%s failed: %s: %s\n", #call, kvs_status_name(st_), kvs_last_error()); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

static uint16_t bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void fill_random(uint16_t *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = bf16((float)rand() / (float)RAND_MAX * 2.0f - 1.0f);
}

/* A DLTensor view of a compact row-major CPU buffer (strides NULL). */
static DLTensor view(void *data, int ndim, int64_t *shape, int code, int bits) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = KVS_DL_CPU;
  t.ndim = ndim;
  t.shape = shape;
  t.dtype.code = (uint8_t)code;
  t.dtype.bits = (uint8_t)bits;
  t.dtype.lanes = 1;
  return t;
}

int main(void) {
  kvs_engine_config cfg;
  CHECK(kvs_engine_config_init(&cfg)); /* defaults: CPU, dense, all cores */
  cfg.num_layers = LAYERS;
  cfg.num_q_heads = HQ;
  cfg.num_kv_heads = HK;
  cfg.head_dim = D;
  cfg.block_size = BS;
  cfg.dtype = KVS_DTYPE_BFLOAT16;
  cfg.policy = "quest(budget=128)"; /* NULL or "" = dense */
  kvs_engine *e;
  CHECK(kvs_engine_create(&cfg, &e));

  /* Per layer: K and V caches [NUM_BLOCKS, BS, HK, D] (vLLM's flash layout). */
  size_t cache_elems = (size_t)NUM_BLOCKS * BS * HK * D;
  uint16_t *caches = calloc(2 * LAYERS * cache_elems, sizeof(uint16_t));
  int64_t cache_shape[4] = {NUM_BLOCKS, BS, HK, D};

  /* Prompts of 500 and 300 tokens; sequence s owns blocks s, s+2, s+4, ... (any table works). */
  int32_t prompt[SEQS] = {500, 300}, table[SEQS][MAX_BLOCKS];
  for (int s = 0; s < SEQS; s++)
    for (int j = 0; j < MAX_BLOCKS; j++) table[s][j] = s + SEQS * j;
  int n = prompt[0] + prompt[1];
  int64_t *slots = malloc(sizeof(int64_t) * n);
  for (int s = 0, i = 0; s < SEQS; s++)
    for (int p = 0; p < prompt[s]; p++, i++) slots[i] = (int64_t)table[s][p / BS] * BS + p % BS;
  uint16_t *k = malloc(sizeof(uint16_t) * n * HK * D), *v = malloc(sizeof(uint16_t) * n * HK * D);

  /* The decode step's tensors: one new token per sequence at position prompt[s]. */
  int32_t seq_lens[SEQS] = {prompt[0] + 1, prompt[1] + 1}, query_start_loc[SEQS + 1] = {0, 1, 2};
  int64_t new_slots[SEQS], seq_ids[SEQS] = {1001, 1002};
  for (int s = 0; s < SEQS; s++) new_slots[s] = (int64_t)table[s][prompt[s] / BS] * BS + prompt[s] % BS;
  uint16_t q[SEQS * HQ * D], out[SEQS * HQ * D], k1[SEQS * HK * D], v1[SEQS * HK * D];
  int64_t rows_shape[3] = {n, HK, D}, slots_shape[1] = {n}, new_shape[3] = {SEQS, HK, D}, seqs_shape[1] = {SEQS};
  int64_t q_shape[3] = {SEQS, HQ, D}, table_shape[2] = {SEQS, MAX_BLOCKS}, qsl_shape[1] = {SEQS + 1};
  DLTensor kt = view(k, 3, rows_shape, KVS_DL_BFLOAT, 16), vt = view(v, 3, rows_shape, KVS_DL_BFLOAT, 16);
  DLTensor slots_t = view(slots, 1, slots_shape, KVS_DL_INT, 64), new_slots_t = view(new_slots, 1, seqs_shape, KVS_DL_INT, 64);
  DLTensor k1t = view(k1, 3, new_shape, KVS_DL_BFLOAT, 16), v1t = view(v1, 3, new_shape, KVS_DL_BFLOAT, 16);
  DLTensor qt = view(q, 3, q_shape, KVS_DL_BFLOAT, 16), outt = view(out, 3, q_shape, KVS_DL_BFLOAT, 16);
  DLTensor table_t = view(table, 2, table_shape, KVS_DL_INT, 32), lens_t = view(seq_lens, 1, seqs_shape, KVS_DL_INT, 32);
  DLTensor qsl_t = view(query_start_loc, 1, qsl_shape, KVS_DL_INT, 32), ids_t = view(seq_ids, 1, seqs_shape, KVS_DL_INT, 64);

  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    uint16_t *kc = caches + 2 * layer * cache_elems, *vc = kc + cache_elems;
    DLTensor kct = view(kc, 4, cache_shape, KVS_DL_BFLOAT, 16), vct = view(vc, 4, cache_shape, KVS_DL_BFLOAT, 16);
    /* The prompt's K/V (in a real engine: written by the prefill's attention calls). */
    fill_random(k, (size_t)n * HK * D);
    fill_random(v, (size_t)n * HK * D);
    kvs_cache_write_args w = {sizeof w, layer, &kt, &vt, &kct, &vct, &slots_t, NULL};
    CHECK(kvs_cache_write(e, &w));
    /* Decode: the new token's K/V, then attention of its query over the whole sequence. */
    fill_random(k1, sizeof k1 / sizeof k1[0]);
    fill_random(v1, sizeof v1 / sizeof v1[0]);
    fill_random(q, sizeof q / sizeof q[0]);
    kvs_cache_write_args w1 = {sizeof w1, layer, &k1t, &v1t, &kct, &vct, &new_slots_t, NULL};
    CHECK(kvs_cache_write(e, &w1));
    kvs_stats call;
    memset(&call, 0, sizeof call);
    call.struct_size = sizeof call;
    kvs_forward_args a = {sizeof a, layer, &qt, &kct, &vct, &table_t, &lens_t, &qsl_t, &ids_t, &outt,
                          /*lse*/ NULL, /*scale*/ 0.08838835f /* 1/sqrt(D) */, /*sliding_window*/ 0,
                          /*softcap*/ 0.0f, /*max_query_len*/ 1, /*max_seq_len*/ 0, /*stream*/ NULL, &call};
    CHECK(kvs_attention_forward(e, &a));
    if (call.policy_rows == 0)
      printf("layer %u: dense (the policy's dense_layers)\n", layer);
    else
      printf("layer %u: read %llu of %llu KV blocks\n", layer, (unsigned long long)call.blocks_visited,
             (unsigned long long)call.blocks_eligible);
  }
  for (int s = 0; s < SEQS; s++) CHECK(kvs_sequence_release(e, (uint64_t)seq_ids[s])); /* requests end */
  kvs_engine_destroy(e);
  free(caches);
  free(slots);
  free(k);
  free(v);
  return 0;
}
