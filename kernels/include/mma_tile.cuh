// The tensor-core decode kernel's tile geometry (kernels/attention_mma.cu, and a traversal hook that
// reads its fragments): threads, padded shared-memory rows and tiles, stage sizes, and the FP8 path's
// V^T word layout. Needs the kernel's compile-time parameters (HEAD_DIM, GQ, NWARPS, NSTAGE, KV8).
#pragma once

#define NTHREADS (NWARPS * 32)
#define CPR (HEAD_DIM / 8)          // 16-byte chunks per K/V row
#if KV8
// A padded shared-memory row of FP8 bytes (plan::MmaShape::smem_bytes): a multiple of 128 plus 16, so the
// 8 rows a fragment read touches start 4 banks apart (no bank conflicts) at every head size.
#define ROWB ((HEAD_DIM + 127) / 128 * 128 + 16)
#else
#define ROWB (HEAD_DIM * 2 + 16)    // padded shared-memory row, bytes
#endif
#define TILEB (16 * ROWB)           // one 16-key tile of K (or V)
#define KSTEPS (HEAD_DIM / 16)
#define NT (HEAD_DIM / 8)
#define STAGE_BYTES (NWARPS * NSTAGE * 2 * TILEB)
#define MERGE_BYTES (NWARPS * GQ * (HEAD_DIM + 2) * 4)
#define SMEM_BYTES (STAGE_BYTES > MERGE_BYTES ? STAGE_BYTES : MERGE_BYTES)
#if KV8
#define CPR8 (HEAD_DIM / 16)  // 16-byte chunks per FP8 row
// V^T tiles (header): lane c's word g (kv8_vw) holds rows c, c + 8 of channel tiles 2 g and 2 g + 1
// (bytes 0, 1 and 2, 3); a head size that is an odd multiple of 16 ends with one tile over 16 channels read
// as 16-bit halves (lane c: channels 32 KV8_G + 2 c, + 1).
#define KV8_G (HEAD_DIM / 32)  // whole 32-channel groups: V words per lane and key
#define KV8_GF (KV8_G / 4)       // whole 128-channel blocks (4 words, 16 bytes, per lane)
#define KV8_GR (KV8_G % 4)       // words per lane in the last, partial block
// Byte offset in a V row of lane c's word g: per block of 128 channels the lane's words are contiguous
// (8 lanes x 16 bytes; the partial block 8 lanes x 4 KV8_GR bytes), conflict-free over the quarter-warps
// of a 16-byte load with the padded rows (ROWB).
__device__ __forceinline__ int kv8_vw(int g, int c) { return 128 * (g >> 2) + 4 * ((g >> 2) < KV8_GF ? 4 : KV8_GR) * c + 4 * (g & 3); }
#define KV8_MT (HEAD_DIM / 16)   // 16-channel tiles of O^T (transposed PV, header)
#define KV8_HH (GQ > 8 ? 2 : 1)    // halves of the CTA's query heads (the N = 8 side of an O^T tile)
#endif
