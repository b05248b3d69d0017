/* Single-query decode attention with AVX2 + FMA intrinsics: cpu_attention.c's kernel for x86 CPUs
   with AVX2 and FMA where the library has no AVX-512 one (chosen at run time by cpu_attention.py;
   compiled with a target attribute, so it is in every x86 build and runs only where the CPU has
   AVX2 and FMA).

   The same work and the same fixed order as cpu_attention.c (whose driver runs this file's parts): items of (sequence, KV head, chunk of
   `chunk` keys) shared among the threads, each giving its query heads' (acc, m, l) in base 2
   against the chunk's maximum; a second pass merges each (sequence, KV head)'s items in key order,
   adds the sink and writes the output in the cache's dtype. A sequence gets the same result in any
   batch and with any thread count. Keys and values are read once per item for up to HT query heads,
   bf16 ones widened in registers (8 per 128-bit load, in order); everything accumulates in fp32.
   On torch's path this was the flash kernel at 29-32% of the read roof on a 2-vCPU AMD EPYC (AVX2),
   most of a decode step's attention being its per-call cost at short caches (bench/RESULTS.md). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define HT 4  /* query heads per pass over an item's keys and values */
#define KB 16 /* keys per block of the value pass (their values stay in L1 across D's tiles) */

/* 2^x for x <= 0 (below -126, -inf included: 0): 2^round(x) times a degree-7 Taylor polynomial of
   e^(f ln 2), |f| <= 1/2, as cpu_attention.c's. */
static inline AVX2 __m256 exp2_8(__m256 x) {
    __m256 low = _mm256_set1_ps(-126.0f), keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
    x = _mm256_max_ps(x, low);
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.69314718055994531f));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

/* The 8 lanes' sum: lane i + lane i + 4, then + 2, + 1. */
static inline AVX2 float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* Elements [i, i + 8) of a row as fp32: fp32, or bf16 widened (shifted into the high half). */
static inline AVX2 __attribute__((always_inline)) __m256 load8(const void *p, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16, rounded to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline AVX2 __m128i to_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    __m256i high = _mm256_srli_epi32(rounded, 16); /* 8 x 16 bits in 32-bit lanes -> packed */
    return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

typedef struct { /* cpu_attention.c's */
    int group, D;
    const char *k, *v;
    long k_slot, k_head, k_pos, v_slot, v_head, v_pos; /* bytes */
} problem;

/* cpu_attention.c's driver, with this file's parts, and its merge's weights */
float flowmoe_attention_weights(const problem *P, const float *res, int items, int h, int kh, const float *sinks,
                                float *factor);
typedef void (*attention_prep)(const char *src, int bf16, int D, float scale, float *dst);
typedef void (*attention_item)(const problem *P, int bf16, const float *q, long slot, int kh, long a, int n,
                               float *res);
typedef void (*attention_merge)(const problem *P, int bf16, const float *res, int items, int kh,
                                const float *sinks, char *out);
int flowmoe_attention_run(int batch, const int *seqs, int heads, int kv_heads, int D, int bf16, const void *q,
                          long q_row, long q_head, const void *k, long k_slot, long k_head, long k_pos,
                          const void *v, long v_slot, long v_head, long v_pos, const float *sinks, float scale,
                          int chunk, void *out, long out_row, int threads, int pad, attention_prep prep,
                          attention_item work, attention_merge merge);

/* Lane j of the result = the sum of a[j]'s lanes (a transposing tree of horizontal adds). */
static inline AVX2 __m256 sum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* lanes 0-3 and 4-7 of a[0..3] | a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* s[h * ldS + j] = q_h . key_j for ht heads (q rows D apart) and n keys (key j at key + j * ldk),
   8 keys at a time (their 8 dot products summed in one tree; past the last key, the last one again:
   the caller drops those scores). */
static inline AVX2 __attribute__((always_inline)) void scores(int ht, int bf16, const float *q, const char *key,
                                                            long ldk, int n, int D, float *s, long ldS) {
    for (int j0 = 0; j0 < n; j0 += 8) {
        const char *kp[8];
        for (int j = 0; j < 8; j++) kp[j] = key + (j0 + j < n ? j0 + j : n - 1) * ldk;
        for (int h = 0; h < ht; h++) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + h * D + d);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, load8(kp[j], d, bf16), acc[j]);
            }
            _mm256_storeu_ps(s + h * ldS + j0, sum8x8(acc));
        }
    }
}

/* acc[h][d0 : d0 + 16] += sum_j w[h * ldS + j] v_j[same] over nk keys v_j = val + j * ldv (acc rows
   D apart). */
static inline AVX2 __attribute__((always_inline)) void weigh(int ht, int bf16, const char *val, long ldv, int nk,
                                                           const float *w, long ldS, float *acc, int D, int d0) {
    __m256 a[HT][2];
    for (int h = 0; h < ht; h++)
        for (int t = 0; t < 2; t++) a[h][t] = _mm256_loadu_ps(acc + h * D + d0 + 8 * t);
    for (int j = 0; j < nk; j++) {
        __m256 v0 = load8(val + j * ldv, d0, bf16), v1 = load8(val + j * ldv, d0 + 8, bf16);
        for (int h = 0; h < ht; h++) {
            __m256 p = _mm256_broadcast_ss(w + h * ldS + j);
            a[h][0] = _mm256_fmadd_ps(p, v0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(p, v1, a[h][1]);
        }
    }
    for (int h = 0; h < ht; h++)
        for (int t = 0; t < 2; t++) _mm256_storeu_ps(acc + h * D + d0 + 8 * t, a[h][t]);
}

/* A pass of ht query heads q [ht][D] (fp32, pre-scaled to base 2) over n keys and values at key /
   val: res[h] = (acc [D], m, l) in base 2 (rows D + 2 apart). */
static inline AVX2 __attribute__((always_inline)) void pass(int ht, int bf16, const problem *P, const float *q,
                                                          const char *key, const char *val, int n, float *res) {
    int D = P->D;
    long nb = (n + 7) / 8 * 8;
    float s[ht * nb], acc[ht * D];
    scores(ht, bf16, q, key, P->k_pos, n, D, s, nb);
    for (int h = 0; h < ht; h++) {
        float *sh = s + h * nb;
        for (long j = n; j < nb; j++) sh[j] = -INFINITY;
        __m256 best = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
        for (long j = 0; j < nb; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(sh + j));
        __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
        b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
        float m = _mm_cvtss_f32(_mm_max_ss(b4, _mm_movehdup_ps(b4)));
        for (long j = 0; j < nb; j += 8) {
            __m256 p = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), _mm256_set1_ps(m)));
            _mm256_storeu_ps(sh + j, p);
            total = _mm256_add_ps(total, p);
        }
        res[h * (D + 2) + D] = m;
        res[h * (D + 2) + D + 1] = hsum8(total);
    }
    memset(acc, 0, sizeof acc);
    for (int j0 = 0; j0 < n; j0 += KB) {
        int nk = n - j0 < KB ? n - j0 : KB;
        for (int d0 = 0; d0 < D; d0 += 16)
            weigh(ht, bf16, val + j0 * P->v_pos, P->v_pos, nk, s + j0, nb, acc, D, d0);
    }
    for (int h = 0; h < ht; h++) memcpy(res + h * (D + 2), acc + h * D, D * sizeof *acc);
}

#define PASS(HT_, ...) (bf16 ? pass(HT_, 1, __VA_ARGS__) : pass(HT_, 0, __VA_ARGS__))

/* One work item: the `group` query heads q [group][D] of KV head kh against keys [a, a + n) of
   cache slot `slot`: res [group][D + 2] = (acc, m, l) in base 2. */
static AVX2 void item(const problem *P, int bf16, const float *q, long slot, int kh, long a, int n, float *res) {
    const char *key = P->k + slot * P->k_slot + kh * P->k_head + a * P->k_pos;
    const char *val = P->v + slot * P->v_slot + kh * P->v_head + a * P->v_pos;
    for (int h0 = 0; h0 < P->group; h0 += HT) {
        int ht = P->group - h0 < HT ? P->group - h0 : HT;
        const float *qh = q + h0 * P->D;
        float *r = res + h0 * (P->D + 2);
        switch (ht) { /* constant pass widths: the accumulators stay in registers */
        case 1: PASS(1, P, qh, key, val, n, r); break;
        case 2: PASS(2, P, qh, key, val, n, r); break;
        case 3: PASS(3, P, qh, key, val, n, r); break;
        default: PASS(4, P, qh, key, val, n, r); break;
        }
    }
}

/* Out row of heads [kh g, (kh + 1) g) from the items of one (sequence, KV head), merged in order;
   `sinks` [heads] or null. */
static AVX2 void merge(const problem *P, int bf16, const float *res, int items, int kh, const float *sinks,
                       char *out) {
    int D = P->D, g = P->group;
    for (int h = 0; h < g; h++) {
        float factor[items], l = flowmoe_attention_weights(P, res, items, h, kh, sinks, factor);
        for (int d = 0; d < D; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < items; c++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(factor[c]), _mm256_loadu_ps(res + (c * g + h) * (D + 2) + d), acc);
            acc = _mm256_div_ps(acc, _mm256_set1_ps(l));
            long at = (long)(kh * g + h) * D + d;
            if (bf16)
                _mm_storeu_si128((__m128i *)((uint16_t *)out + at), to_bf16(acc));
            else
                _mm256_storeu_ps((float *)out + at, acc);
        }
    }
}

/* One query head [D] in fp32 times `scale`. */
static AVX2 void prep(const char *src, int bf16, int D, float scale, float *dst) {
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8(src, d, bf16), _mm256_set1_ps(scale)));
}

/* cpu_attention.c's flowmoe_decode_attention (the same arguments and results) on AVX2 + FMA, run by
   its driver with this file's parts: D % 16 == 0. */
int flowmoe_decode_attention_avx2(int batch, const int *seqs, int heads, int kv_heads, int D, int bf16,
                                  const void *q, long q_row, long q_head, const void *k, long k_slot, long k_head,
                                  long k_pos, const void *v, long v_slot, long v_head, long v_pos,
                                  const float *sinks, float scale, int chunk, void *out, long out_row, int threads) {
    return flowmoe_attention_run(batch, seqs, heads, kv_heads, D, bf16, q, q_row, q_head, k, k_slot, k_head, k_pos,
                                 v, v_slot, v_head, v_pos, sinks, scale, chunk, out, out_row, threads, 0, prep,
                                 item, merge);
}
