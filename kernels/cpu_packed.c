/* Expert FFNs on the CPU reading quantized weights as they are packed (built by cpu_packed.py).

   The same SwiGLU FFN as cpu_expert.c's flowmoe_ffn_group (gate/up -> activation -> down), but each
   weight is read in its packed form and widened in registers, never dequantized in memory: a decode
   step reads 1 byte per int8 weight and ~0.52 per int4 weight instead of the 2-4 of bf16/fp32.
   Formats (flowmoe/model/quantized.py):

   * int8 (fmt 0): q int8 [R, K], one float32 scale per row: y = scale x sum_k q x.
   * int4 (fmt 1): q two 4-bit levels per byte [R, ceil(K / 2)] (column 2i in the low nibble of
     byte i, 2i + 1 in the high one), a float16 scale and zero per group of `group` columns of a row
     (group a multiple of 16): y = sum_groups scale x sum_k (q - zero) x
     = sum_groups scale x (sum_k q x - zero x sum_k x), as the blocks compute it: the group's sums
     of x (group_sums) are a row's, once per call, shared by all the weight rows it meets.

   Each output is summed in one fixed order, whatever the number of rows and threads: 8 lanes,
   lane l taking the columns k = l mod 8 (int8) or, within each 16 columns, 2l (the even lanes)
   and 2l + 1 (the odd lanes: a second accumulator) of q x, each in k order with a fused
   multiply-add where the block has one; int4 adds each group's (even + odd lanes - zero x the
   lane's sum of the same columns of x) times the group's scale into the row's lanes; then the 8
   lanes in a fixed tree (hsum8: i + i + 4, then + 2, + 1), then the last K % 8 (int8) or K % 16
   (int4) columns in order, each dequantized as (q - zero) x scale. int8 differs from
   dequantize-then-multiply by the scale's rounding, taken once per row instead of per weight; int4
   also sums the levels q (0..15) and not q - zero, so its sums' rounding scales with
   sum |q| |x| <= sum |q - zero| |x| + |zero| sum |x| (tests/test_cpu_packed.py's bound).
   x is read in int4 column order for int4 weights: within each 16 columns the 8 even ones, then the
   8 odd ones (those past the last full 16 in place), as the low and high nibbles of 8 bytes give them.

   Blocks: `isa` 1 takes cpu_packed_avx2.c's (AVX2 + FMA + F16C intrinsics, chosen by the CPU's
   features in cpu_packed.py), 0 the portable one here; both give each output the order above (the
   portable one in plain C with 8-element arrays, which the compiler vectorizes for the host).
   Threads: OpenMP over blocks of PB weight rows of all experts, the count the caller passes. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PB 4          /* weight rows per block */
#define MAX_GROUP 256 /* the most columns per int4 group (a block dequantizes one group into a buffer) */
#define CHUNK 256     /* int8 columns per chunk of the portable block */

/* cpu_packed_avx2.c */
void flowmoe_packed_block_avx2(int fmt, const float *x, long ldx, const float *sums, int n, long K, long group,
                               const void *q, const void *scale, const void *zero, long o0, int ob, float *res);

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

/* Where column k of K goes in int4 column order (the header). */
static inline long int4_position(long k, long K) {
    if (k >= K / 16 * 16) return k;
    long i = k & 15;
    return (k & ~15L) + (i & 1 ? 8 : 0) + (i >> 1);
}

/* Level k of an int4 row. */
static inline int int4_level(const uint8_t *row, long k) {
    return k & 1 ? row[k >> 1] >> 4 : row[k >> 1] & 15;
}

/* int4's group sums of x [n, K] (int4 column order) into sums [n, groups, 8]: lane l of group g
   is the sum of the columns c + l, then c + 8 + l, for each 16 columns c of the group in order
   (those before the last full 16 only; the tail's are 0), the columns that lane l of a block's
   even and odd accumulators meets. */
static void group_sums(const float *x, int n, long K, long group, float *sums) {
    long k16 = K / 16 * 16, groups = (K + group - 1) / group;
    for (int r = 0; r < n; r++)
        for (long g = 0; g < groups; g++) {
            float b[8] = {0};
            long end = (g + 1) * group < k16 ? (g + 1) * group : k16;
            for (long c = g * group; c < end; c += 16)
                for (int l = 0; l < 8; l++) {
                    b[l] += x[r * K + c + l];
                    b[l] += x[r * K + c + 8 + l];
                }
            memcpy(sums + (r * groups + g) * 8, b, sizeof b);
        }
}

/* The last columns [k0, K) of weight row o against x's row (in order; int4: (q - zero) x scale). */
float flowmoe_packed_tail(int fmt, const float *xr, long K, long group, const void *q, const void *scale,
                          const void *zero, long o, long k0, float s) {
    if (fmt == 0) {
        const int8_t *row = (const int8_t *)q + o * K;
        for (long k = k0; k < K; k++) s += xr[k] * (float)row[k];
        return s;
    }
    const uint8_t *row = (const uint8_t *)q + o * ((K + 1) / 2);
    long groups = (K + group - 1) / group;
    for (long k = k0; k < K; k++) {
        long g = o * groups + k / group;
        float z = flowmoe_half_to_float(((const uint16_t *)zero)[g]);
        float sc = flowmoe_half_to_float(((const uint16_t *)scale)[g]);
        s += xr[k] * (((float)int4_level(row, k) - z) * sc);
    }
    return s;
}

/* The portable block: res[r * PB + j] = x[r] . weight row o0 + j for r < n, j < ob, each weight
   chunk widened once into a buffer (int8: q; int4: q, one group) and multiplied there against
   every row; int4: `sums` x's group sums (group_sums, a row's groups x 8 floats on). */
static void block_portable(int fmt, const float *x, long ldx, const float *sums, int n, long K, long group,
                           const void *q, const void *scale, const void *zero, long o0, int ob, float *res) {
    float buf[PB][MAX_GROUP > CHUNK ? MAX_GROUP : CHUNK];
    float total[n][PB][8];
    memset(total, 0, sizeof total);
    if (fmt == 0) {
        long kv = K / 8 * 8;
        for (long k0 = 0; k0 < kv; k0 += CHUNK) {
            long kc = kv - k0 < CHUNK ? kv - k0 : CHUNK;
            for (int j = 0; j < ob; j++)
                for (long k = 0; k < kc; k++) buf[j][k] = (float)((const int8_t *)q)[(o0 + j) * K + k0 + k];
            for (int r = 0; r < n; r++)
                for (int j = 0; j < ob; j++)
                    for (long k = 0; k < kc; k += 8)
                        for (int l = 0; l < 8; l++) total[r][j][l] += x[r * ldx + k0 + k + l] * buf[j][k + l];
        }
        for (int r = 0; r < n; r++)
            for (int j = 0; j < ob; j++) {
                float s = flowmoe_packed_tail(0, x + r * ldx, K, group, q, scale, zero, o0 + j, kv, hsum8(total[r][j]));
                res[r * PB + j] = s * ((const float *)scale)[o0 + j];
            }
        return;
    }
    long k16 = K / 16 * 16, bytes = (K + 1) / 2, groups = (K + group - 1) / group;
    for (long g0 = 0; g0 < k16; g0 += group) {
        long gc = k16 - g0 < group ? k16 - g0 : group, g = g0 / group;
        float sc[PB], z[PB];
        for (int j = 0; j < ob; j++) {
            const uint8_t *row = (const uint8_t *)q + (o0 + j) * bytes + g0 / 2;
            z[j] = flowmoe_half_to_float(((const uint16_t *)zero)[(o0 + j) * groups + g]);
            sc[j] = flowmoe_half_to_float(((const uint16_t *)scale)[(o0 + j) * groups + g]);
            for (long c = 0; c < gc; c += 16)
                for (int i = 0; i < 8; i++) {
                    buf[j][c + i] = (float)(row[c / 2 + i] & 15);
                    buf[j][c + 8 + i] = (float)(row[c / 2 + i] >> 4);
                }
        }
        for (int r = 0; r < n; r++)
            for (int j = 0; j < ob; j++) {
                float even[8] = {0}, odd[8] = {0};
                const float *xr = x + r * ldx + g0;
                for (long c = 0; c < gc; c += 16)
                    for (int i = 0; i < 8; i++) {
                        even[i] += xr[c + i] * buf[j][c + i];
                        odd[i] += xr[c + 8 + i] * buf[j][c + 8 + i];
                    }
                const float *b = sums + (r * groups + g) * 8;
                for (int i = 0; i < 8; i++) total[r][j][i] += sc[j] * ((even[i] + odd[i]) - z[j] * b[i]);
            }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++)
            res[r * PB + j] = flowmoe_packed_tail(1, x + r * ldx, K, group, q, scale, zero, o0 + j, k16,
                                                  hsum8(total[r][j]));
}

static inline void packed_block(int isa, int fmt, const float *x, long ldx, const float *sums, int n, long K,
                                long group, const void *const *p, long o0, int ob, float *res) {
    if (isa == 1)
        flowmoe_packed_block_avx2(fmt, x, ldx, sums, n, K, group, p[0], p[1], p[2], o0, ob, res);
    else
        block_portable(fmt, x, ldx, sums, n, K, group, p[0], p[1], p[2], o0, ob, res);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16 rounded to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* SiLU(gate) * up, or GPT-OSS's clamped form (cpu_expert.c's `activation`). */
static inline float swiglu(float g, float u, int clamped, float alpha, float limit) {
    if (!clamped) return g / (1.0f + expf(-g)) * u;
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

/* dst [n, K] fp32 = x [n, K] (fp32, or bf16 where `bf16`), in int4 column order where `ordered`. */
static void widen(const void *x, int n, long K, int bf16, int ordered, float *dst) {
    for (int r = 0; r < n; r++)
        for (long k = 0; k < K; k++) {
            float v = bf16 ? bf16_to_float(((const uint16_t *)x)[r * K + k]) : ((const float *)x)[r * K + k];
            dst[r * K + (ordered ? int4_position(k, K) : k)] = v;
        }
}

/* The expert FFNs of a group of experts in one parallel pass, as flowmoe_ffn_group (cpu_expert.c)
   computes them from weights in the model's dtype: act_e [n_e, I] = activation(x_e gate^T + bg,
   x_e up^T + bu), out_e [n_e, H] = act_e down^T + bd. weights: 9 pointers per expert, (q, scale,
   zero) of gate [I, H], up [I, H] and down [H, I] in `fmt` (zero null for int8); x_e (contiguous
   rows) and out ([sum n_e, H]) in bf16 where `bf16`, else fp32; biases fp32 or null. Returns 0, or 1
   where there is no memory for the fp32 buffers. */
int flowmoe_packed_ffn_group(int experts, const void *const *xs, const int *ns, long H, long I, int fmt,
                             long group, const void *const *weights, const float *const *gate_up_biases,
                             const float *const *down_biases, int clamped, float alpha, float limit, int bf16,
                             void *out, int isa, int threads) {
    long up_blocks = (I + PB - 1) / PB, down_blocks = (H + PB - 1) / PB, rows = 0;
    long first[experts > 0 ? experts : 1];
    for (int e = 0; e < experts; e++) first[e] = rows, rows += ns[e];
    int ordered = fmt == 1;
    long at_least = rows > 0 ? rows : 1; /* int4: a row's group sums of x and of the activations */
    long hidden_sums = ordered ? 8 * ((H + group - 1) / group) : 0, act_sums = ordered ? 8 * ((I + group - 1) / group) : 0;
    float *xw = malloc(sizeof(float) * at_least * H), *acts = malloc(sizeof(float) * at_least * I);
    float *xsums = ordered ? malloc(sizeof(float) * at_least * hidden_sums) : NULL; /* [rows, groups, 8] */
    float *asums = ordered ? malloc(sizeof(float) * at_least * act_sums) : NULL;
    if (!xw || !acts || (ordered && (!xsums || !asums))) {
        free(xw), free(acts), free(xsums), free(asums);
        return 1;
    }
    for (int e = 0; e < experts; e++) widen(xs[e], ns[e], H, bf16, ordered, xw + first[e] * H);
    if (ordered) group_sums(xw, (int)rows, H, group, xsums);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < experts * up_blocks; t++) {
            int e = (int)(t / up_blocks), n = ns[e];
            long o0 = t % up_blocks * PB;
            int ob = (int)(I - o0 < PB ? I - o0 : PB);
            const void *const *w = weights + 9L * e;
            const float *bias = gate_up_biases[e], *x = xw + first[e] * H;
            float g[n * PB], u[n * PB], *act = acts + first[e] * I;
            const float *sums = ordered ? xsums + first[e] * hidden_sums : NULL;
            packed_block(isa, fmt, x, H, sums, n, H, group, w, o0, ob, g);
            packed_block(isa, fmt, x, H, sums, n, H, group, w + 3, o0, ob, u);
            for (int r = 0; r < n; r++)
                for (int j = 0; j < ob; j++) {
                    float gv = g[r * PB + j] + (bias ? bias[o0 + j] : 0.0f);
                    float uv = u[r * PB + j] + (bias ? bias[I + o0 + j] : 0.0f);
                    long at = ordered ? int4_position(o0 + j, I) : o0 + j;
                    act[r * I + at] = swiglu(gv, uv, clamped, alpha, limit);
                }
        }
        if (ordered) {
#pragma omp for schedule(static)
            for (long r = 0; r < rows; r++) group_sums(acts + r * I, 1, I, group, asums + r * act_sums);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < experts * down_blocks; t++) {
            int e = (int)(t / down_blocks), n = ns[e];
            long o0 = t % down_blocks * PB;
            int ob = (int)(H - o0 < PB ? H - o0 : PB);
            const float *bias = down_biases[e];
            float res[n * PB];
            const float *sums = ordered ? asums + first[e] * act_sums : NULL;
            packed_block(isa, fmt, acts + first[e] * I, I, sums, n, I, group, weights + 9L * e + 6, o0, ob, res);
            for (int r = 0; r < n; r++)
                for (int j = 0; j < ob; j++) {
                    float v = res[r * PB + j] + (bias ? bias[o0 + j] : 0.0f);
                    long i = (first[e] + r) * H + o0 + j;
                    if (bf16)
                        ((uint16_t *)out)[i] = float_to_bf16(v);
                    else
                        ((float *)out)[i] = v;
                }
        }
    }
    free(xw), free(acts), free(xsums), free(asums);
    return 0;
}
