/* Few-row projections with AVX-512 intrinsics: the block of cpu_expert.c for x86 CPUs with AVX-512F,
   BW and BF16 (chosen at run time by cpu_expert.py; compiled with a target attribute, so it is in
   every x86 build and runs only where the CPU has them).

   res[r * OB + j] = x[r] . w[o0 + j] for r < n, j < ob <= OB: OB weight rows read once from memory,
   each 16 (fp32) or 32 (bf16) columns multiplied against up to RT rows of x per register tile (32
   registers: RT x OB accumulators, RT x vectors, one weight vector).
   fp32 weights: one FMA per row and 16 columns. bf16 weights: x comes in bf16 too, and one
   `vdpbf16ps` per row multiplies 32 columns (lane i: the pair 2i, 2i + 1), no widening: a bf16
   model's x (the projections' inputs, the experts' gate / up input) is bf16 already, so that is
   exact; the experts' activation (the down projection's input) comes rounded to bf16, as
   transformers' bf16 forward and llama.cpp's BF16 path round it (cpu_expert.c's notes).
   vdpbf16ps treats bf16 subnormal inputs as zero and flushes subnormal results.

   Each output is summed in an order that depends on neither n nor the thread count: lane i of one
   accumulator takes k = i mod 16 (fp32) or the pair 2i, 2i + 1 of each 32 columns (bf16) in k
   order, then the 16 lanes in a fixed tree, then the last K % 16 (K % 32) columns in
   order.

   Weights read once (the pair blocks; tiles of at most RT rows) are prefetched NTA_AHEAD bytes
   ahead of each stream with the non-temporal hint, a line every 64 bytes: lines so fetched do not
   displace the caches' other lines, where a decode step's weights (~460 MB at bf16 for issue 25's
   checkpoint) streamed through the caches otherwise evict everything between two kernels: the
   interpreter's, the runtime's and the KV cache's lines, so that the Python between the kernels ran
   at ~3x its warm cost. 2-vCPU Zen 4, that checkpoint, bf16 batch 1, 1 thread, eager, alternated:
   step 0.86-0.89x with 128-384 bytes ahead, 0.96x at 512; the gate node's own time 0.55 -> 0.28 ms
   a step, outside the nodes 1.6-2.0 -> 1.0-1.2 (bench/decode_profile.py). The several-row tiles
   read each chunk again from L1 and keep their temporal prefetch. */

#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "rows_block.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define OB 8             /* weight rows per block, as cpu_rows_avx2.c's */
#define RT 3             /* x rows per register tile: 3 x OB accumulators + 3 x + 1 w <= 32 */
#define CHUNK_BYTES 1024 /* of each weight row per chunk when several tiles share it (8 KiB in L1) */
#define PAIR_ROWS 2      /* the most rows of x a pair block takes */
#define NTA_AHEAD 256    /* bytes ahead of each weight stream read once that a block prefetches (below) */

/* The 16 lanes' sum: lane i + lane i + 8, then + 4, + 2, + 1. */
static inline AVX512 float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* Keeps v in a register (one load per vector, not a memory operand per use). */
static inline AVX512 __attribute__((always_inline)) void in_register(__m512i *v) {
    __asm__("" : "+v"(*v));
}

static inline AVX512 __attribute__((always_inline)) __m512bh as_bf16(__m512i v) {
    return (__m512bh)v;
}

/* acc[r0 + r][j0 + j] += x[r0 + r, k0:k1] . wp[j0 + j][k0:k1] for r < rt, j < jn (compile-time
   constants in each caller, so that the accumulators live in registers). x: fp32 rows against an
   fp32 weight, bf16 rows against a bf16 one. once: the block reads the weight's lines only here
   (prefetched non-temporally, NTA_AHEAD bytes ahead). next != 0: the step at column k also
   prefetches [next + k / step * per_step, + per_step) into L2. */
static inline AVX512 __attribute__((always_inline)) void tile(
    int rt, int jn, int bf16, int once, const void *x, long ldx, int r0, int j0, long k0, long k1,
    const void *const *wp, __m512 (*acc)[OB], const char *next, long per_step) {
    int step = bf16 ? 32 : 16, esize = bf16 ? 2 : 4;
    __m512 a[RT][OB];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) a[r][j] = acc[r0 + r][j0 + j];
    const char *xr[RT];
    for (int r = 0; r < rt; r++) xr[r] = (const char *)x + (long)(r0 + r) * ldx * esize;
    for (long k = k0; k < k1; k += step) {
        for (long b = 0; next && b < per_step; b += 64) _mm_prefetch(next + k / step * per_step + b, _MM_HINT_T1);
        __m512i xv[RT];
        for (int r = 0; r < rt; r++) xv[r] = _mm512_loadu_si512(xr[r] + k * esize), in_register(&xv[r]);
        for (int j = 0; j < jn; j++) {
            if (once) _mm_prefetch((const char *)wp[j0 + j] + k * esize + NTA_AHEAD, _MM_HINT_NTA);
            __m512i wv = _mm512_loadu_si512((const char *)wp[j0 + j] + k * esize);
            in_register(&wv);
            for (int r = 0; r < rt; r++)
                a[r][j] = bf16 ? _mm512_dpbf16_ps(a[r][j], as_bf16(xv[r]), as_bf16(wv))
                               : _mm512_fmadd_ps(_mm512_castsi512_ps(xv[r]), _mm512_castsi512_ps(wv), a[r][j]);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) acc[r0 + r][j0 + j] = a[r][j];
}

/* acc[r][j0 + j] += x[r, 0:kv] . wp[j0 + j][0:kv] for r < rt <= PAIR_ROWS, j < 2 (as `tile` with
   jn 2) in 256-bit halves: lanes 0-7 of acc in one accumulator, 8-15 in another, the same sums in
   the same order as `tile`'s, with the loads of cpu_rows_avx2.c (32 bytes of each row a step: on
   the Zen 4 of cpu_expert.py's notes fp32 1.1-1.3x over 64, whose AVX-512 loads are two 256-bit
   ones). */
static inline AVX512 __attribute__((always_inline)) void halves(int rt, int bf16, const void *x, long ldx, int j0,
                                                                long kv, const void *const *wp, __m512 (*acc)[2 * OB]) {
    int step = bf16 ? 32 : 16, esize = bf16 ? 2 : 4;
    __m256 a[PAIR_ROWS][2][2];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < 2; j++)
            a[r][j][0] = _mm512_castps512_ps256(acc[r][j0 + j]), a[r][j][1] = _mm512_extractf32x8_ps(acc[r][j0 + j], 1);
    for (long k = 0; k < kv; k += step)
        for (int h = 0; h < 2; h++) {
            long at = (k + step / 2 * h) * esize;
            if (h == 0)
                for (int j = 0; j < 2; j++) _mm_prefetch((const char *)wp[j0 + j] + at + NTA_AHEAD, _MM_HINT_NTA);
            __m256i xv[PAIR_ROWS];
            for (int r = 0; r < rt; r++)
                xv[r] = _mm256_loadu_si256((const __m256i *)((const char *)x + r * ldx * esize + at));
            for (int j = 0; j < 2; j++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)((const char *)wp[j0 + j] + at));
                for (int r = 0; r < rt; r++)
                    a[r][j][h] = bf16 ? _mm256_dpbf16_ps(a[r][j][h], (__m256bh)xv[r], (__m256bh)wv)
                                      : _mm256_fmadd_ps(_mm256_castsi256_ps(xv[r]), _mm256_castsi256_ps(wv),
                                                        a[r][j][h]);
            }
        }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < 2; j++)
            acc[r][j0 + j] = _mm512_insertf32x8(_mm512_castps256_ps512(a[r][j][0]), a[r][j][1], 1);
}

/* x . row: acc's 16 lanes' sum, then the row's last columns [kv, K) in order. */
static inline AVX512 float finished(__m512 acc, const void *x, const void *row, int bf16, long kv, long K) {
    float s = hsum16(acc);
    for (long k = kv; k < K; k++)
        s += bf16_or_float(x, k, bf16) * bf16_or_float(row, k, bf16);
    return s;
}

/* Tiles of RT rows (the last shorter) of x against all OB rows of the block over [k0, k1), each
   with its own constant height; the first prefetches `pf` (see `tile`). */
static inline AVX512 __attribute__((always_inline)) void tiles(
    int bf16, const void *x, long ldx, int n, long k0, long k1, const void *const *wp, __m512 (*acc)[OB],
    const char *pf, long per_step) {
    int once = n <= RT;
    for (int r0 = 0; r0 < n; r0 += RT) {
        const char *ahead = r0 == 0 ? pf : 0;
        switch (n - r0 < RT ? n - r0 : RT) {
        case 1: tile(1, OB, bf16, once, x, ldx, r0, 0, k0, k1, wp, acc, ahead, per_step); break;
        case 2: tile(2, OB, bf16, once, x, ldx, r0, 0, k0, k1, wp, acc, ahead, per_step); break;
        default: tile(RT, OB, bf16, once, x, ldx, r0, 0, k0, k1, wp, acc, ahead, per_step); break;
        }
    }
}

/* The rows [o0, o0 + ob) of w [O, K] (fp32 with fp32 x; bf16 with bf16 x)
   against the n rows of x (row stride ldx elements): one row of x runs over the whole weight row,
   fp32 with all OB weight rows at once, bf16 two at a time (fewer streams for the prefetchers, as
   in cpu_rows_avx2.c), each pair prefetching its share of the next block (`next_rows` rows from
   `next`) into L2; more rows take turns, RT rows against the block at a time, chunk by chunk, the
   later tiles finding the chunk in L1 and the first prefetching the next block. */
AVX512 void flowmoe_block_avx512(const void *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                                 const void *next, long next_rows, float *res) {
    int esize = bf16 ? 2 : 4, step = bf16 ? 32 : 16;
    long kv = K / step * step, chunk = n == 1 ? (kv > 0 ? kv : 1) : CHUNK_BYTES / esize;
    const void *wp[OB];
    block_rows(wp, OB, w, o0, ob, K, esize);
    __m512 acc[n][OB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = _mm512_setzero_ps();
    long steps = kv / step > 0 ? kv / step : 1, per_step = (next_rows * K * esize / steps + 63) / 64 * 64;
    const char *ahead = next_rows > 0 && bf16 ? (const char *)next : 0; /* fp32: the hardware's (AVX2's notes) */
    for (long k0 = 0; k0 < kv; k0 += chunk) {
        long k1 = kv - k0 < chunk ? kv : k0 + chunk;
        if (n == 1 && bf16) {
            long share = (per_step * steps / (OB / 2) + 63) / 64 * 64, pair_step = (share / steps + 63) / 64 * 64;
            for (int j0 = 0; j0 < OB; j0 += 2)
                tile(1, 2, 1, 1, x, ldx, 0, j0, k0, k1, wp, acc, ahead ? ahead + j0 / 2 * share : 0, pair_step);
        } else if (bf16) {
            tiles(1, x, ldx, n, k0, k1, wp, acc, ahead, per_step);
        } else {
            tiles(0, x, ldx, n, k0, k1, wp, acc, ahead, per_step);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++)
            res[r * OB + j] = finished(acc[r][j], (const char *)x + r * ldx * esize, wp[j], bf16, kv, K);
}

/* n <= PAIR_ROWS rows of x (as for flowmoe_block_avx512) against rows [o0, o0 + ob) of w [O, K]
   and the same rows `apart` on (gate's and up's, or a block of a matrix's first half and of its
   second): res[(m n + r) OB + j] = x[r] . w[o0 + m apart + j], m < 2, each summed as
   flowmoe_block_avx512 sums it. Each tile takes one row of each: two streams in address order,
   which the hardware prefetchers follow, with no prefetch into the caches (cpu_rows_avx2.c's bf16
   line 4 KiB ahead per stream: on the Zen 4 of cpu_expert.py's notes, 1 thread, from DRAM, the
   expert FFN and the LM head read at 59-69% of the read roof with it, 84-90% without:
   bench/expert_rows.py, 1.24x / 1.27x), only the non-temporal one NTA_AHEAD bytes ahead. */
AVX512 void flowmoe_pair_block_avx512(const void *x, long ldx, int n, long K, const void *w, int bf16, long o0,
                                      int ob, long apart, float *res) {
    int esize = bf16 ? 2 : 4, step = bf16 ? 32 : 16;
    long kv = K / step * step;
    const void *wp[2 * OB]; /* entry 2 j + m: row o0 + m apart + j (a short block repeats its last row) */
    for (int j = 0; j < OB; j++)
        for (int m = 0; m < 2; m++) wp[2 * j + m] = (const char *)w + (o0 + m * apart + (j < ob ? j : ob - 1)) * K * esize;
    __m512 acc[PAIR_ROWS][2 * OB];
    for (int r = 0; r < n; r++)
        for (int i = 0; i < 2 * OB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int j0 = 0; j0 < 2 * OB; j0 += 2)
        if (n == 1 && bf16)
            halves(1, 1, x, ldx, j0, kv, wp, acc);
        else if (n == 1)
            halves(1, 0, x, ldx, j0, kv, wp, acc);
        else if (bf16)
            halves(2, 1, x, ldx, j0, kv, wp, acc);
        else
            halves(2, 0, x, ldx, j0, kv, wp, acc);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < 2 * OB; i++)
            if (i / 2 < ob)
                res[(i % 2 * n + r) * OB + i / 2] =
                    finished(acc[r][i], (const char *)x + r * ldx * esize, wp[i], bf16, kv, K);
}
