/* Few-row projections and expert FFNs on the CPU at memory speed (built by cpu_expert.py).

   y[r, o] = sum_k x[r, k] * w[o, k] for a few rows r of x (fp32) against a row-major weight w
   [O, K] in fp32 or bf16, accumulated in fp32. The weight is the big operand: each block of OB
   weight rows is read from memory once, KC columns at a time, and multiplied there against every
   row of x, RT rows per register tile (bf16 weights are widened to fp32 in registers).
   Each product is summed in a fixed order that depends on neither the number of rows nor the
   thread count: 16 lanes over k, one lane per k mod 16, then the lanes in a fixed tree (hsum).

   Written with GCC vector extensions: one AVX-512 register per vector with -march=native on an
   AVX-512 CPU, two AVX2 registers elsewhere. `isa` = 1 takes cpu_rows_avx2.c's block instead (AVX2
   + FMA intrinsics; x in bf16 column order for a bf16 weight), `isa` = 2 cpu_rows_avx512.c's
   (AVX-512 + BF16; x in bf16 for a bf16 weight, the FFN's activation rounded to bf16 as
   transformers' bf16 forward rounds it), which the entry points here arrange; the caller's choice
   by the CPU's features (cpu_expert.py). Threads: OpenMP over blocks of weight rows, with the
   thread count the caller passes (torch's, so that both share one pool of workers).

   One row (a decode step's): a gate / up block takes gate's rows and up's together, and down's and a
   linear's blocks pair a block of the matrix's first half with the same block of its second half
   (`paired`), so that cpu_rows_avx2.c's pair block reads one row of each at a time: two streams in
   address order through whole matrices, which the hardware prefetchers follow, where a block of one
   matrix is short streams that end every few rows. 1 thread, AMD EPYC Zen 3 2 vCPU at load 6-8
   (bench/expert_rows.py, 15 rounds alternated against one-matrix blocks, medians): 16 experts' 1024
   x 3584 FFNs from DRAM, bf16 1.69 -> 1.49 ms, 1.14x; fp32 1.05x (already near the read roof); the
   LM head [32000, 1024]: bf16 1.22x, fp32 1.11x; the same bits. Several rows keep their blocks. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "shares.h"
#include "swiglu.h"

/* cpu_rows_avx2.c */
void flowmoe_block_avx2(const float *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                        const void *next, long next_rows, float *res);
void flowmoe_pair_block_avx2(const float *x, long K, const void *w, int bf16, long o0, int ob, long apart,
                             float *res);
/* cpu_rows_avx512.c */
void flowmoe_block_avx512(const void *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                          const void *next, long next_rows, float *res);
void flowmoe_pair_block_avx512(const void *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                               long apart, float *res);

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define VL 16  /* lanes per vector */
#define OB 4   /* weight rows per block */
#define KC 128 /* columns per chunk of a block (measured best of 128-2048 at 16 rows) */
#ifdef __AVX512F__
#define RT 6 /* x rows per register tile: OB * RT accumulators + OB weights + 1 x in 32 registers */
#else
#define RT 2 /* with 16 AVX2 registers (a v16 is two of them) */
#endif

static inline v16 load_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 load_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* The 16 lanes' sum as a fixed tree: lane i + lane i + 8, then + 4, + 2, + 1 (a left-to-right
   scalar sum of the lanes measured up to a third slower at 16 rows, where every block ends in
   rows x OB of these). */
static inline float hsum(v16 v) {
    v8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    v8 a = lo + hi;
    v4 l4, h4;
    memcpy(&l4, &a, sizeof l4);
    memcpy(&h4, (const char *)&a + sizeof l4, sizeof h4);
    v4 b = l4 + h4;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((always_inline)) v16 load_w(const void *p, long i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

/* acc[r0 + r][j] += x[r0 + r, k0:k0+kc] . w_j[0:kc] for r < rt, with w_j = wp[j]: one register tile.
   pf > 0: each step also prefetches every w_j pf bytes ahead of what it reads; next != 0: step i
   also prefetches [next + i * step, next + (i + 1) * step) into L2 (the block read next). */
static inline __attribute__((always_inline)) void tile(
    int rt, int bf16, const float *x, long ldx, int r0, long k0, long kc, const void *const *wp, v16 (*acc)[OB],
    int pf, const char *next, long step) {
    v16 a[RT][OB];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < OB; j++) a[r][j] = acc[r0 + r][j];
    for (long k = 0; k < kc; k += VL) {
        v16 w[OB];
        if (pf)
            for (int j = 0; j < OB; j++) __builtin_prefetch((const char *)wp[j] + k * (bf16 ? 2 : 4) + pf, 0, 3);
        if (next)
            for (long b = k / VL * step / 64 * 64; b < (k / VL + 1) * step; b += 64) __builtin_prefetch(next + b, 0, 2);
        for (int j = 0; j < OB; j++) w[j] = load_w(wp[j], k, bf16);
        for (int r = 0; r < rt; r++) {
            v16 xv = load_f32(x + (long)(r0 + r) * ldx + k0 + k);
            for (int j = 0; j < OB; j++) a[r][j] += xv * w[j];
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < OB; j++) acc[r0 + r][j] = a[r][j];
}

/* One tile of rt <= RT rows starting at row r0 (constant tile heights, so that the accumulators
   stay in registers). */
static inline __attribute__((always_inline)) void tile_rt(
    int rt, int bf16, const float *x, long ldx, int r0, long k0, long kc, const void *const *wp, v16 (*acc)[OB],
    int pf, const char *next, long step) {
    switch (rt) {
    case 1: tile(1, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
#if RT > 2
    case 2: tile(2, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
    case 3: tile(3, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
    case 4: tile(4, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
    case 5: tile(5, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
#endif
    default: tile(RT, bf16, x, ldx, r0, k0, kc, wp, acc, pf, next, step); break;
    }
}

/* Tiles [t0, t1) of RT rows (the last may be shorter) against one chunk of the block. */
static inline __attribute__((always_inline)) void tiles(
    int bf16, const float *x, long ldx, int n, int t0, int t1, long k0, int kc, const void *const *wp, v16 (*acc)[OB]) {
    for (int t = t0; t < t1; t++) {
        int r0 = t * RT, rt = n - r0 < RT ? n - r0 : RT;
        tile_rt(rt, bf16, x, ldx, r0, k0, kc, wp, acc, 0, 0, 0);
    }
}

/* How many of the rows [o0, o0 + bs) exist in a matrix of O rows (0 past its end). */
static inline long rows_at(long O, long o0, int bs) {
    return o0 >= O ? 0 : (O - o0 < bs ? O - o0 : bs);
}

/* Where row `row` of a row-major weight of K columns starts. */
static inline const char *row_at(const void *w, long row, long K, int bf16) {
    return (const char *)w + row * K * (bf16 ? 2 : 4);
}

static const float zeros[KC] __attribute__((aligned(64)));  /* the rows of a short last block */

/* The rows [o0, o0 + ob) of w (ob <= OB) against the n rows of x: res[r * OB + j]. The weight is
   read straight from memory (copying or widening it into a buffer first measured slower).
   One tile of rows (n <= RT), or more than two: the tiles take turns, each over the whole row
   with its accumulators in registers throughout (reloading them per chunk cost a fifth of the
   arithmetic); the first prefetches the weight KC columns ahead of what it reads, and the later
   ones, which find the block in L1/L2, prefetch the block this thread reads next (`next_rows` rows
   of K columns at `next`) into L2, so the memory keeps streaming while they compute (fp32 expert
   at 16 rows, 2 threads: 16.9 -> 20 GB/s; the LM head 15 -> 17 with the turns alone). Two tiles:
   KC columns at a time, the first tile bringing the chunk into L1 for the second and the next
   chunk prefetched meanwhile (+8-9% at 7-12 rows over no prefetch). Every order sums each output
   over k in the same order. */
static void block(const float *x, long ldx, int n, long K, const void *w, int bf16, long o0, int ob,
                  const void *next, long next_rows, float *res) {
    v16 acc[n][OB];
    memset(acc, 0, sizeof acc);
    int esize = bf16 ? 2 : 4, ntiles = (n + RT - 1) / RT, tile_outer = ntiles > 2;
    long kv = K / VL * VL;
    if (ntiles == 1 || tile_outer) { /* tile by tile, each over the whole row, in registers */
        const void *wp[OB];
        for (int j = 0; j < OB; j++) /* a short last block repeats its last row (results not kept) */
            wp[j] = row_at(w, o0 + (j < ob ? j : ob - 1), K, bf16);
        long slice = next_rows * K * esize / ntiles, step = slice / (kv / VL > 0 ? kv / VL : 1) + 1;
        for (int t = 0; t < ntiles; t++) {
            int rt = n - t * RT < RT ? n - t * RT : RT, pf = t == 0 ? KC * esize : 0;
            const char *ahead = tile_outer && next_rows ? (const char *)next + t * slice : 0;
            if (bf16)
                tile_rt(rt, 1, x, ldx, t * RT, 0, kv, wp, acc, pf, ahead, step);
            else
                tile_rt(rt, 0, x, ldx, t * RT, 0, kv, wp, acc, pf, ahead, step);
        }
    } else { /* two tiles: chunk by chunk, the second tile finding the chunk in L1 */
        for (long k0 = 0; k0 < kv; k0 += KC) {
            int kc = (int)(kv - k0 < KC ? kv - k0 : KC);
            const void *wp[OB];
            for (int j = 0; j < OB; j++) {
                wp[j] = j < ob ? (const char *)w + ((o0 + j) * K + k0) * esize : (const void *)zeros;
            }
            if (k0 + KC < kv) {
                int later = (int)(kv - k0 - KC < KC ? kv - k0 - KC : KC) * esize;
                for (int j = 0; j < ob; j++)
                    for (int b = 0; b < later; b += 64) __builtin_prefetch((const char *)wp[j] + KC * esize + b, 0, 3);
            }
            if (bf16)
                tiles(1, x, ldx, n, 0, ntiles, k0, kc, wp, acc);
            else
                tiles(0, x, ldx, n, 0, ntiles, k0, kc, wp, acc);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) {
            float s = hsum(acc[r][j]);
            for (long k = kv; k < K; k++) {
                long i = (o0 + j) * K + k;
                float wk = bf16_or_float(w, i, bf16);
                s += x[r * ldx + k] * wk;
            }
            res[r * OB + j] = s;
        }
}

#define OB_SIMD 8 /* cpu_rows_avx2.c's and cpu_rows_avx512.c's weight rows per block */
#define OB_MAX 8  /* the most of any block */

/* Weight rows per block of an isa: res[r * block_rows(isa) + j]. */
static inline int block_rows(int isa) {
    return isa ? OB_SIMD : OB;
}

/* The rows of x a block reads: fp32 (in bf16 column order for isa 1 against a bf16 weight), or for
   isa 2 against a bf16 weight bf16; row stride ld elements. */
typedef struct {
    const void *p;
    long ld;
} rows_in;

/* `block` (isa 0), cpu_rows_avx2.c's (isa 1) or cpu_rows_avx512.c's (isa 2). */
static inline void block_of(int isa, rows_in x, int n, long K, const void *w, int bf16, long o0, int ob,
                            const void *next, long next_rows, float *res) {
    if (isa == 2)
        flowmoe_block_avx512(x.p, x.ld, n, K, w, bf16, o0, ob, next, next_rows, res);
    else if (isa == 1)
        flowmoe_block_avx2(x.p, x.ld, n, K, w, bf16, o0, ob, next, next_rows, res);
    else
        block(x.p, x.ld, n, K, w, bf16, o0, ob, next, next_rows, res);
}

/* The most rows of x an isa's pair block takes: cpu_rows_avx512.c's 2 (a batch-8 decode step's rows
   per expert; 1 thread, Zen 4, from DRAM, bench/expert_rows.py, against two blocks: LM head at 2
   rows 1.38-1.43x in bf16 and fp32, bf16 expert FFN 1.12x), else 1. */
static inline int pair_rows(int isa) {
    return isa == 2 ? 2 : 1;
}

/* Two blocks: res + m n bs = the rows [o0 + m apart, + ob) of w [., K] against the n rows of x, m < 2
   (bs: block_rows(isa)); the block read after them: `then_rows` rows from row `then`. Up to
   pair_rows rows, the pair blocks of cpu_rows_avx2.c (isa 1) and cpu_rows_avx512.c (isa 2)
   read the two blocks' rows side by side: two streams in address order (else one block, then the
   other, each prefetching the one read after it). */
static inline void two_blocks(int isa, rows_in x, int n, long K, const void *w, int bf16, long o0, int ob,
                              long apart, long then, long then_rows, float *res) {
    int bs = block_rows(isa);
    if (isa == 2 && n <= pair_rows(isa)) {
        flowmoe_pair_block_avx512(x.p, x.ld, n, K, w, bf16, o0, ob, apart, res);
        return;
    }
    if (isa == 1 && n <= pair_rows(isa)) {
        flowmoe_pair_block_avx2(x.p, K, w, bf16, o0, ob, apart, res);
        return;
    }
    block_of(isa, x, n, K, w, bf16, o0, ob, row_at(w, o0 + apart, K, bf16), ob, res);
    block_of(isa, x, n, K, w, bf16, o0 + apart, ob, row_at(w, then, K, bf16), then_rows, res + n * bs);
}

/* A matrix of O rows in blocks: pairs of blocks (up to pair_rows rows block i of rows [0, half)
   beside block i of [half, 2 half), so that the pair block reads two streams through the matrix's
   halves; at more rows blocks 2 i and 2 i + 1), then the rest alone. */
static inline long half_of(long O, int bs) {
    return O / (2 * bs) * bs;
}

static inline long paired_blocks(long O, int bs) {
    long half = half_of(O, bs);
    return half / bs + (O - 2 * half + bs - 1) / bs;
}

/* Block b's rows: `both` (1 or 2) blocks of ob rows from o0, the second `apart` rows on. */
typedef struct {
    long o0, apart;
    int ob, both;
} pair_at;

/* res + m n bs = block b of the pairs above against the n rows of x: the rows [o0 + m apart, + ob)
   of w [O, K], m < both (the block read after them prefetched by the several-row blocks). */
static inline pair_at paired(int isa, rows_in x, int n, long K, const void *w, int bf16, long O, long b,
                             float *res) {
    int bs = block_rows(isa);
    long half = half_of(O, bs), pairs = half / bs;
    int halves = n <= pair_rows(isa);
    pair_at p = {b < pairs ? b * (halves ? bs : 2 * bs) : 2 * half + (b - pairs) * bs, halves ? half : bs, 0,
                 b < pairs ? 2 : 1};
    p.ob = (int)rows_at(O, p.o0, bs);
    long then = p.o0 + (p.both - 1) * p.apart + bs; /* the block after the last */
    if (p.both == 2)
        two_blocks(isa, x, n, K, w, bf16, p.o0, p.ob, p.apart, then, rows_at(O, then, bs), res);
    else
        block_of(isa, x, n, K, w, bf16, p.o0, p.ob, row_at(w, then, K, bf16), rows_at(O, then, bs), res);
    return p;
}

/* Where column k of a K-column row of x goes in bf16 column order (cpu_rows_avx2.c): within each
   16 columns the 8 even ones, then the 8 odd ones; columns past the last full 16 stay in place. */
static inline long bf16_position(long k, long K) {
    if (k >= K / 16 * 16) return k;
    long i = k & 15;
    return (k & ~15L) + (i & 1 ? 8 : 0) + (i >> 1);
}

/* dst [n, K] (contiguous, fp32) = the bf16 rows of x [n, K] (row stride ldx), in bf16 column order
   where `ordered`. */
static void widen_rows(const uint16_t *x, long ldx, int n, long K, int ordered, float *dst) {
    for (int r = 0; r < n; r++)
        for (long k = 0; k < K; k++) dst[r * K + (ordered ? bf16_position(k, K) : k)] = bf16_to_float(x[r * ldx + k]);
}

/* Where a kernel's own copy of rows of x starts, so that x and the weight they meet keep out of each
   other's L1 sets. The L1 (32 KiB, 8 ways) maps addresses 4 KiB apart to one set. Rows 4 KiB apart
   (or 2 KiB) lie in one (two) 1 KiB windows of sets: a block's OB weight rows fill every way of
   theirs, and a chunk of several rows of x in the same window (a prefill's rows, read by several
   tiles per chunk: from REREAD_ROWS rows) evicts the weight's chunk between the tiles that reuse it, so
   every tile fetches both again from the L2. Rows of x 2 KiB (1 KiB) past the weight's offset in 4
   KiB (2 KiB) never meet it. cpu_rows_avx512.c's block, 1 thread, Zen 4, x and the weight at the same
   offset against 2 KiB apart (issue 25's shapes, fp32 weights from DRAM, GFLOP/s, FMA peak 117):
   32 rows x [7168, 1024] 66 -> 79, 17 rows 60 -> 72; 128 rows x [1536, 1024] 71 -> 86, x [1024,
   4096] 71 -> 87; bf16 4-16 rows x [7168, 1024] 1.05-1.08x (1 KiB apart); rows 14 KiB apart (the
   down projection's) gain nothing. The same arithmetic: the same bits. `buf` has PLACE_SLACK
   bytes more than the rows take; rows `row_bytes` apart against weight rows as far apart (x and
   the weight in one dtype). */
#define PLACE_SLACK (4096 + 64)
#define REREAD_ROWS 4 /* rows of x from which a block's tiles read each chunk of the weight several times */

/* How far past the weight's offset in 4 KiB rows `row_bytes` apart start (0: they meet it nowhere). */
static inline uintptr_t placement_gap(long row_bytes) {
    return row_bytes % 4096 == 0 ? 2048 : row_bytes % 2048 == 0 ? 1024 : 0;
}

static inline void *placed(void *buf, const void *w, long row_bytes) {
    uintptr_t at = ((uintptr_t)buf + 63) & ~(uintptr_t)63, gap = placement_gap(row_bytes);
    if (!gap) return (void *)at;
    uintptr_t want = ((uintptr_t)w + gap) & 4095 & ~(uintptr_t)63; /* the offset in 4 KiB to start at */
    return (void *)(at + ((want - (at & 4095)) & 4095));
}

/* y[i] = v in y's dtype (bf16 where `bf16`, else fp32). */
static inline void store(void *y, long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* Whether an isa reads x in bf16 column order against a bf16 weight. */
static inline int reorders(int isa, int bf16) {
    return isa == 1 && bf16;
}

/* Whether an isa reads x in bf16 against a bf16 weight (else widened to fp32). */
static inline int bf16_rows(int isa, int bf16) {
    return isa == 2 && bf16;
}

/* y [n, O] (row stride ldy) = x [n, K] (row stride ldx) @ w [O, K]^T (+ bias [O], fp32); x and y
   in the weight's dtype (bf16 where `bf16`, else fp32), accumulated in fp32 (a bf16 x is widened
   into a buffer first, in bf16 column order where the isa reads it so, unless the isa reads bf16;
   several rows 2 KiB multiples apart are copied where they keep out of w's sets: `placed`).
   Returns 0, or 1 where there is no memory for that buffer. */
int flowmoe_linear(const void *x, long ldx, int n, long K, const void *w, int bf16, long O,
                   const float *bias, void *y, long ldy, int isa, int threads) {
    int bs = block_rows(isa), esize = bf16 ? 2 : 4, widen = bf16 && !bf16_rows(isa, bf16);
    long blocks = paired_blocks(O, bs);
    void *wide = 0; /* x widened to fp32, or several rows copied where they keep out of w's sets (placed) */
    rows_in xs = {x, ldx};
    if (widen) {
        wide = malloc(sizeof(float) * n * K);
        if (!wide) return 1;
        widen_rows(x, ldx, n, K, reorders(isa, bf16), wide);
        xs.p = wide, xs.ld = K;
    } else if (n >= REREAD_ROWS && placement_gap(K * esize)) {
        wide = malloc((size_t)esize * n * K + PLACE_SLACK);
        if (!wide) return 1;
        void *rows = placed(wide, w, K * esize);
        for (int r = 0; r < n; r++)
            memcpy((char *)rows + r * K * esize, (const char *)x + r * ldx * esize, (size_t)K * esize);
        xs.p = rows, xs.ld = K;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        float res[2 * n * OB_MAX];
        pair_at p = paired(isa, xs, n, K, w, bf16, O, b, res);
        for (int m = 0; m < p.both; m++)
            for (int r = 0; r < n; r++)
                for (int j = 0; j < p.ob; j++) {
                    long o = p.o0 + m * p.apart + j;
                    store(y, r * ldy + o, res[(m * n + r) * bs + j] + (bias ? bias[o] : 0.0f), bf16);
                }
    }
    free(wide);
    return 0;
}

/* Where a group's output rows go: out [sum n_e, H] in bf16 where `bf16` else fp32; with `scales`
   [sum n_e] (fp32, or bf16 where scales_bf16) each row is first rounded to the weights' dtype, then
   multiplied by its scale (torch's product of the expert's output and its combine weight). */
typedef struct {
    void *out;
    int bf16;
    const void *scales;
    int scales_bf16;
} rows_out;

/* An output row's value v (res + bias) for row i of the group, stored as `to` says. */
static inline void store_row(rows_out to, long i, long at, float v, int weights_bf16) {
    if (to.scales) {
        v = bf16_rounded(v, weights_bf16);
        v = v * bf16_or_float(to.scales, i, to.scales_bf16);
    }
    store(to.out, at, v, to.bf16);
}

/* An activation v into row r of an expert's acts (I columns; see ffn_rows) at column o. */
static inline void store_act(void *acts, int isa, int bf16, long r, long I, long o, float v) {
    if (bf16_rows(isa, bf16)) {
        ((uint16_t *)acts)[r * I + o] = float_to_bf16(v);
    } else {
        ((float *)acts)[r * I + (reorders(isa, bf16) ? bf16_position(o, I) : o)] = v;
    }
}

/* The expert FFNs of a group of experts (a layer's routed experts, or one) in one parallel pass:
   for expert e, act_e [n_e, I] = swiglu(x_e @ gate^T + bg, x_e @ up^T + bu) with gate_up_e
   [2I, H] (gate rows, then up rows), then out_e [n_e, H] = act_e @ down_e^T + bd with down_e
   [H, I]. fx[e]: expert e's rows of x (row stride H), in fp32 (in bf16 column order where the isa
   reads x so) or in bf16 where the isa reads bf16 rows; first[e]: its first row in the group; the
   acts in fp32 in a buffer of the kernel's own (in bf16 column order likewise), or rounded to bf16
   where the isa reads bf16 rows: as transformers' bf16 forward rounds them, and llama.cpp's BF16
   path; against keeping them to 2^-17 in two bf16 rows, from DRAM 1.10x at 1 row, 1.02x at 2,
   1.11x at 8 (bench/expert_rows.py, Zen 4, 1 thread, 9 rounds), for 2.5-3.0e-3 relative
   difference. Each expert's acts are placed against its down weight (`placed`) where they are in
   the weight's dtype. Threads share the blocks of all experts in spans of about equal cost
   (shares.h); the biases may be null. Returns 0, or 1 where there is no memory for the buffer. */
static int ffn_rows(int experts, const void *const *fx, const int *ns, const long *first, long rows, long H,
                    long I, const void *const *gate_ups, const void *const *downs, int bf16,
                    const float *const *gate_up_biases, const float *const *down_biases, int clamped, float alpha,
                    float limit, rows_out to, int isa, int threads) {
    int bs = block_rows(isa), bf16_acts = bf16_rows(isa, bf16);
    long up_blocks = (I + bs - 1) / bs, down_blocks = paired_blocks(H, bs); /* down's: as gate's beside up's */
    int asize = bf16_acts ? 2 : 4, place = asize == (bf16 ? 2 : 4); /* acts in the down weight's dtype */
    char *acts = malloc((size_t)asize * (rows > 0 ? rows : 1) * I + (size_t)experts * PLACE_SLACK);
    if (!acts) return 1;
    void *act_of[experts > 0 ? experts : 1]; /* each expert's acts [n_e, I] */
    char *at = acts;
    for (int e = 0; e < experts; e++) {
        act_of[e] = place ? placed(at, downs[e], I * asize) : at;
        at = (char *)act_of[e] + (size_t)asize * ns[e] * I;
    }
#pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num(), team = omp_get_num_threads();
        span ups = share_of(experts, ns, up_blocks, id, team), downs_of = share_of(experts, ns, down_blocks, id, team);
        for (long t = ups.from; t < ups.to; t++) {
            int e = (int)(t / up_blocks), n = ns[e];
            long o0 = t % up_blocks * bs;
            int ob = (int)rows_at(I, o0, bs);
            const float *bias = gate_up_biases[e];
            const void *gu = gate_ups[e];
            float gu_res[2 * n * OB_MAX], *g = gu_res, *u = gu_res + n * bs;
            rows_in x = {fx[e], H};
            two_blocks(isa, x, n, H, gu, bf16, o0, ob, I, o0 + bs, rows_at(I, o0 + bs, bs), gu_res); /* gate, up */
            for (int r = 0; r < n; r++)
                for (int j = 0; j < ob; j++) {
                    float gv = g[r * bs + j] + (bias ? bias[o0 + j] : 0.0f);
                    float uv = u[r * bs + j] + (bias ? bias[I + o0 + j] : 0.0f);
                    store_act(act_of[e], isa, bf16, r, I, o0 + j, swiglu(gv, uv, clamped, alpha, limit));
                }
        }
#pragma omp barrier
        for (long t = downs_of.from; t < downs_of.to; t++) {
            int e = (int)(t / down_blocks), n = ns[e];
            const float *bias = down_biases[e];
            float res[2 * n * OB_MAX];
            rows_in act = {act_of[e], I};
            pair_at p = paired(isa, act, n, I, downs[e], bf16, H, t % down_blocks, res);
            for (int m = 0; m < p.both; m++)
                for (int r = 0; r < n; r++)
                    for (int j = 0; j < p.ob; j++) {
                        long i = first[e] + r, o = p.o0 + m * p.apart + j;
                        store_row(to, i, i * H + o, res[(m * n + r) * bs + j] + (bias ? bias[o] : 0.0f), bf16);
                    }
        }
    }
    free(acts);
    return 0;
}

/* The group's FFNs for xs[e] [n_e, H] (contiguous rows, in the weights' dtype) -> out [sum n_e, H]
   (every expert's rows in turn) in the weights' dtype; a bf16 x_e is widened into a buffer first
   unless the isa reads bf16 rows, several rows copied where they keep out of the weight's sets
   (`placed`). Returns 0, or 1 where there is no memory for the buffers. */
int flowmoe_ffn_group(int experts, const void *const *xs, const int *ns, long H, long I,
                      const void *const *gate_ups, const void *const *downs, int bf16,
                      const float *const *gate_up_biases, const float *const *down_biases, int clamped,
                      float alpha, float limit, void *out, int isa, int threads) {
    int n_experts = experts > 0 ? experts : 1, widen = bf16 && !bf16_rows(isa, bf16);
    long first[n_experts], rows = 0; /* expert e's first row in out and the buffers */
    for (int e = 0; e < experts; e++) first[e] = rows, rows += ns[e];
    int esize = bf16 ? 2 : 4, most = 0;
    for (int e = 0; e < experts; e++) most = ns[e] > most ? ns[e] : most;
    int moved = !widen && most >= REREAD_ROWS && placement_gap(H * esize); /* rows copied where `placed` says */
    char *wide = 0;
    const void *fx[n_experts];
    if (widen && !(wide = malloc(sizeof(float) * (rows > 0 ? rows : 1) * H))) return 1;
    if (moved && !(wide = malloc((size_t)esize * rows * H + (size_t)experts * PLACE_SLACK))) return 1;
    char *at = wide;
    for (int e = 0; e < experts; e++) {
        fx[e] = xs[e];
        if (widen) {
            widen_rows(xs[e], H, ns[e], H, reorders(isa, bf16), (float *)wide + first[e] * H);
            fx[e] = (float *)wide + first[e] * H;
        } else if (moved) {
            void *to = placed(at, gate_ups[e], H * esize);
            memcpy(to, xs[e], (size_t)esize * ns[e] * H);
            fx[e] = to;
            at = (char *)to + (size_t)esize * ns[e] * H;
        }
    }
    rows_out to = {out, bf16, 0, 0};
    int status = ffn_rows(experts, fx, ns, first, rows, H, I, gate_ups, downs, bf16, gate_up_biases, down_biases,
                          clamped, alpha, limit, to, isa, threads);
    free(wide);
    return status;
}

/* A layer's routed experts from the rows of x they take: expert e's n_e rows are x's rows
   rows[first[e]...] (x [T, H] in the weights' dtype, row stride ldx; gathered into a buffer, widened
   to fp32 unless the isa reads bf16 rows, else each expert's rows placed against its weight:
   `placed`), and each output row is multiplied by its scale (see rows_out): out [sum n_e, H] in
   bf16 where out_bf16, else fp32. Returns 0, or 1 where there is no memory for the buffers. */
int flowmoe_ffn_routed(int experts, const void *x, long ldx, const int64_t *rows_of_x, const int *ns, long H,
                       long I, const void *const *gate_ups, const void *const *downs, int bf16,
                       const float *const *gate_up_biases, const float *const *down_biases, int clamped,
                       float alpha, float limit, const void *scales, int scales_bf16, void *out, int out_bf16,
                       int isa, int threads) {
    int n_experts = experts > 0 ? experts : 1, reorder = reorders(isa, bf16), widen = bf16 && !bf16_rows(isa, bf16);
    int esize = bf16 ? 2 : 4, kept = widen ? 4 : esize; /* bytes per value of x and of the buffer */
    long first[n_experts], rows = 0;
    for (int e = 0; e < experts; e++) first[e] = rows, rows += ns[e];
    /* each expert's rows where they keep out of its gate / up weight's sets (placed), unless widened */
    size_t slack = widen ? 0 : (size_t)experts * PLACE_SLACK;
    char *gathered = malloc((size_t)kept * (rows > 0 ? rows : 1) * H + slack);
    if (!gathered) return 1;
    const void *fx[n_experts];
    char *at = gathered;
    for (int e = 0; e < experts; e++) {
        fx[e] = widen ? at : placed(at, gate_ups[e], H * kept);
        at = (char *)fx[e] + (size_t)ns[e] * H * kept;
        for (long i = first[e]; i < first[e] + ns[e]; i++) {
            const char *row = (const char *)x + rows_of_x[i] * ldx * esize;
            char *to = (char *)fx[e] + (i - first[e]) * H * kept;
            if (widen)
                widen_rows((const uint16_t *)row, ldx, 1, H, reorder, (float *)to);
            else
                memcpy(to, row, (size_t)kept * H);
        }
    }
    rows_out to = {out, out_bf16, scales, scales_bf16};
    int status = ffn_rows(experts, fx, ns, first, rows, H, I, gate_ups, downs, bf16, gate_up_biases, down_biases,
                          clamped, alpha, limit, to, isa, threads);
    free(gathered);
    return status;
}
