/* Expert FFNs on the CPU reading quantized weights as they are packed (built by cpu_packed.py).

   The same SwiGLU FFN as cpu_expert.c's flowmoe_ffn_group (gate/up -> activation -> down), but each
   weight is read in its packed form, never dequantized in memory: a decode step reads 1 byte per int8
   weight and ~0.52 per int4 weight instead of the 2-4 of bf16/fp32. Formats (flowmoe/model/quantized.py):

   * int8 (fmt 0): q int8 [R, K], one float32 scale per row: y = scale x sum_k q x.
   * int4 (fmt 1): q two 4-bit levels per byte [R, ceil(K / 2)] (column 2i in the low nibble of
     byte i, 2i + 1 in the high one), a float16 scale and zero per group of `group` columns of a row
     (group a multiple of SB): y = sum_groups scale x sum_k (q - zero) x
     = sum_groups scale x (sum_k q x - zero x sum_k x).

   The activations are quantized too, as llama.cpp's Q8_0 does (the idea's source: ggml's
   quantize_row_q8_0 and its integer dot products; this code is written from that description):
   each row of x, and of the activation between the projections, in blocks of QB columns, each block
   an int8 level per value and one float32 scale d = max |x| / 127, x ~ d x level (level =
   round(x / d), half away from zero). Each weight row then meets a row of levels in exact integer
   sums, taken to float once per block: 8 lanes, lane l the int32 sum of the 4 products of the
   block's columns 4l..4l + 3 (int8), or of a superblock's (SB columns: the levels of 32 bytes, two
   blocks) columns 8l..8l + 7 (int4; lanes 0-3 the first block, 4-7 the second), each added into
   the output's fp32 lanes as fma(float(sum), the block's d, lane). int4 sums a group's superblocks
   so into its own lanes, then lanes = fma(scale, group lanes, lanes), lanes = fma(-(scale x zero),
   the row's lane sums of d x level over the group, lanes): the zero stays out of the integer sums
   (levels 0..15 unsigned, the activations' levels signed, as AVX2's maddubs multiplies them). Then the 8 lanes in a fixed
   tree (hsum8: i + i + 4, then + 2, + 1), then the columns past the last full block (int8) or
   superblock (int4) in order, each as fma(d x level, weight, sum) with the weight (q - zero) x scale;
   int8 times the row's scale last. Every float operation is in that one order, whatever the rows,
   threads and block (the integer sums are exact), so the portable, AVX2 and AVX-512 blocks give the same bits
   and a row the same bits alone as among others.

   Numerics: the levels' integer sums are exact, so the output is, up to fp32 rounding of a few
   terms per block, the dequantized weights times the dequantized activations (d x level): each
   activation moved by at most d / 2 = max |x of its block| / 254 (tests/test_cpu_packed.py's
   bounds). A NaN or infinite activation has no level (its block's levels are undefined).

   Layout of a row's levels (quantize_row): int8, the columns in order; int4, each full superblock's
   64 columns as its 32 bytes' low nibbles meet them (the even columns), then the high nibbles'
   (the odd ones), the columns past the last full superblock in order.

   Blocks: `isa` 1 takes cpu_packed_avx2.c's (AVX2 + FMA + F16C intrinsics), 2 cpu_packed_avx512.c's
   (the same tiles, cpu_packed_tiles.h, with AVX512-VNNI's integer dot products), both chosen by the
   CPU's features in cpu_packed.py, and cpu_packed_avx2.c's activation quantization for whole
   blocks; 0 the portable ones here (plain C, the same operations one output at a time). Threads:
   OpenMP over blocks of PB weight rows of all experts, the count the caller passes, each thread a
   span of them of about equal cost (shares.h).

   One-row blocks (an expert's one row, a decode step's): a gate / up block takes gate's PB rows and
   up's together, and each of down's first blocks its PB rows of the matrix's first half beside the
   same of its second half, so the AVX2 block's tiles read one row of each of two matrices at a time:
   two streams that run in address order through whole matrices, which the hardware prefetchers
   follow, where two rows of one matrix are two short streams that end every PB rows. Several rows
   keep one matrix a block (a tile's weight rows reused across its rows). 16 experts' 1024 x 3584
   FFNs from DRAM, 1 row, 1 thread, AMD EPYC Zen 3 2 vCPU at load 6 (bench/packed_rows.py, 9 rounds
   alternated against one-matrix blocks, medians [min, max]): int8 1.40 -> 1.11 ms an expert, 1.29x
   [1.01, 1.40]; int4 0.92 -> 0.76 ms, 1.13x [0.96, 1.47]; the same bits. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "shares.h"
#include "swiglu.h"

#define PB 4        /* weight rows per block */
#define QB 32       /* activations per quantization block: llama.cpp's Q8_0 block (QK8_0, ggml-common.h) */
#define SB 64       /* int4 columns per superblock: 32 bytes of levels, two activation blocks */
#define QMAX 127.0f /* the largest activation level: Q8_0's d = max |x| / ((1 << 7) - 1) */

/* cpu_packed_avx2.c, cpu_packed_avx512.c */
void flowmoe_packed_block_avx2(int fmt, const int8_t *xq, long ldq, const float *xd, const float *xl,
                               const float *xs, long ldf, int n, long K, long group, int mats,
                               const void *const *p, long o0, int ob, float *res);
void flowmoe_packed_block_avx512(int fmt, const int8_t *xq, long ldq, const float *xd, const float *xl,
                                 const float *xs, long ldf, int n, long K, long group, int mats,
                                 const void *const *p, long o0, int ob, float *res);
void flowmoe_packed_row_block_avx512(const int8_t *xq, const float *xl, const float *xs, long K, long group,
                                     const void *const *p, long o0, float *res);
void flowmoe_quantize_blocks_avx2(const float *x, long blocks, int fmt, long supers, long group, long groups,
                                  int8_t *xq, float *xd, float *lanes, float *sums);

/* IEEE half -> float, exactly (subnormals, infinities and NaN included). */
float flowmoe_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do man <<= 1, e++;
        while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FFu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The 8 lanes' sum: lane i + lane i + 4, then + 2, + 1 (cpu_packed_avx2.c's hsum8 in plain C). */
static inline float hsum8(const float *a) {
    float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    return (b0 + b2) + (b1 + b3);
}

/* Where column k of K goes in a row of int4 levels (the header's layout). */
static inline long int4_position(long k, long K) {
    if (k >= K / SB * SB) return k;
    long c = k % SB;
    return k - c + (c & 1 ? SB / 2 : 0) + c / 2;
}

/* Level k of an int4 row. */
static inline int int4_level(const uint8_t *row, long k) {
    return k & 1 ? row[k >> 1] >> 4 : row[k >> 1] & 15;
}

/* The floats of a row of levels (quantize_row): d [ceil(K / QB)], then int4's lanes' scales
   [K / SB, 8] and group sums [groups, 8]. */
static inline long row_floats(int fmt, long K, long group) {
    return (K + QB - 1) / QB + (fmt == 1 ? K / SB * 8 + (K + group - 1) / group * 8 : 0);
}

/* x [K] fp32 -> its levels xq [K] (int8 in order, int4 in int4_position's) and floats xf
   (row_floats): each block's d = max |x| / QMAX; int4 also each superblock's lanes' d (lane l:
   its first block's for l < 4, else its second's) and each group's lane sums: for each superblock
   of the group before the last full one in order, lane l += the int sum of the levels of the
   superblock's columns 8l..8l + 7 times the lane's d (fma): the sums of d x level that the blocks'
   lanes meet. `isa` 1: cpu_packed_avx2.c's the whole blocks (int4: superblocks) and the sums, the
   same bits; the blocks past them here. The scalar loop alone was 2.4% of a batch-1 int4 decode step's
   perf samples, 0.2% so (1 thread, AMD EPYC Zen 3 2 vCPU); bench/packed_rows.py --baseline 6dd9efd,
   11 rounds, load 2.2-2.5, from DRAM: 1 row int8 1.08x, int4 1.10x; 8 rows 1.09x, 1.16x. */
static void quantize_row(const float *x, long K, int fmt, long group, int isa, int8_t *xq, float *xf) {
    long supers = K / SB, groups = fmt == 1 ? (K + group - 1) / group : 0, done = 0; /* blocks the AVX2 code quantized */
    float *lanes = xf + (K + QB - 1) / QB, *sums = lanes + supers * 8;
    if (isa >= 1) {
        done = fmt == 1 ? 2 * supers : K / QB;
        flowmoe_quantize_blocks_avx2(x, done, fmt, supers, group, groups, xq, xf, lanes, sums);
    }
    for (long b = done; b * QB < K; b++) {
        long end = (b + 1) * QB < K ? (b + 1) * QB : K;
        float largest = 0.0f;
        for (long k = b * QB; k < end; k++) largest = fabsf(x[k]) > largest ? fabsf(x[k]) : largest;
        float d = largest / QMAX, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        xf[b] = d;
        for (long k = b * QB; k < end; k++) {
            float v = x[k] * inverse, whole = truncf(v); /* roundf's: half away from zero (v - whole is exact) */
            int8_t level = (int8_t)(whole + (fabsf(v - whole) >= 0.5f ? copysignf(1.0f, v) : 0.0f));
            xq[fmt == 1 ? int4_position(k, K) : k] = level;
        }
    }
    if (fmt == 0 || isa >= 1) return;
    for (long s = 0; s < supers; s++)
        for (int l = 0; l < 8; l++) lanes[s * 8 + l] = xf[2 * s + l / 4];
    for (long g = 0; g < groups; g++) {
        float acc[8] = {0};
        for (long s = g * group / SB; s < (g + 1) * group / SB && s < supers; s++)
            for (int l = 0; l < 8; l++) {
                int sum = 0;
                for (int c = 0; c < 4; c++) sum += xq[s * SB + 4 * l + c] + xq[s * SB + SB / 2 + 4 * l + c];
                acc[l] = fmaf((float)sum, lanes[s * 8 + l], acc[l]);
            }
        memcpy(sums + g * 8, acc, sizeof acc);
    }
}

/* The last columns [k0, K) of weight row o against a row of levels xq and its block scales xd (in
   order; int4: each weight (q - zero) x scale). */
float flowmoe_packed_tail(int fmt, const int8_t *xq, const float *xd, long K, long group, const void *q,
                          const void *scale, const void *zero, long o, long k0, float s) {
    if (fmt == 0) {
        const int8_t *row = (const int8_t *)q + o * K;
        for (long k = k0; k < K; k++) s = fmaf((float)xq[k] * xd[k / QB], (float)row[k], s);
        return s;
    }
    const uint8_t *row = (const uint8_t *)q + o * ((K + 1) / 2);
    long groups = (K + group - 1) / group;
    for (long k = k0; k < K; k++) {
        long g = o * groups + k / group;
        float z = flowmoe_half_to_float(((const uint16_t *)zero)[g]);
        float sc = flowmoe_half_to_float(((const uint16_t *)scale)[g]);
        s = fmaf((float)xq[k] * xd[k / QB], ((float)int4_level(row, k) - z) * sc, s);
    }
    return s;
}

/* The portable block: res[r * PB + j] = levels row r . weight row o0 + j for r < n, j < ob, in the
   header's order; xq [n, ldq] the rows' levels, xd / xl / xs their block scales, int4 lanes' scales
   and group sums (quantize_row), a row's ldf floats on. */
static void block_portable(int fmt, const int8_t *xq, long ldq, const float *xd, const float *xl, const float *xs,
                           long ldf, int n, long K, long group, const void *q, const void *scale, const void *zero,
                           long o0, int ob, float *res) {
    long bytes = (K + 1) / 2, groups = fmt == 1 ? (K + group - 1) / group : 0, supers = K / SB;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) {
            long o = o0 + j;
            const int8_t *x = xq + r * ldq;
            float acc[8] = {0};
            if (fmt == 0) {
                const int8_t *w = (const int8_t *)q + o * K;
                for (long b = 0; b < K / QB; b++)
                    for (int l = 0; l < 8; l++) {
                        int sum = 0;
                        for (int c = 0; c < 4; c++) sum += w[b * QB + 4 * l + c] * x[b * QB + 4 * l + c];
                        acc[l] = fmaf((float)sum, xd[r * ldf + b], acc[l]);
                    }
                float s = flowmoe_packed_tail(0, x, xd + r * ldf, K, group, q, scale, zero, o, K / QB * QB, hsum8(acc));
                res[r * PB + j] = s * ((const float *)scale)[o];
                continue;
            }
            const uint8_t *w = (const uint8_t *)q + o * bytes;
            for (long g = 0; g * group < supers * SB; g++) {
                float lanes[8] = {0};
                for (long s = g * group / SB; s < (g + 1) * group / SB && s < supers; s++)
                    for (int l = 0; l < 8; l++) {
                        int sum = 0;
                        for (int c = 0; c < 4; c++) {
                            int at = (int)s * SB / 2 + 4 * l + c;
                            sum += (w[at] & 15) * x[s * SB + 4 * l + c] + (w[at] >> 4) * x[s * SB + SB / 2 + 4 * l + c];
                        }
                        lanes[l] = fmaf((float)sum, xl[r * ldf + s * 8 + l], lanes[l]);
                    }
                float sc = flowmoe_half_to_float(((const uint16_t *)scale)[o * groups + g]);
                float sz = sc * flowmoe_half_to_float(((const uint16_t *)zero)[o * groups + g]);
                for (int l = 0; l < 8; l++) acc[l] = fmaf(-sz, xs[r * ldf + g * 8 + l], fmaf(sc, lanes[l], acc[l]));
            }
            res[r * PB + j] = flowmoe_packed_tail(1, x, xd + r * ldf, K, group, q, scale, zero, o, supers * SB, hsum8(acc));
        }
}

/* res + m n PB = the block of weight rows o0.. of matrix m < mats (p + 3 m: q, scale, zero) against n
   rows of levels (quantize_row's xq [n, K] and xf [n, row_floats]): the AVX2 block takes the mats
   matrices' rows together (cpu_packed_avx2.c); the AVX-512 one-row int4 blocks of whole superblocks by
   flowmoe_packed_row_block_avx512 (cpu_packed_tiles.h's ROW_BLOCK), the same bits. */
static inline void packed_block(int isa, int fmt, const int8_t *xq, const float *xf, int n, long K, long group,
                                int mats, const void *const *p, long o0, int ob, float *res) {
    long ldf = row_floats(fmt, K, group), supers = fmt == 1 ? K / SB : 0;
    const float *xl = xf + (K + QB - 1) / QB, *xs = xl + supers * 8;
    if (isa == 2 && fmt == 1 && mats == 2 && ob == PB && K % SB == 0) /* one row, a whole block */
        flowmoe_packed_row_block_avx512(xq, xl, xs, K, group, p, o0, res);
    else if (isa == 2)
        flowmoe_packed_block_avx512(fmt, xq, K, xf, xl, xs, ldf, n, K, group, mats, p, o0, ob, res);
    else if (isa == 1)
        flowmoe_packed_block_avx2(fmt, xq, K, xf, xl, xs, ldf, n, K, group, mats, p, o0, ob, res);
    else
        for (int m = 0; m < mats; m++)
            block_portable(fmt, xq, K, xf, xl, xs, ldf, n, K, group, p[3 * m], p[3 * m + 1], p[3 * m + 2], o0, ob,
                           res + m * n * PB);
}

/* The address `rows` rows of `row_bytes` past base (null stays null). */
static inline const void *rows_on(const void *base, long rows, long row_bytes) {
    return base ? (const char *)base + rows * row_bytes : NULL;
}

/* dst [n, K] fp32 = x [n, K] (fp32, or bf16 where `bf16`). */
static void widen(const void *x, int n, long K, int bf16, float *dst) {
    for (long i = 0; i < n * K; i++) dst[i] = bf16_or_float(x, i, bf16);
}

/* The expert FFNs of a group of experts in one parallel pass, as flowmoe_ffn_group (cpu_expert.c)
   computes them from weights in the model's dtype: act_e [n_e, I] = activation(x_e gate^T + bg,
   x_e up^T + bu), out_e [n_e, H] = act_e down^T + bd, x_e and act_e quantized per block (the
   header). weights: 9 pointers per expert, (q, scale, zero) of gate [I, H], up [I, H] and down
   [H, I] in `fmt` (zero null for int8); x_e (contiguous rows) and out ([sum n_e, H]) in bf16 where
   `bf16`, else fp32; biases fp32 or null. Returns 0, or 1 where there is no memory for the buffers. */
int flowmoe_packed_ffn_group(int experts, const void *const *xs, const int *ns, long H, long I, int fmt,
                             long group, const void *const *weights, const float *const *gate_up_biases,
                             const float *const *down_biases, int clamped, float alpha, float limit, int bf16,
                             void *out, int isa, int threads) {
    /* down's blocks: pairs (at one row, rows [0, half) beside [half, 2 half), a block of each, as gate's
       beside up's; else two blocks in turn), then the rest alone */
    long half = H / (2 * PB) * PB, pairs = half / PB, rest = (H - 2 * half + PB - 1) / PB;
    long up_blocks = (I + PB - 1) / PB, down_blocks = pairs + rest, rows = 0;
    long first[experts > 0 ? experts : 1];
    for (int e = 0; e < experts; e++) first[e] = rows, rows += ns[e];
    long at_least = rows > 0 ? rows : 1, xfl = row_floats(fmt, H, group), afl = row_floats(fmt, I, group);
    float *xw = malloc(sizeof(float) * at_least * H), *acts = malloc(sizeof(float) * at_least * I);
    float *xf = malloc(sizeof(float) * at_least * xfl), *af = malloc(sizeof(float) * at_least * afl);
    int8_t *xq = malloc(at_least * H), *aq = malloc(at_least * I); /* the rows' levels */
    if (!xw || !acts || !xf || !af || !xq || !aq) {
        free(xw), free(acts), free(xf), free(af), free(xq), free(aq);
        return 1;
    }
    for (int e = 0; e < experts; e++) widen(xs[e], ns[e], H, bf16, xw + first[e] * H);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) quantize_row(xw + r * H, H, fmt, group, isa, xq + r * H, xf + r * xfl);
        int id = omp_get_thread_num(), team = omp_get_num_threads();
        span ups = share_of(experts, ns, up_blocks, id, team), downs = share_of(experts, ns, down_blocks, id, team);
        for (long t = ups.from; t < ups.to; t++) {
            int e = (int)(t / up_blocks), n = ns[e];
            long o0 = t % up_blocks * PB;
            int ob = (int)(I - o0 < PB ? I - o0 : PB);
            const void *const *w = weights + 9L * e;
            const float *bias = gate_up_biases[e];
            float gu[2 * n * PB], *g = gu, *u = gu + n * PB, *act = acts + first[e] * I; /* gate's, up's */
            for (int m = 0, mats = n == 1 ? 2 : 1; m < 2; m += mats) /* the header's one-row blocks */
                packed_block(isa, fmt, xq + first[e] * H, xf + first[e] * xfl, n, H, group, mats, w + 3 * m, o0, ob,
                             gu + m * n * PB);
            for (int r = 0; r < n; r++)
                for (int j = 0; j < ob; j++) {
                    float gv = g[r * PB + j] + (bias ? bias[o0 + j] : 0.0f);
                    float uv = u[r * PB + j] + (bias ? bias[I + o0 + j] : 0.0f);
                    act[r * I + o0 + j] = swiglu(gv, uv, clamped, alpha, limit);
                }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) quantize_row(acts + r * I, I, fmt, group, isa, aq + r * I, af + r * afl);
        for (long t = downs.from; t < downs.to; t++) {
            int e = (int)(t / down_blocks), n = ns[e], both = t % down_blocks < pairs ? 2 : 1, mats = n == 1 ? both : 1;
            long b = t % down_blocks, apart = n == 1 ? half : PB; /* rows between a pair's blocks */
            long o0 = b < pairs ? b * PB * (n == 1 ? 1 : 2) : 2 * half + (b - pairs) * PB;
            int ob = (int)(H - o0 < PB ? H - o0 : PB);
            const float *bias = down_biases[e];
            const void *const *w = weights + 9L * e + 6;
            long scales = fmt == 1 ? (I + group - 1) / group * 2 : 4; /* bytes of a row's scales (and zeros) */
            const void *p[6] = {w[0], w[1], w[2], rows_on(w[0], apart, fmt == 1 ? (I + 1) / 2 : I),
                                rows_on(w[1], apart, scales), rows_on(w[2], apart, scales)};
            float res[2 * n * PB];
            for (int m = 0; m < both; m += mats)
                packed_block(isa, fmt, aq + first[e] * I, af + first[e] * afl, n, I, group, mats, p + 3 * m, o0, ob,
                             res + m * n * PB);
            for (int m = 0; m < both; m++)
                for (int r = 0; r < n; r++)
                    for (int j = 0; j < ob; j++) {
                        long o = o0 + m * apart + j, i = (first[e] + r) * H + o;
                        float v = res[(m * n + r) * PB + j] + (bias ? bias[o] : 0.0f);
                        if (bf16)
                            ((uint16_t *)out)[i] = float_to_bf16(v);
                        else
                            ((float *)out)[i] = v;
                    }
        }
    }
    free(xw), free(acts), free(xf), free(af), free(xq), free(aq);
    return 0;
}

/* One projection of a few rows or many (an attention projection's, kept packed): out [n, R] = x [n, K]
   W^T + bias, W [R, K] in `fmt` at weights (q, scale, zero; zero null for int8), x quantized per block
   as the FFNs' x is (the header), each row's outputs the same bits whatever n, the threads and the
   block. Threads: OpenMP over (chunks of up to CR rows) x (blocks of PB weight rows); one row takes
   its blocks in pairs, rows [0, half) beside [half, 2 half), as the FFNs' down does (the header's
   one-row blocks: two streams through the matrix). x and out in bf16 where `bf16`, else fp32; bias
   fp32 or null. Returns 0, or 1 where there is no memory for the buffers. */
#define CR 32 /* rows of levels a block reads together: cpu_packed.py's MAX_ROWS */
int flowmoe_packed_linear(const void *x, long n, long K, long R, int fmt, long group, const void *const *weights,
                          const float *bias, int bf16, void *out, int isa, int threads) {
    long half = n == 1 ? R / (2 * PB) * PB : 0, pairs = half / PB, blocks = pairs + (R - 2 * half + PB - 1) / PB;
    long at_least = n > 0 ? n : 1, xfl = row_floats(fmt, K, group), chunks = (n + CR - 1) / CR;
    long row_bytes = fmt == 1 ? (K + 1) / 2 : K, scales = fmt == 1 ? (K + group - 1) / group * 2 : 4;
    const void *p[6] = {weights[0], weights[1], weights[2], rows_on(weights[0], half, row_bytes),
                        rows_on(weights[1], half, scales), rows_on(weights[2], half, scales)};
    float *xw = malloc(sizeof(float) * at_least * K), *xf = malloc(sizeof(float) * at_least * xfl);
    int8_t *xq = malloc(at_least * K); /* the rows' levels */
    if (!xw || !xf || !xq) {
        free(xw), free(xf), free(xq);
        return 1;
    }
    widen(x, (int)n, K, bf16, xw);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) quantize_row(xw + r * K, K, fmt, group, isa, xq + r * K, xf + r * xfl);
#pragma omp for schedule(static)
        for (long t = 0; t < chunks * blocks; t++) {
            long r0 = t / blocks * CR, b = t % blocks, o0 = b < pairs ? b * PB : 2 * half + (b - pairs) * PB;
            int rows = (int)(n - r0 < CR ? n - r0 : CR), ob = (int)(R - o0 < PB ? R - o0 : PB);
            int mats = b < pairs ? 2 : 1;
            float res[2 * rows * PB];
            packed_block(isa, fmt, xq + r0 * K, xf + r0 * xfl, rows, K, group, mats, p, o0, ob, res);
            for (int m = 0; m < mats; m++)
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < ob; j++) {
                        long o = o0 + m * half + j, i = (r0 + r) * R + o;
                        float v = res[(m * rows + r) * PB + j] + (bias ? bias[o] : 0.0f);
                        if (bf16)
                            ((uint16_t *)out)[i] = float_to_bf16(v);
                        else
                            ((float *)out)[i] = v;
                    }
        }
    }
    free(xw), free(xf), free(xq);
    return 0;
}
