/* cpu_packed.c's block with AVX2, FMA and F16C intrinsics (compiled with a target attribute, so it
   is in every x86 build and runs only where cpu_packed.py finds the three): res[r * PB + j] = x[r] .
   weight row o0 + j for r < n, j < ob <= PB, in cpu_packed.c's summation order (its header).

   One row of x (a decode step's expert, mostly): each 8 (int8) or 16 (int4) packed weights are
   loaded, widened to fp32 in registers (int8: sign-extend, convert; int4: zero-extend 8 bytes to 8
   lanes, mask the low nibbles and shift the high ones, convert) and multiplied into the row's
   lanes; int4's zero is taken once per group and lane, from x's group sums (cpu_packed.c's header). More rows: the block's PB rows are widened once per chunk (int8:
   CHUNK columns; int4: a group) into a buffer in L1, which RT rows of x at a time then read, so the
   widening is paid once whatever the number of rows (the same values, the same order: a row gets
   the same bits alone as among others). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define PB 4          /* weight rows per block (cpu_packed.c) */
#define RT 2          /* rows of x per register tile of the buffered blocks */
#define MAX_GROUP 256 /* cpu_packed.c's */
#define CHUNK 256     /* int8 columns per buffered chunk */

/* cpu_packed.c */
float flowmoe_packed_tail(int fmt, const float *xr, long K, long group, const void *q, const void *scale,
                          const void *zero, long o, long k0, float s);

/* The 8 lanes' sum: lane i + lane i + 4, then + 2, + 1. */
static inline AVX2 float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* 8 int8 weights as fp32. */
static inline AVX2 __m256 int8_weights(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 16 int4 levels (8 bytes) as fp32: the even columns (low nibbles), the odd ones. */
static inline AVX2 void int4_weights(const uint8_t *p, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* A group's lanes into a row's: acc + scale x (even + odd - zero x the row's group sums `sums`). */
static inline AVX2 __m256 int4_group(__m256 acc, float scale, float zero, const float *sums, __m256 even, __m256 odd) {
    __m256 levels = _mm256_fnmadd_ps(_mm256_set1_ps(zero), _mm256_loadu_ps(sums), _mm256_add_ps(even, odd));
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), levels, acc);
}

/* The next block's copy of a row's next 64 bytes (the same row PB rows on: `ahead` bytes past p),
   prefetched as each line of the row is read: a short row's PB streams end before the hardware
   prefetchers pick them up. */
static inline AVX2 void prefetch_next(const void *p, long ahead) {
    _mm_prefetch((const char *)p + ahead, _MM_HINT_T0);
}

/* int8, one row of x: the block's PB weight rows streamed once, 64 columns (a line) at a time. */
static AVX2 void int8_row(const float *x, long K, const int8_t *const *wr, __m256 *acc) {
    long kv = K / 8 * 8;
    for (long k0 = 0; k0 < kv; k0 += 64) {
        for (int j = 0; j < PB; j++) prefetch_next(wr[j] + k0, PB * K);
        long k1 = kv - k0 < 64 ? kv : k0 + 64;
        for (long k = k0; k < k1; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            for (int j = 0; j < PB; j++) acc[j] = _mm256_fmadd_ps(xv, int8_weights(wr[j] + k), acc[j]);
        }
    }
}

/* int8, several rows: chunk by chunk, the PB rows widened into buf, then RT rows of x at a time. */
static AVX2 void int8_rows(const float *x, long ldx, int n, long K, const int8_t *const *wr, __m256 (*acc)[PB]) {
    float buf[PB][CHUNK] __attribute__((aligned(32)));
    long kv = K / 8 * 8;
    for (long k0 = 0; k0 < kv; k0 += CHUNK) {
        long kc = kv - k0 < CHUNK ? kv - k0 : CHUNK;
        for (int j = 0; j < PB; j++)
            for (long k = 0; k < kc; k += 8) {
                if (k % 64 == 0) prefetch_next(wr[j] + k0 + k, PB * K);
                _mm256_store_ps(buf[j] + k, int8_weights(wr[j] + k0 + k));
            }
        for (int r0 = 0; r0 < n; r0 += RT) {
            int rt = n - r0 < RT ? n - r0 : RT;
            __m256 a[RT][PB];
            for (int r = 0; r < rt; r++)
                for (int j = 0; j < PB; j++) a[r][j] = acc[r0 + r][j];
            for (long k = 0; k < kc; k += 8) {
                __m256 xv[RT];
                for (int r = 0; r < rt; r++) xv[r] = _mm256_loadu_ps(x + (r0 + r) * ldx + k0 + k);
                for (int j = 0; j < PB; j++) {
                    __m256 w = _mm256_load_ps(buf[j] + k);
                    for (int r = 0; r < rt; r++) a[r][j] = _mm256_fmadd_ps(xv[r], w, a[r][j]);
                }
            }
            for (int r = 0; r < rt; r++)
                for (int j = 0; j < PB; j++) acc[r0 + r][j] = a[r][j];
        }
    }
}

_Static_assert(PB == 4, "int4_row_group keeps PB == 4 weight rows' pointers and lanes in registers");

/* int4, one row of x, one group [g0, g0 + gc) of the PB weight rows: even and odd lanes of the
   levels per row. */
static AVX2 void int4_row_group(const float *x, long g0, long gc, long bytes, const uint8_t *const *wr,
                                __m256 *even, __m256 *odd) {
    const uint8_t *w0 = wr[0] + g0 / 2, *w1 = wr[1] + g0 / 2, *w2 = wr[2] + g0 / 2, *w3 = wr[3] + g0 / 2;
    for (long b = 0; b < gc / 2; b += 64)
        prefetch_next(w0 + b, PB * bytes), prefetch_next(w1 + b, PB * bytes), prefetch_next(w2 + b, PB * bytes),
            prefetch_next(w3 + b, PB * bytes);
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    const float *xp = x + g0;
    for (long i = 0; i < gc / 2; i += 8, xp += 16) {
        __m256 xe = _mm256_loadu_ps(xp), xo = _mm256_loadu_ps(xp + 8), we, wo;
        int4_weights(w0 + i, &we, &wo), e0 = _mm256_fmadd_ps(xe, we, e0), o0 = _mm256_fmadd_ps(xo, wo, o0);
        int4_weights(w1 + i, &we, &wo), e1 = _mm256_fmadd_ps(xe, we, e1), o1 = _mm256_fmadd_ps(xo, wo, o1);
        int4_weights(w2 + i, &we, &wo), e2 = _mm256_fmadd_ps(xe, we, e2), o2 = _mm256_fmadd_ps(xo, wo, o2);
        int4_weights(w3 + i, &we, &wo), e3 = _mm256_fmadd_ps(xe, we, e3), o3 = _mm256_fmadd_ps(xo, wo, o3);
    }
    even[0] = e0, even[1] = e1, even[2] = e2, even[3] = e3, odd[0] = o0, odd[1] = o1, odd[2] = o2, odd[3] = o3;
}

/* int4, several rows, one group: the rows' even and odd lanes against the widened group in buf
   (16 columns: 8 even levels, then 8 odd), `jn` weight rows from j0 at a time; `sums`: the first
   row's sums of this group, a row's `lds` floats on. */
static inline AVX2 __attribute__((always_inline)) void int4_tile(
    int rt, int jn, const float *x, long ldx, int r0, int j0, long g0, long gc, float (*buf)[MAX_GROUP],
    const float *scale, const float *zero, const float *sums, long lds, __m256 (*acc)[PB]) {
    __m256 e[RT][PB], o[RT][PB];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) e[r][j] = o[r][j] = _mm256_setzero_ps();
    for (long c = 0; c < gc; c += 16) {
        __m256 xe[RT], xo[RT];
        for (int r = 0; r < rt; r++) {
            xe[r] = _mm256_loadu_ps(x + (r0 + r) * ldx + g0 + c);
            xo[r] = _mm256_loadu_ps(x + (r0 + r) * ldx + g0 + c + 8);
        }
        for (int j = 0; j < jn; j++) {
            __m256 we = _mm256_load_ps(buf[j0 + j] + c), wo = _mm256_load_ps(buf[j0 + j] + c + 8);
            for (int r = 0; r < rt; r++) {
                e[r][j] = _mm256_fmadd_ps(xe[r], we, e[r][j]);
                o[r][j] = _mm256_fmadd_ps(xo[r], wo, o[r][j]);
            }
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++)
            acc[r0 + r][j0 + j] = int4_group(acc[r0 + r][j0 + j], scale[j0 + j], zero[j0 + j],
                                             sums + (r0 + r) * lds, e[r][j], o[r][j]);
}

AVX2 void flowmoe_packed_block_avx2(int fmt, const float *x, long ldx, const float *sums, int n, long K, long group,
                                    const void *q, const void *scale, const void *zero, long o0, int ob,
                                    float *res) {
    __m256 acc[n][PB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < PB; j++) acc[r][j] = _mm256_setzero_ps();
    long tail_from;
    if (fmt == 0) {
        const int8_t *wr[PB];
        for (int j = 0; j < PB; j++) /* a short last block repeats its last row (results not kept) */
            wr[j] = (const int8_t *)q + (o0 + (j < ob ? j : ob - 1)) * K;
        if (n == 1)
            int8_row(x, K, wr, acc[0]);
        else
            int8_rows(x, ldx, n, K, wr, acc);
        tail_from = K / 8 * 8;
    } else {
        long bytes = (K + 1) / 2, groups = (K + group - 1) / group, k16 = K / 16 * 16;
        const uint8_t *wr[PB];
        long at[PB];
        for (int j = 0; j < PB; j++) {
            at[j] = o0 + (j < ob ? j : ob - 1);
            wr[j] = (const uint8_t *)q + at[j] * bytes;
        }
        float buf[PB][MAX_GROUP] __attribute__((aligned(32)));
        for (long g0 = 0, g = 0; g0 < k16; g0 += group, g++) {
            long gc = k16 - g0 < group ? k16 - g0 : group;
            float z[PB], s[PB];
            for (int j = 0; j < PB; j++) {
                z[j] = _cvtsh_ss(((const uint16_t *)zero)[at[j] * groups + g]);
                s[j] = _cvtsh_ss(((const uint16_t *)scale)[at[j] * groups + g]);
            }
            if (n == 1) {
                __m256 even[PB], odd[PB];
                int4_row_group(x, g0, gc, bytes, wr, even, odd);
                for (int j = 0; j < PB; j++) acc[0][j] = int4_group(acc[0][j], s[j], z[j], sums + g * 8, even[j], odd[j]);
                continue;
            }
            for (int j = 0; j < PB; j++) {
                for (long c = 0; c < gc; c += 16) {
                    __m256 we, wo;
                    if (c % 128 == 0) prefetch_next(wr[j] + (g0 + c) / 2, PB * bytes);
                    int4_weights(wr[j] + (g0 + c) / 2, &we, &wo);
                    _mm256_store_ps(buf[j] + c, we), _mm256_store_ps(buf[j] + c + 8, wo);
                }
            }
            for (int r0 = 0; r0 < n; r0 += RT)
                for (int j0 = 0; j0 < PB; j0 += PB / 2) {
                    if (n - r0 == 1)
                        int4_tile(1, PB / 2, x, ldx, r0, j0, g0, gc, buf, s, z, sums + g * 8, groups * 8, acc);
                    else
                        int4_tile(RT, PB / 2, x, ldx, r0, j0, g0, gc, buf, s, z, sums + g * 8, groups * 8, acc);
                }
        }
        tail_from = k16;
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) {
            float v = flowmoe_packed_tail(fmt, x + r * ldx, K, group, q, scale, zero, o0 + j, tail_from,
                                          hsum8(acc[r][j]));
            res[r * PB + j] = fmt == 0 ? v * ((const float *)scale)[o0 + j] : v;
        }
}
