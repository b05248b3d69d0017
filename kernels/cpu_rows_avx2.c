/* Few-row projections with AVX2 + FMA intrinsics: the block of cpu_expert.c for x86 CPUs without
   AVX-512 (chosen at run time by cpu_expert.py; compiled with a target attribute, so it is in every
   x86 build and runs only where the CPU has AVX2 and FMA).

   res[r * OB + j] = x[r] . w[o0 + j] for r < n, j < ob <= OB: OB weight rows read once from
   memory, each 8 (fp32) or 16 (bf16) columns multiplied against RT rows of x per register tile.
   cpu_expert.c's portable block runs 16-lane vectors as two AVX2 registers each, which leaves 2 rows
   per tile and widens bf16 with a convert per 8 values: on a 2-vCPU AMD EPYC (Zen 3, AVX2) one
   thread read a [7168, 1024] weight at 8.6 (fp32, 1 row) / 1.8 (fp32, 8 rows) / 3.9 GB/s (bf16,
   1 row) of a 16.2 GB/s read roof, compute-bound. This block, in bench/cpu_kernels.json (the same
   machine, roof 16.7 GB/s), reads the LM head [32000, 1024] at 1 / 2 / 8 rows at 80 / 78 / 48% of
   the roof in fp32 and 78 / 63 / 33% in bf16 (8 rows: FMA-bound). bf16 is widened two instructions
   per 16 weights: a 256-bit load holds 8 pairs (k even in the low half of each 32-bit lane, k odd
   in the high half), a shift gives the even weights as fp32 and a mask the odd ones, so x's columns
   are stored in the same order (cpu_expert.c's `bf16_order`: within each 16 columns the 8 even
   ones, then the 8 odd ones; columns past the last full 16 stay in place).

   Each output is summed in an order that depends on neither n nor the thread count: lane i of one
   accumulator takes k = i mod 8 (fp32) or the pair 2i, 2i + 1 of each 16 columns (bf16) in k
   order, then the 8 lanes in a fixed tree, then the last K % 8 (K % 16) columns in order. The
   wide tiles (from WIDE_ROWS rows on) keep that order: a bf16 chunk widened in bf16 column order
   gives each lane the same products in the same sequence. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "rows_block.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define OB 8             /* weight rows per block: 8 accumulators for one row of x (FMA latency 4 x 2 pipes) */
#define RT 2             /* x rows per register tile beyond one: 2 x OB / 2 accumulators, 2 RT x vectors */
#define CHUNK_BYTES 1024 /* of each weight row per chunk when several passes share it (8 KiB in L1) */
#define WIDE_RT 3        /* x rows per tile against fp32 weights: 3 x OB / 2 accumulators + 3 x + 1 w = 16 */
#define WIDE_ROWS 16     /* from this many rows of x on, tiles of WIDE_RT rows against a widened chunk */
#define WIDE_CHUNK 512   /* columns per chunk there: a 16 KiB buffer (FFN at 16-128 rows: 1.01-1.17x over 256) */
#define NTA_AHEAD 256    /* bytes ahead of a pair block's two streams that it prefetches (cpu_rows_avx512.c) */

/* The 8 lanes' sum: lane i + lane i + 4, then + 2, + 1. */
static inline AVX2 float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* Keeps v in a register: GCC would otherwise fold each use of a loaded x vector into its FMA as a
   memory operand, one load per FMA instead of one per vector. */
static inline AVX2 __attribute__((always_inline)) void in_register(__m256 *v) {
    __asm__("" : "+x"(*v));
}

/* acc[r0 + r][j] += x[r0 + r, k0:k1] . wp[j][k0 - wk0:k1 - wk0] for r < rt, j0 <= j < j0 + jn
   (compile-time constants in each caller, so that the accumulators live in registers; wk0: the
   column wp[j] starts at, 0 but for a widened chunk). next != 0: the step at column k also
   prefetches [next + k / step * per_step, + per_step) into L2. pair_ahead > 0 (jn 2, one row: two
   streams read once): every other step (each row's 32 bytes a step) prefetches the line pair_ahead
   bytes past where each stream reads, with the non-temporal hint. */
static inline AVX2 __attribute__((always_inline)) void tile(
    int rt, int jn, int bf16, const float *x, long ldx, int r0, int j0, long k0, long k1, const void *const *wp,
    long wk0, __m256 (*acc)[OB], const char *next, long per_step, long pair_ahead) {
    __m256 a[WIDE_RT][OB];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) a[r][j] = acc[r0 + r][j0 + j];
    const float *xr[WIDE_RT];
    for (int r = 0; r < rt; r++) xr[r] = x + (long)(r0 + r) * ldx;
    if (bf16) {
        const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u));
        for (long k = k0; k < k1; k += 16) {
            for (long b = 0; next && b < per_step; b += 64) _mm_prefetch(next + k / 16 * per_step + b, _MM_HINT_T1);
            if (pair_ahead && !(k & 31))
                for (int j = 0; j < 2; j++)
                    _mm_prefetch((const char *)((const uint16_t *)wp[j0 + j] + k) + pair_ahead, _MM_HINT_NTA);
            __m256 xe[RT], xo[RT]; /* bf16 tiles have at most RT rows */
            for (int r = 0; r < rt; r++) {
                xe[r] = _mm256_loadu_ps(xr[r] + k);
                xo[r] = _mm256_loadu_ps(xr[r] + k + 8);
                in_register(&xe[r]), in_register(&xo[r]);
            }
            for (int j = 0; j < jn; j++) {
                __m256 u = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wp[j0 + j] + k)));
                in_register(&u); /* else GCC keeps a copy on the stack for vpand's memory operand */
                __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(u), 16));
                __m256 wo = _mm256_and_ps(u, high);
                for (int r = 0; r < rt; r++) a[r][j] = _mm256_fmadd_ps(xo[r], wo, _mm256_fmadd_ps(xe[r], we, a[r][j]));
            }
        }
    } else {
        for (long k = k0; k < k1; k += 8) {
            for (long b = 0; next && b < per_step; b += 64) _mm_prefetch(next + k / 8 * per_step + b, _MM_HINT_T1);
            if (pair_ahead && !(k & 15))
                for (int j = 0; j < 2; j++)
                    _mm_prefetch((const char *)((const float *)wp[j0 + j] + k) + pair_ahead, _MM_HINT_NTA);
            __m256 xv[WIDE_RT];
            for (int r = 0; r < rt; r++) xv[r] = _mm256_loadu_ps(xr[r] + k), in_register(&xv[r]);
            for (int j = 0; j < jn; j++) {
                __m256 wv = _mm256_loadu_ps((const float *)wp[j0 + j] + k - wk0);
                in_register(&wv); /* one load for the rt FMAs, not one memory operand each */
                for (int r = 0; r < rt; r++) a[r][j] = _mm256_fmadd_ps(xv[r], wv, a[r][j]);
            }
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) acc[r0 + r][j0 + j] = a[r][j];
}

/* buf[j][0:k1 - k0] = wp[j][k0:k1] in fp32 for j < OB: an fp32 weight copied, a bf16 one widened in
   bf16 column order (each 16 columns: the 8 even ones, then the 8 odd ones, so that an fp32 tile over
   buf multiplies what the bf16 tile does in the same order: the even 8 columns' FMA, then the odd
   8's). */
static inline AVX2 void widen(const void *const *wp, int bf16, long k0, long k1, float (*buf)[WIDE_CHUNK]) {
    const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u));
    for (int j = 0; j < OB; j++) {
        if (bf16) {
            const uint16_t *from = (const uint16_t *)wp[j] + k0;
            for (long k = 0; k < k1 - k0; k += 16) {
                __m256 u = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(from + k)));
                _mm256_store_ps(buf[j] + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(u), 16)));
                _mm256_store_ps(buf[j] + k + 8, _mm256_and_ps(u, high));
            }
        } else {
            memcpy(buf[j], (const float *)wp[j] + k0, sizeof(float) * (size_t)(k1 - k0));
        }
    }
}

/* acc += the n >= WIDE_ROWS rows of x against the block wp over columns [0, kv): WIDE_CHUNK columns at
   a time, each first copied (fp32) or widened (bf16) into a buffer in L1, then WIDE_RT rows of x
   against half the buffer at a time, the first such tile prefetching the chunk's share of the next
   block into L2 step by step (`per_step` bytes per `step` columns of the weight: spread over the
   tile, not a burst at the copy: FFN 1.01-1.17x at 16-128 rows): 12 of 16 registers
   accumulating, the weight read from L1 once per tile, x once per half. The buffer is contiguous:
   straight from the weight, a block's 8 rows and a tile's 3 rows of x (4 KiB apart each at K 1024
   in fp32) share L1 sets beyond its 8 ways (one thread, [8, 1024] fp32 block, 33 rows, in L2: 33
   GFLOP/s straight vs 63 in bf16 through a buffer, AMD EPYC Zen 3). Each tile reloads and stores its
   12 accumulators, hence long chunks (a 3 x 4 tile alone in L1: 65 / 71 / 82 GFLOP/s at 256 / 512 /
   1024 columns per call, 93 never leaving registers). */
static AVX2 void wide_rows(const float *x, long ldx, int n, long kv, const void *const *wp, int bf16,
                           __m256 (*acc)[OB], const char *ahead, long per_step) {
    long per_8 = bf16 ? per_step / 2 : per_step; /* per 8 columns: the fp32 tile's step over the buffer */
    float buf[OB][WIDE_CHUNK] __attribute__((aligned(32)));
    const void *bp[OB];
    for (int j = 0; j < OB; j++) bp[j] = buf[j];
    for (long k0 = 0; k0 < kv; k0 += WIDE_CHUNK) {
        long k1 = kv - k0 < WIDE_CHUNK ? kv : k0 + WIDE_CHUNK;
        widen(wp, bf16, k0, k1, buf);
        for (int r0 = 0; r0 < n; r0 += WIDE_RT)
            if (n - r0 == 1) /* a last row alone: all OB rows at once (8 FMA chains, not 4) */
                tile(1, OB, 0, x, ldx, r0, 0, k0, k1, bp, k0, acc, 0, 0, 0);
            else
                for (int j0 = 0; j0 < OB; j0 += OB / 2) {
                    if (n - r0 >= WIDE_RT && r0 == 0 && j0 == 0)
                        tile(WIDE_RT, OB / 2, 0, x, ldx, r0, j0, k0, k1, bp, k0, acc, ahead, per_8, 0);
                    else if (n - r0 >= WIDE_RT)
                        tile(WIDE_RT, OB / 2, 0, x, ldx, r0, j0, k0, k1, bp, k0, acc, 0, 0, 0);
                    else
                        tile(2, OB / 2, 0, x, ldx, r0, j0, k0, k1, bp, k0, acc, 0, 0, 0);
                }
    }
}

/* x . row: acc's 8 lanes' sum, then the row's last columns [kv, K) in order. */
static inline AVX2 float finished(__m256 acc, const float *x, const void *row, int bf16, long kv, long K) {
    float s = hsum8(acc);
    for (long k = kv; k < K; k++) s += x[k] * bf16_or_float(row, k, bf16);
    return s;
}

/* The rows [o0, o0 + ob) of w [O, K] (fp32, or bf16 with x in bf16 column order) against the n
   rows of x: one row of x runs over the whole weight row with all OB weight rows at once (bf16: two
   at a time, fewer streams for the prefetchers: a 2-expert decode FFN call at issue 25's shapes,
   median of 6 interleaved runs 3.98 -> 3.83 ms, 1 thread, AMD EPYC 2 vCPU); more
   rows take turns, RT rows against half the block at a time, chunk by chunk, the later passes
   finding the chunk in L1; from WIDE_ROWS rows on (prefill), `wide_rows`. */
AVX2 void flowmoe_block_avx2(const float *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                             const void *next, long next_rows, float *res) {
    int esize = bf16 ? 2 : 4, step = bf16 ? 16 : 8;
    long kv = K / step * step, chunk = n == 1 ? (kv > 0 ? kv : 1) : CHUNK_BYTES / esize;
    const void *wp[OB];
    block_rows(wp, OB, w, o0, ob, K, esize);
    __m256 acc[n][OB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = _mm256_setzero_ps();
    /* the next block's bytes, spread over this block's steps (prefetched into L2 by the first pass
       over each chunk): one sequential stream for the hardware to follow, where the block's OB rows
       of a short K (2 KiB in bf16 at K 1024) end before its prefetchers have picked them up */
    long steps = kv / step > 0 ? kv / step : 1, per_step = (next_rows * K * esize / steps + 63) / 64 * 64;
    /* fp32 below WIDE_ROWS rows prefetches nothing: its rows (4 KiB, a page, at K 1024) are streamed
       by the hardware, which the prefetches only competed with: an FFN over 16 experts' huge-page
       weights at issue 25's shapes, 1 thread, AMD EPYC Zen 3 2 vCPU, medians of 6-12 interleaved
       rounds: 1 row 1.18x, 2 rows 1.12x, 4 / 8 / 12 rows 1.05-1.06x; bf16 without them: 0.55x */
    const char *ahead = next_rows > 0 && (bf16 || n >= WIDE_ROWS) ? (const char *)next : 0;
    if (n >= WIDE_ROWS) wide_rows(x, ldx, n, kv, wp, bf16, acc, ahead, per_step);
    for (long k0 = 0; n < WIDE_ROWS && k0 < kv; k0 += chunk) {
        long k1 = kv - k0 < chunk ? kv : k0 + chunk;
        if (n == 1 && bf16) /* two weight rows at a time, each pair prefetching its share of the next block */
            for (int j0 = 0; j0 < OB; j0 += 2) {
                long share = (per_step * steps / (OB / 2) + 63) / 64 * 64, pair_step = (share / steps + 63) / 64 * 64;
                tile(1, 2, 1, x, ldx, 0, j0, k0, k1, wp, 0, acc, ahead ? ahead + j0 / 2 * share : 0, pair_step, 0);
            }
        else if (n == 1)
            tile(1, OB, 0, x, ldx, 0, 0, k0, k1, wp, 0, acc, ahead, per_step, 0);
        for (int r0 = 0; n > 1 && r0 < n; r0 += RT)
            for (int j0 = 0; j0 < OB; j0 += OB / 2) {
                const char *pf = r0 == 0 && j0 == 0 ? ahead : 0;
                if (n - r0 == 1 && bf16)
                    tile(1, OB / 2, 1, x, ldx, r0, j0, k0, k1, wp, 0, acc, pf, per_step, 0);
                else if (n - r0 == 1)
                    tile(1, OB / 2, 0, x, ldx, r0, j0, k0, k1, wp, 0, acc, pf, per_step, 0);
                else if (bf16)
                    tile(RT, OB / 2, 1, x, ldx, r0, j0, k0, k1, wp, 0, acc, pf, per_step, 0);
                else
                    tile(RT, OB / 2, 0, x, ldx, r0, j0, k0, k1, wp, 0, acc, pf, per_step, 0);
            }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) res[r * OB + j] = finished(acc[r][j], x + r * ldx, wp[j], bf16, kv, K);
}

/* One row x [K] against rows [o0, o0 + ob) of w [O, K] (fp32, or bf16 with x in bf16 column order)
   and the same rows `apart` on (gate's and up's, or a block of a matrix's first half and of its
   second): res[m * OB + j] = x . w[o0 + m apart + j], m < 2, each summed as flowmoe_block_avx2 sums
   it. Each tile takes one row of each: two streams in address order through the two spans, which the
   hardware prefetchers follow (a one-matrix block's rows are short streams that end every OB rows).
   Both prefetch each stream's lines NTA_AHEAD bytes ahead non-temporally (cpu_rows_avx512.c's
   notes): with the AVX2 kernels forced on the 2-vCPU Zen 4 there, issue 25's checkpoint, batch 1,
   1 thread, eager, the step took 0.92x (bf16; against a temporal line 4 KiB ahead, the two streams'
   in turn) and 0.87x (fp32; against no software prefetch: 4 or 8 KiB ahead temporally measured
   0.91x, as in flowmoe_block_avx2), 512 bytes ahead 0.91x / 0.92x. */
AVX2 void flowmoe_pair_block_avx2(const float *x, long K, const void *w, int bf16, long o0, int ob, long apart,
                                  float *res) {
    int esize = bf16 ? 2 : 4, step = bf16 ? 16 : 8;
    long kv = K / step * step;
    const void *wp[2 * OB]; /* entry 2 j + m: row o0 + m apart + j (a short block repeats its last row) */
    for (int j = 0; j < OB; j++)
        for (int m = 0; m < 2; m++) wp[2 * j + m] = (const char *)w + (o0 + m * apart + (j < ob ? j : ob - 1)) * K * esize;
    __m256 acc[2][OB]; /* entry i: acc[i / OB][i % OB] */
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < OB; j++) acc[h][j] = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++)
        for (int j0 = 0; j0 < OB; j0 += 2)
            if (bf16)
                tile(1, 2, 1, x, 0, 0, j0, 0, kv, wp + h * OB, 0, acc + h, 0, 0, NTA_AHEAD);
            else
                tile(1, 2, 0, x, 0, 0, j0, 0, kv, wp + h * OB, 0, acc + h, 0, 0, NTA_AHEAD);
    for (int i = 0; i < 2 * OB; i++)
        if (i / 2 < ob) res[i % 2 * OB + i / 2] = finished(acc[i / OB][i % OB], x, wp[i], bf16, kv, K);
}
