/* Single-query decode attention over a KV cache on the CPU at memory speed (cpu_attention.py).

   A decoding sequence's query heads attend to the keys [lo, hi) of their KV head in cache slot
   `slot`: out_h = sum_j softmax_j(scale q_h . k_j) v_j, where an attention sink s_h adds exp(s_h)
   to the softmax's denominator. The g query heads of a KV head share one pass over its keys and
   values, which are read once from memory. Work items are (sequence, KV head, chunk of `chunk`
   keys), shared among the threads (flash-decoding: one sequence's long cache feeds every thread).
   An item computes its chunk's scores (in L1), their softmax in base 2 against the chunk's
   maximum and the values summed with those weights (the item's m, l, acc); a second pass merges
   each (sequence, KV head)'s chunks in order, adds the sink and writes the output in the cache's
   dtype. The chunks depend only on the key range, so a sequence gets the same result whatever
   batch it is in and however many threads run.

   Keys and values are read as fp32, bf16 ones widened in registers (AVX512-BF16's dot product
   runs at half the FMA rate here and needs bf16 weights), each loaded once for up to HT heads;
   everything accumulates in fp32. The kernel is built only for AVX-512 hosts (elsewhere the library
   has no flowmoe_decode_attention: cpu_attention_avx2.c's kernel, or torch's path); the driver that
   shares out the items and merges them (flowmoe_attention_run) is built everywhere and runs both. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LOG2E 1.4426950408889634f

typedef struct {
    int group, D;
    const char *k, *v;
    long k_slot, k_head, k_pos, v_slot, v_head, v_pos; /* bytes */
} problem;

/* Query head h (of KV head kh's group) over `items` items' (acc, m, l) at res: each item's factor
   against their common maximum (factor[c]) and the softmax's denominator (returned), with the
   sink where `sinks`. */
float flowmoe_attention_weights(const problem *P, const float *res, int items, int h, int kh, const float *sinks,
                                float *factor) {
    int D = P->D, g = P->group;
    float m = -INFINITY;
    for (int c = 0; c < items; c++) {
        float mc = res[(c * g + h) * (D + 2) + D];
        m = mc > m ? mc : m;
    }
    float l = sinks ? exp2f(sinks[kh * g + h] * LOG2E - m) : 0.0f;
    for (int c = 0; c < items; c++) {
        const float *r = res + (c * g + h) * (D + 2);
        factor[c] = exp2f(r[D] - m);
        l += r[D + 1] * factor[c];
    }
    return l;
}

/* A kernel's parts for the driver below: one query head in fp32 times `scale` (its own order for
   bf16), one work item's (acc, m, l) per query head, and a (sequence, KV head)'s merge into its out
   row. */
typedef void (*attention_prep)(const char *src, int bf16, int D, float scale, float *dst);
typedef void (*attention_item)(const problem *P, int bf16, const float *q, long slot, int kh, long a, int n,
                               float *res);
typedef void (*attention_merge)(const problem *P, int bf16, const float *res, int items, int kh,
                                const float *sinks, char *out);

/* Decode attention of `batch` sequences, seqs[i] = (row, slot, lo, hi): the query q[row] [heads,
   D] attends to keys [lo, hi) of cache slot `slot` -> out[row] [heads * D], in the cache's dtype
   (bf16 or fp32, q's too), with a kernel's parts (this file's AVX-512 ones, cpu_attention_avx2.c's).
   Strides in elements; every last dimension contiguous; `sinks` fp32 [heads] or null; scale: the
   scores' factor; `pad`: zero query heads after the last (read by a kernel's widest pass). Returns
   0, or -1 without memory. */
int flowmoe_attention_run(int batch, const int *seqs, int heads, int kv_heads, int D, int bf16, const void *q,
                          long q_row, long q_head, const void *k, long k_slot, long k_head, long k_pos,
                          const void *v, long v_slot, long v_head, long v_pos, const float *sinks, float scale,
                          int chunk, void *out, long out_row, int threads, int pad, attention_prep prep,
                          attention_item work, attention_merge merge) {
    long esize = bf16 ? 2 : 4;
    problem P = {heads / kv_heads, D, k, v, k_slot * esize, k_head * esize, k_pos * esize, v_slot * esize,
                 v_head * esize, v_pos * esize};
    long *first = malloc((batch + 1) * sizeof *first); /* sequence i's items: first[i] .. first[i + 1] */
    /* sequence i's queries in fp32 times scale log2(e), heads D apart, then `pad` zero heads */
    float *qs = malloc(((long)batch * heads + pad) * D * sizeof *qs);
    if (!first || !qs) {
        free(first);
        free(qs);
        return -1;
    }
    memset(qs + (long)batch * heads * D, 0, pad * D * sizeof *qs);
    first[0] = 0;
    for (int i = 0; i < batch; i++) {
        long n = seqs[4 * i + 3] - seqs[4 * i + 2];
        first[i + 1] = first[i] + (n + chunk - 1) / chunk * kv_heads;
    }
    long items = first[batch];
    float *res = malloc(items * P.group * (D + 2) * sizeof *res);
    if (!res) {
        free(first);
        free(qs);
        return -1;
    }
    float scale2 = scale * LOG2E; /* base 2 */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < (long)batch * heads; t++)
            prep((const char *)q + (seqs[4 * (t / heads)] * q_row + t % heads * q_head) * esize, bf16, D, scale2,
                 qs + t * D);
        int i = 0;
#pragma omp for schedule(static)
        for (long t = 0; t < items; t++) {
            while (first[i + 1] <= t) i++;
            while (first[i] > t) i--;
            long per_head = (first[i + 1] - first[i]) / kv_heads, u = t - first[i];
            int kh = (int)(u / per_head);
            long a = seqs[4 * i + 2] + u % per_head * chunk, hi = seqs[4 * i + 3];
            int n = (int)(hi - a < chunk ? hi - a : chunk);
            const float *qi = qs + ((long)i * heads + kh * P.group) * D;
            work(&P, bf16, qi, seqs[4 * i + 1], kh, a, n, res + t * P.group * (D + 2));
        }
#pragma omp for schedule(static)
        for (long t = 0; t < (long)batch * kv_heads; t++) {
            int s = (int)(t / kv_heads), kh = (int)(t % kv_heads);
            long per_head = (first[s + 1] - first[s]) / kv_heads;
            const float *r = res + (first[s] + kh * per_head) * P.group * (D + 2);
            merge(&P, bf16, r, (int)per_head, kh, sinks, (char *)out + seqs[4 * s] * out_row * esize);
        }
    }
    free(res);
    free(first);
    free(qs);
    return 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define HT 4 /* query heads per pass: 16 / HT keys x HT heads of scores per vector */

/* 2^x for x <= 0 (-inf gives 0): 2^round(x) times a degree-7 Taylor polynomial of e^(f ln 2),
   |f| <= 1/2 (truncation error < 1e-8 relative). */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result = the sum of p[i]'s lanes (a transposing tree of shuffles and adds). */
static inline __m512 sum16(const __m512 *p) {
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; k++) /* blocks [a0+a2, a1+a3, b0+b2, b1+b3]: vector 2k, 2k+1 in halves */
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++) /* block b: vector 4k + b */
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) /* block b: vectors 8k + b (lanes 0-1), 8k + 4 + b (lanes 2-3) */
        z[k] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0xEE));
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    /* lane 4b + t holds vector 4t + b */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, w);
}

/* Elements [i, i + 16 w) of a row as w fp32 vectors: fp32 (w = 1), or bf16 (w = 2) widened by one
   unpack each, in "paired" order: of each 32, elements 8c + t at lane 4c + t of the first vector
   and 8c + 4 + t at lane 4c + t of the second (c, t < 4). A dot product is the same in any order
   both sides share; sums over keys are put back in order by `unpair`. */
static inline __attribute__((always_inline)) void load_row(const void *p, long i, int bf16, __m512 *v) {
    if (bf16) {
        __m512i x = _mm512_loadu_si512((const uint16_t *)p + i), zero = _mm512_setzero_si512();
        v[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
        v[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
    } else
        v[0] = _mm512_loadu_ps((const float *)p + i);
}

/* 32 floats in paired order (see load_row) back in order. */
static inline void unpair(float *p) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(a, first, b));
    _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(a, second, b));
}

/* fp32 -> bf16, rounded to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* Scores of `ht` query heads (fp32, pre-scaled, rows D apart, bf16's in paired order) against
   16 / ht keys, key j at key + j * ldk bytes: lane j * ht + h. Each key's vectors are loaded (and
   widened) once for all heads. */
static inline __attribute__((always_inline)) __m512 scores(int ht, int bf16, const float *q, const char *key,
                                                           long ldk, int D) {
    int w = bf16 ? 2 : 1;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16 * w) {
        __m512 qv[HT][2];
        for (int h = 0; h < ht; h++)
            for (int u = 0; u < w; u++) qv[h][u] = _mm512_loadu_ps(q + h * D + d + 16 * u);
        for (int j = 0; j < 16 / ht; j++) {
            __m512 kv[2];
            load_row(key + j * ldk, d, bf16, kv);
            for (int h = 0; h < ht; h++)
                for (int u = 0; u < w; u++) acc[j * ht + h] = _mm512_fmadd_ps(qv[h][u], kv[u], acc[j * ht + h]);
        }
    }
    return sum16(acc);
}

/* acc[h][d0 : d0 + 16 nv] += sum_j w[j * ht + h] v[j][same] for nk keys v[j] = val + j * ldv bytes
   (acc's rows D apart; bf16: nv even, in paired order). */
static inline __attribute__((always_inline)) void weigh(int ht, int nv, int bf16, const char *val, long ldv,
                                                        int nk, const float *w, float *acc, int D, int d0) {
    __m512 a[HT][4];
    for (int h = 0; h < ht; h++)
        for (int t = 0; t < nv; t++) a[h][t] = _mm512_loadu_ps(acc + h * D + d0 + 16 * t);
    for (int j = 0; j < nk; j++) {
        __m512 v[4];
        for (int t = 0; t < nv; t += bf16 ? 2 : 1) load_row(val + j * ldv, d0 + 16 * t, bf16, v + t);
        for (int h = 0; h < ht; h++) {
            __m512 p = _mm512_set1_ps(w[j * ht + h]);
            for (int t = 0; t < nv; t++) a[h][t] = _mm512_fmadd_ps(p, v[t], a[h][t]);
        }
    }
    for (int h = 0; h < ht; h++)
        for (int t = 0; t < nv; t++) _mm512_storeu_ps(acc + h * D + d0 + 16 * t, a[h][t]);
}

/* A pass of `ht` (1, 2 or 4) query heads q [ht][D] (fp32, pre-scaled to base 2), over n keys and
   values at key / val: res[h] = (acc [D], m, l) for the first `real` heads, in base 2 (rows D + 2
   apart; the other heads' are dropped). */
static inline __attribute__((always_inline)) void pass(int ht, int bf16, const problem *P, const float *q,
                                                       int real, const char *key, const char *val, int n,
                                                       float *res) {
    int D = P->D, kt = 16 / ht, esize = bf16 ? 2 : 4;
    int nb = (n + kt - 1) / kt * kt, full = n / kt * kt;
    float acc[HT * D], s[nb * ht], top[16], sums[16], m[HT], l[HT];
    for (int j0 = 0; j0 < full; j0 += kt) {
        _mm512_storeu_ps(s + j0 * ht, scores(ht, bf16, q, key + j0 * P->k_pos, P->k_pos, D));
    }
    if (full < n) { /* the last keys, zero-padded */
        char tail[16 * D * esize] __attribute__((aligned(64)));
        memset(tail, 0, sizeof tail);
        for (int j = full; j < n; j++) memcpy(tail + (j - full) * D * esize, key + j * P->k_pos, D * esize);
        _mm512_storeu_ps(s + full * ht, scores(ht, bf16, q, tail, D * esize, D));
        for (int i = n * ht; i < nb * ht; i++) s[i] = -INFINITY;
    }
    __m512 best = _mm512_set1_ps(-INFINITY); /* softmax numerators against each head's maximum */
    for (int i = 0; i < nb * ht; i += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(s + i));
    _mm512_storeu_ps(top, best);
    for (int h = 0; h < ht; h++) {
        m[h] = top[h];
        for (int i = h + ht; i < 16; i += ht) m[h] = top[i] > m[h] ? top[i] : m[h];
    }
    for (int i = 0; i < 16; i++) top[i] = m[i % ht];
    __m512 mv = _mm512_loadu_ps(top), total = _mm512_setzero_ps();
    for (int i = 0; i < nb * ht; i += 16) {
        __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, p);
        total = _mm512_add_ps(total, p);
    }
    _mm512_storeu_ps(sums, total);
    for (int h = 0; h < ht; h++) {
        l[h] = 0.0f;
        for (int i = h; i < 16; i += ht) l[h] += sums[i];
    }
    memset(acc, 0, sizeof acc);
    for (int j0 = 0; j0 < n; j0 += 16) {
        int nk = n - j0 < 16 ? n - j0 : 16, d0 = 0;
        const char *v = val + j0 * P->v_pos;
        for (; d0 + 64 <= D; d0 += 64) weigh(ht, 4, bf16, v, P->v_pos, nk, s + j0 * ht, acc, D, d0);
        switch ((D - d0) / 16) { /* constant tile sizes: the accumulators stay in registers */
        case 1: weigh(ht, 1, bf16, v, P->v_pos, nk, s + j0 * ht, acc, D, d0); break;
        case 2: weigh(ht, 2, bf16, v, P->v_pos, nk, s + j0 * ht, acc, D, d0); break;
        case 3: weigh(ht, 3, bf16, v, P->v_pos, nk, s + j0 * ht, acc, D, d0); break;
        default: break;
        }
    }
    for (int h = 0; h < real; h++) {
        for (int d = 0; bf16 && d < D; d += 32) unpair(acc + h * D + d);
        memcpy(res + h * (D + 2), acc + h * D, D * sizeof *acc);
        res[h * (D + 2) + D] = m[h];
        res[h * (D + 2) + D + 1] = l[h];
    }
}

#define PASS(HT_, ...) (bf16 ? pass(HT_, 1, __VA_ARGS__) : pass(HT_, 0, __VA_ARGS__))

/* One work item: the `group` query heads q [group][D] of KV head kh against keys [a, a + n) of
   cache slot `slot`: res [group][D + 2] = (acc, m, l) in base 2. */
static void item(const problem *P, int bf16, const float *q, long slot, int kh, long a, int n, float *res) {
    const char *key = P->k + slot * P->k_slot + kh * P->k_head + a * P->k_pos;
    const char *val = P->v + slot * P->v_slot + kh * P->v_head + a * P->v_pos;
    for (int h0 = 0; h0 < P->group; h0 += HT) { /* 4 heads a pass; 3 as 4 (one dropped), 2 and 1 as such */
        int real = P->group - h0 < HT ? P->group - h0 : HT;
        const float *qh = q + h0 * P->D;
        float *r = res + h0 * (P->D + 2);
        if (real >= 3)
            PASS(4, P, qh, real, key, val, n, r);
        else if (real == 2)
            PASS(2, P, qh, real, key, val, n, r);
        else
            PASS(1, P, qh, real, key, val, n, r);
    }
}

/* Out row of heads [kh g, (kh + 1) g) from the items of one (sequence, KV head), merged in order;
   `sinks` [heads] or null. */
static void merge(const problem *P, int bf16, const float *res, int items, int kh, const float *sinks, char *out) {
    int D = P->D, g = P->group;
    for (int h = 0; h < g; h++) {
        float factor[items], l = flowmoe_attention_weights(P, res, items, h, kh, sinks, factor);
        for (int d = 0; d < D; d += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < items; c++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(factor[c]), _mm512_loadu_ps(res + (c * g + h) * (D + 2) + d), acc);
            acc = _mm512_div_ps(acc, _mm512_set1_ps(l));
            long at = (long)(kh * g + h) * D + d;
            if (bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), to_bf16(acc));
            else
                _mm512_storeu_ps((float *)out + at, acc);
        }
    }
}

/* One query head [D] in fp32 times `scale` (bf16: in paired order). */
static void prep(const char *src, int bf16, int D, float scale, float *dst) {
    for (int d = 0; d < D; d += bf16 ? 32 : 16) {
        __m512 x[2];
        load_row(src, d, bf16, x);
        for (int u = 0; u < (bf16 ? 2 : 1); u++) _mm512_storeu_ps(dst + d + 16 * u, _mm512_mul_ps(x[u], _mm512_set1_ps(scale)));
    }
}

/* flowmoe_attention_run's arguments (but the parts) with this file's AVX-512 parts: D % 16 == 0
   (fp32) or D % 32 == 0 (bf16); the last KV head's pass of a group of 3 reads HT - 1 zero heads. */
int flowmoe_decode_attention(int batch, const int *seqs, int heads, int kv_heads, int D, int bf16,
                             const void *q, long q_row, long q_head, const void *k, long k_slot, long k_head,
                             long k_pos, const void *v, long v_slot, long v_head, long v_pos, const float *sinks,
                             float scale, int chunk, void *out, long out_row, int threads) {
    return flowmoe_attention_run(batch, seqs, heads, kv_heads, D, bf16, q, q_row, q_head, k, k_slot, k_head, k_pos,
                                 v, v_slot, v_head, v_pos, sinks, scale, chunk, out, out_row, threads, HT, prep,
                                 item, merge);
}

#endif
