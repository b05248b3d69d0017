/* cpu_packed.c's block with x86 intrinsics, included by cpu_packed_avx2.c (AVX2 + FMA + F16C) and
   cpu_packed_avx512.c (the same with AVX512-VNNI's integer dot products): res[(m n + r) PB + j] =
   levels row r . row o0 + j of weight matrix m (p + 3 m: q, scale, zero) for r < n, j < ob <= PB,
   m < mats, in cpu_packed.c's order (its header). mats 2 (gate and up, or down's two halves) only at
   one row (n 1): each tile then takes one row of each matrix. The includer defines BLOCK_TARGET (the
   target attribute), BLOCK (the function's name), INLINE, INT8_ROW_PREFETCH (whether int8's one-row
   tiles prefetch), INT4_ROW (whether int4's one-row tiles are int4_row_at's) and the integer dot
   products: dot4(u, s), int32 lane l the sum of the 4 products of unsigned bytes u and signed bytes s
   at 4l..4l + 3 (u <= 128, |s| <= 127: a pair of products fits int16), and dot4_twice(u, s, v, t) =
   dot4(u, s) + dot4(v, t) (u, v <= 15: int4 levels); both exact, so the blocks give the same bits.

   Integer dot products as llama.cpp's AVX2 Q8_0 / Q4_0 ones do (ggml's mul_sum_i8_pairs_float): int8
   weights times int8 levels as |w| times the levels with w's sign, int4 levels (unsigned 0..15)
   times levels directly, the 8 int32 lanes converted and multiplied by the block's d into fp32
   lanes. A tile of RT rows of levels and JT weight rows keeps its lanes in registers and loads each
   weight vector once per tile, reused across its rows (the weights are widened once per RT rows; a
   block's PB weight rows, a few KB, stay in L1 between tiles). */

#define PB 4  /* weight rows per block (cpu_packed.c) */
#define NTA_AHEAD 256 /* bytes ahead of an int8 one-row tile's rows that it prefetches non-temporally */
#define QB 32 /* cpu_packed.c's */
#define SB 64 /* cpu_packed.c's */
#define RT 4  /* rows of levels per tile of several rows */
#define JT 2  /* weight rows per tile */
#define MB 8  /* a block's weight rows: PB of each of up to 2 matrices */

/* cpu_packed.c */
float flowmoe_packed_tail(int fmt, const int8_t *xq, const float *xd, long K, long group, const void *q,
                          const void *scale, const void *zero, long o, long k0, float s);

/* The 8 lanes' sum: lane i + lane i + 4, then + 2, + 1. */
INLINE float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* hsum8 of each of v[0..8) (its order, the same bits), the 8 at once: lane i of the result v[2 i]'s for
   i < 4, else v[2 (i - 4) + 1]'s. */
INLINE __m256 hsum8_of_8(const __m256 *v) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++) /* [lane l + lane l + 4 of v[2 i] | the same of v[2 i + 1]] */
        a[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) { /* then each's lane 0 + 2, 1 + 3 */
        __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
        b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)), /* then 0 + 1 */
                         _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The next block's copy of a tile's next 64 bytes (`ahead` bytes past p, PB rows on), one line
   per step of the tile (JT rows x 32 bytes): a short row's streams end before the hardware
   prefetchers pick them up, and the tile's JT rows are one contiguous span, prefetched in address
   order as one stream rather than JT streams a row apart: a decode step's experts (16 experts'
   1024 x 3584 gate / up / down, 1 row, 1 thread, AMD EPYC Zen 3 2 vCPU, two runs of 16 interleaved
   rounds, medians [min, max]) int8 1.38x [1.28, 1.45] and 1.27x [1.17, 1.45], int4 1.10x
   [0.94, 1.24] and 1.18x [1.04, 1.31] against a line per row, the same bits. */
INLINE void prefetch_next(const void *p, long ahead) {
    _mm_prefetch((const char *)p + ahead, _MM_HINT_T0);
}

/* Prefetch step `step` of a tile's JT weight rows wr (`bytes` per row a step) `ahead` bytes on: entry
   i is a row of matrix i % mats, each matrix's JT / mats rows one contiguous span, read in address
   order (mats 1: the two rows' line a step, one stream; mats 2: each row's next bytes, two streams
   through whole matrices): a decode step's experts (1 row, 1 thread, AMD EPYC Zen 3 2 vCPU, load 3,
   11 interleaved rounds) int4 1.12x from DRAM against one line a step from alternate rows (1.04x),
   int8 1.05x (1.03x). */
INLINE void prefetch_step(const void *const *wr, int mats, long step, long bytes, long ahead) {
    for (int m = 0; m < mats; m++) prefetch_next((const char *)wr[m] + step * bytes * (JT / mats), ahead);
}

/* fp32 lanes += int32 lanes s, times d. */
INLINE __m256 add_sums(__m256 acc, __m256i s, __m256 d) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc);
}

/* int8: rows [r0, r0 + rt) of levels against weight rows wr[0..jn), jn <= JT, into acc[r0..][j0..];
   one row's tiles prefetch the next block where the includer's INT8_ROW_PREFETCH says, else their
   own rows NTA_AHEAD bytes ahead non-temporally (cpu_packed_avx512.c). */
INLINE void int8_tile(int rt, int jn, int mats, const int8_t *xq, long ldq, const float *xd, long ldf, int r0, long K,
                      const int8_t *const *wr, __m256 (*acc)[MB], int j0) {
    __m256 a[RT][JT];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) a[r][j] = _mm256_setzero_ps();
    for (long b = 0; b < K / QB; b++) {
        __m256i w[JT], magnitude[JT];
        if (rt > 1 || INT8_ROW_PREFETCH)
            prefetch_step((const void *const *)wr, mats, b, QB, PB * K);
        else if (!(b & 1)) /* a line of each row every 64 bytes, non-temporally (INT8_ROW_PREFETCH's notes) */
            for (int j = 0; j < jn; j++) _mm_prefetch((const char *)(wr[j] + b * QB) + NTA_AHEAD, _MM_HINT_NTA);
        for (int j = 0; j < jn; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(wr[j] + b * QB));
            magnitude[j] = _mm256_abs_epi8(w[j]);
        }
        for (int r = 0; r < rt; r++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (r0 + r) * ldq + b * QB));
            __m256 d = _mm256_broadcast_ss(xd + (r0 + r) * ldf + b);
            for (int j = 0; j < jn; j++)
                a[r][j] = add_sums(a[r][j], dot4(magnitude[j], _mm256_sign_epi8(x, w[j])), d);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) acc[r0 + r][j0 + j] = a[r][j];
}

/* int4, superblock s: lanes[r][j] += row r's int sums with weight row wr[j], times the lanes' d. */
INLINE void int4_step(int rt, int jn, int mats, const int8_t *xq, long ldq, const float *xl, long ldf, int r0,
                      long bytes, const uint8_t *const *wr, long s, __m256 (*lanes)[JT]) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256i lo[JT], hi[JT];
    prefetch_step((const void *const *)wr, mats, s, SB / 2, PB * bytes);
    for (int j = 0; j < jn; j++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(wr[j] + s * SB / 2));
        lo[j] = _mm256_and_si256(w, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    }
    for (int r = 0; r < rt; r++) {
        const int8_t *x = xq + (r0 + r) * ldq + s * SB;
        __m256i even = _mm256_loadu_si256((const __m256i *)x);
        __m256i odd = _mm256_loadu_si256((const __m256i *)(x + SB / 2));
        __m256 d = _mm256_loadu_ps(xl + (r0 + r) * ldf + s * 8);
        for (int j = 0; j < jn; j++) {
            lanes[r][j] = add_sums(lanes[r][j], dot4_twice(lo[j], even, hi[j], odd), d);
        }
    }
}

/* int4: as int8_tile, group by group: a group's lanes (its `per` superblocks, fewer in a last short
   group), then lanes = fma(scale, group lanes, lanes), lanes = fma(-(scale x zero), the row's group
   sums, lanes); scz the weight rows' (scale, scale x zero) pairs, a row's `groups` on
   (flowmoe_packed_block_avx2 converts them, scale_pairs). tile_columns passes `per` as a constant for the common
   groups at one row: a group's steps unrolled, no loop bounds worked out per group. With
   prefetch_step, 16 experts' 1024 x 3584 FFNs, 1 row, 1 thread, AMD EPYC Zen 3 2 vCPU, load 2.4-3.4,
   9 interleaved rounds (bench/packed_rows.py's): int4 g128 1.15x from DRAM (0.94 -> 0.81 ms), 1.24x
   warm; int8 1.07x / 1.17x; the same bits. */
INLINE void int4_tile(int rt, int jn, int mats, const int8_t *xq, long ldq, const float *xl, const float *xs, long ldf,
                      int r0, long K, long group, long per, const uint8_t *const *wr, const float *scz,
                      __m256 (*acc)[MB], int j0) {
    long supers = K / SB, groups = (K + group - 1) / group, bytes = (K + 1) / 2;
    __m256 a[RT][JT];
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) a[r][j] = _mm256_setzero_ps();
    for (long g = 0, s0 = 0; s0 < supers; g++, s0 += per) {
        __m256 lanes[RT][JT];
        for (int r = 0; r < rt; r++)
            for (int j = 0; j < jn; j++) lanes[r][j] = _mm256_setzero_ps();
        if (s0 + per <= supers)
            for (long i = 0; i < per; i++) int4_step(rt, jn, mats, xq, ldq, xl, ldf, r0, bytes, wr, s0 + i, lanes);
        else
            for (long s = s0; s < supers; s++) int4_step(rt, jn, mats, xq, ldq, xl, ldf, r0, bytes, wr, s, lanes);
        for (int j = 0; j < jn; j++) {
            const float *pair = scz + (j * groups + g) * 2;
            __m256 s = _mm256_broadcast_ss(pair), s_zero = _mm256_broadcast_ss(pair + 1);
            for (int r = 0; r < rt; r++) {
                __m256 sums = _mm256_loadu_ps(xs + (r0 + r) * ldf + g * 8);
                a[r][j] = _mm256_fnmadd_ps(s_zero, sums, _mm256_fmadd_ps(s, lanes[r][j], a[r][j]));
            }
        }
    }
    for (int r = 0; r < rt; r++)
        for (int j = 0; j < jn; j++) acc[r0 + r][j0 + j] = a[r][j];
}

/* A value the compiler keeps in a register: a vector loaded once and used by several instructions,
   which it would otherwise load again into each as a memory operand. */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

#define ROW_AHEAD 4096 /* int4_row_step's prefetch distance, bytes */

/* int4 at one row, superblock s of weight rows w0 and w1: lanes0 / lanes1 += their int sums with the
   row's levels xq, times the lanes' d xl; the levels and weights loaded once into registers. Every
   other step, each row's line ROW_AHEAD bytes on (rows further in its matrix) into L2 (prefetcht1):
   16 experts' 1024 x 3584 FFNs, 1 row, 1 thread, Zen 4, 31 rounds alternated at load 1.2-1.6: int4
   1.07-1.18x from DRAM, 1.01-1.03x warm (1.31-1.35x from DRAM while other work loaded the memory);
   hqq4 (group 64) 1.17x / 1.03x; group 256 1.00x / 0.98x; 8 KB and 16 KB on 1.09-1.15x, 2 KB 0.95x;
   into L1 (prefetcht0) 0.98x at 2 KB, 0.91x at 4 KB, 0.85x at 8 KB; NTA 0.94x. */
INLINE void int4_row_step(const int8_t *xq, const float *xl, const uint8_t *w0, const uint8_t *w1, long s,
                          __m256 *lanes0, __m256 *lanes1) {
    const __m256i low = _mm256_set1_epi8(15);
    if (s % 2 == 0)
        _mm_prefetch((const char *)w0 + s * SB / 2 + ROW_AHEAD, _MM_HINT_T1),
            _mm_prefetch((const char *)w1 + s * SB / 2 + ROW_AHEAD, _MM_HINT_T1);
    __m256i even = _mm256_loadu_si256((const __m256i *)(xq + s * SB));
    __m256i odd = _mm256_loadu_si256((const __m256i *)(xq + s * SB + SB / 2));
    __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + s * SB / 2));
    __m256i v1 = _mm256_loadu_si256((const __m256i *)(w1 + s * SB / 2));
    IN_REGISTER(even);
    IN_REGISTER(odd);
    IN_REGISTER(v0);
    IN_REGISTER(v1);
    __m256 d = _mm256_loadu_ps(xl + s * 8);
    __m256i sum0 = dot4_twice(_mm256_and_si256(v0, low), even, _mm256_and_si256(_mm256_srli_epi16(v0, 4), low), odd);
    __m256i sum1 = dot4_twice(_mm256_and_si256(v1, low), even, _mm256_and_si256(_mm256_srli_epi16(v1, 4), low), odd);
    *lanes0 = add_sums(*lanes0, sum0, d), *lanes1 = add_sums(*lanes1, sum1, d);
}

/* int4 at one row (the includer's INT4_ROW): int4_tile's sums at rt 1 and JT weight rows, in its order
   (the same bits), by int4_row_step, the two weight rows and their (scale, scale x zero) pairs by their
   own pointers, `per` a constant where int4_row_at passes one (a whole group's steps unrolled), a
   prefetch every other step (int4_row_step's): 14 instructions per 64 weights (the prefetch aside)
   where int4_tile's one-row tiles took 16 and kept pointers and a weight vector on the stack. 16
   experts' 1024 x 3584 FFNs, 1 thread, Zen 4, bench/packed_rows.py 9 rounds at load 1.7: 1 row from
   DRAM 16.9 -> 18.1 GB/s (1.07x, 53% of the read roof), warm 20.4 -> 22.7 GB/s (1.11x); 2 rows
   (int4_tile, the block's code around it smaller) 1.06x / 1.04x; int8 0.98-1.00x. Not faster:
   prefetch_step's lines into L1 (the next block's: 1.01x from DRAM, 1.08x warm, 5 rounds), four
   weight rows a tile (two of each matrix: 0.56x from DRAM), the scales and zeros converted per group
   here rather than the block's pairs (1.04x / 1.05x). */
INLINE void int4_row(const int8_t *xq, const float *xl, const float *xs, long K, long group, long per,
                     const uint8_t *const *wr, const float *scz, __m256 *acc) {
    _Static_assert(JT == 2, "int4_row: two weight rows");
    long supers = K / SB, groups = (K + group - 1) / group;
    const uint8_t *w0 = wr[0], *w1 = wr[1];
    const float *pair0 = scz, *pair1 = scz + groups * 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (long g = 0, s0 = 0; s0 < supers; g++, s0 += per) {
        __m256 lanes0 = _mm256_setzero_ps(), lanes1 = _mm256_setzero_ps();
        if (s0 + per <= supers)
            for (long i = 0; i < per; i++) int4_row_step(xq, xl, w0, w1, s0 + i, &lanes0, &lanes1);
        else
            for (long s = s0; s < supers; s++) int4_row_step(xq, xl, w0, w1, s, &lanes0, &lanes1);
        __m256 sums = _mm256_loadu_ps(xs + g * 8);
        a0 = _mm256_fnmadd_ps(_mm256_broadcast_ss(pair0 + 2 * g + 1), sums,
                              _mm256_fmadd_ps(_mm256_broadcast_ss(pair0 + 2 * g), lanes0, a0));
        a1 = _mm256_fnmadd_ps(_mm256_broadcast_ss(pair1 + 2 * g + 1), sums,
                              _mm256_fmadd_ps(_mm256_broadcast_ss(pair1 + 2 * g), lanes1, a1));
    }
    acc[0] = a0, acc[1] = a1;
}

/* int4_row, out of line (its own registers: inlined into the block, the compiler kept its pointers
   in vector registers and on the stack), int4's and hqq4's `per` (group 128, 64) constants. */
static BLOCK_TARGET __attribute__((noinline)) void int4_row_at(const int8_t *xq, const float *xl, const float *xs,
                                                               long K, long group, const uint8_t *const *wr,
                                                               const float *scz, __m256 *acc) {
    if (group == 2 * SB)
        int4_row(xq, xl, xs, K, group, 2, wr, scz, acc);
    else if (group == SB)
        int4_row(xq, xl, xs, K, group, 1, wr, scz, acc);
    else
        int4_row(xq, xl, xs, K, group, group / SB, wr, scz, acc);
}

/* A weight row's `groups` (scale, scale x zero) pairs, `to`, from its float16 scales s and zeros z. */
INLINE void scale_pairs(const uint16_t *s, const uint16_t *z, long groups, float *to) {
    long g = 0;
    for (; g + 8 <= groups; g += 8) { /* 8 groups' scales and products, interleaved in order */
        __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g)));
        __m256 zv = _mm256_mul_ps(sv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(z + g))));
        __m256 low = _mm256_unpacklo_ps(sv, zv), high = _mm256_unpackhi_ps(sv, zv);
        _mm256_storeu_ps(to + 2 * g, _mm256_permute2f128_ps(low, high, 0x20));
        _mm256_storeu_ps(to + 2 * g + 8, _mm256_permute2f128_ps(low, high, 0x31));
    }
    for (; g < groups; g++) to[2 * g] = _cvtsh_ss(s[g]), to[2 * g + 1] = to[2 * g] * _cvtsh_ss(z[g]);
}

/* The next block's scales and zeros (PB rows of `groups` from row o0 + PB of matrix scale, zero): a
   miss there would stall the block's start. */
INLINE void prefetch_scales(const void *scale, const void *zero, long o0, long groups) {
    for (long b = 0; b < PB * groups * 2; b += 64)
        prefetch_next((const char *)scale + o0 * groups * 2 + b, PB * groups * 2),
            prefetch_next((const char *)zero + o0 * groups * 2 + b, PB * groups * 2);
}

#ifdef ROW_BLOCK
/* BLOCK's common one-row block, int4 (the includer's ROW_BLOCK, cpu_packed.c's packed_block takes it):
   res[m PB + j] = the row of levels . row o0 + j of matrix m < 2 (p + 3 m: q, scale, zero), for K whole
   superblocks and a whole block (ob PB), in BLOCK's order and bits: the block's (scale, scale x zero)
   pairs, its tiles (one row of each matrix) by int4_row, its 8 outputs' hsum8s at once (hsum8_of_8),
   none of BLOCK's pointer arrays, tile calls or hsum8 loop, and BLOCK's code as it was (a block with
   this path inside it made its int8 tiles 0.68-0.89x warm). 16 experts' 1024 x 3584 FFNs, 1 row, 1
   thread, Zen 4, 31 rounds alternated against BLOCK's tiles at load 1.1-1.6: 1.13x from DRAM, 1.10-1.13x
   warm. Not kept: 4 blocks a call (gate / up OpenMP tasks of 4 blocks, 45e6a0d): 1.00-1.05x from DRAM,
   1.03-1.05x warm, 2 rows 0.97-0.99x; the scales and products as two arrays (no interleaving) 1.00x;
   GFNI's gf2p8affineqb for the high nibbles (one instruction for two) 1.00x. */
BLOCK_TARGET void ROW_BLOCK(const int8_t *xq, const float *xl, const float *xs, long K, long group,
                            const void *const *p, long o0, float *res) {
    long bytes = K / 2, groups = (K + group - 1) / group;
    const uint8_t *q0 = (const uint8_t *)p[0] + o0 * bytes, *q1 = (const uint8_t *)p[3] + o0 * bytes;
    const uint16_t *s0 = (const uint16_t *)p[1] + o0 * groups, *z0 = (const uint16_t *)p[2] + o0 * groups;
    const uint16_t *s1 = (const uint16_t *)p[4] + o0 * groups, *z1 = (const uint16_t *)p[5] + o0 * groups;
    prefetch_scales(p[1], p[2], o0, groups), prefetch_scales(p[4], p[5], o0, groups);
    float scz[MB * groups * 2]; /* entry 2 j + m: matrix m's row o0 + j (BLOCK's order) */
    for (int j = 0; j < PB; j++)
        scale_pairs(s0 + j * groups, z0 + j * groups, groups, scz + 2 * j * groups * 2),
            scale_pairs(s1 + j * groups, z1 + j * groups, groups, scz + (2 * j + 1) * groups * 2);
    __m256 acc[MB];
    for (int j = 0; j < PB; j++) {
        const uint8_t *wr[JT] = {q0 + j * bytes, q1 + j * bytes};
        if (group == 2 * SB)
            int4_row(xq, xl, xs, K, group, 2, wr, scz + 2 * j * groups * 2, acc + 2 * j);
        else if (group == SB)
            int4_row(xq, xl, xs, K, group, 1, wr, scz + 2 * j * groups * 2, acc + 2 * j);
        else
            int4_row(xq, xl, xs, K, group, group / SB, wr, scz + 2 * j * groups * 2, acc + 2 * j);
    }
    _mm256_storeu_ps(res, hsum8_of_8(acc)); /* res[m PB + j]: lane 4 m + j, acc[2 j + m]'s */
}
#endif

/* Rows [r0, r0 + rt) of levels against the block's weight rows wr[j0..j0 + JT); at one row, int4's
   common groups with their steps unrolled (int4_tile; unrolled for several rows too, the larger code
   made int8's 2-row blocks 0.81-0.91x from DRAM, their loops unchanged). */
INLINE void tile_columns(int rt, int fmt, int mats, const int8_t *xq, long ldq, const float *xd, const float *xl,
                         const float *xs, long ldf, int r0, long K, long group, const void *const *wr,
                         const float *scz, __m256 (*acc)[MB], int j0) {
    long groups = fmt == 1 ? (K + group - 1) / group : 0;
    const uint8_t *const *w4 = (const uint8_t *const *)wr + j0;
    if (fmt == 0)
        int8_tile(rt, JT, mats, xq, ldq, xd, ldf, r0, K, (const int8_t *const *)wr + j0, acc, j0);
    else if (rt == 1 && INT4_ROW)
        int4_row_at(xq + r0 * ldq, xl + r0 * ldf, xs + r0 * ldf, K, group, w4, scz + j0 * groups * 2,
                    acc[r0] + j0);
    else if (rt == 1 && group == 2 * SB) /* int4's group (128) */
        int4_tile(rt, JT, mats, xq, ldq, xl, xs, ldf, r0, K, group, 2, w4, scz + j0 * groups * 2, acc, j0);
    else if (rt == 1 && group == SB) /* hqq4's (64) */
        int4_tile(rt, JT, mats, xq, ldq, xl, xs, ldf, r0, K, group, 1, w4, scz + j0 * groups * 2, acc, j0);
    else
        int4_tile(rt, JT, mats, xq, ldq, xl, xs, ldf, r0, K, group, group / SB, w4, scz + j0 * groups * 2, acc,
                  j0);
}

/* Rows [r0, r0 + rt) of levels against the block's PB weight rows, JT weight rows at a time: at one
   row too, fewer streams at once for the prefetchers (as cpu_rows_avx2.c's bf16 row, two weight rows
   at a time): a decode step's experts at bench/vs_llamacpp.py's shapes (8 layers x 2, 1 row each),
   1 thread, AMD EPYC Zen 3 2 vCPU, medians of 5 interleaved rounds against all PB at once:
   int8 29.7 -> 27.1 ms, int4 20.5 -> 17.8 ms, the same bits. */
INLINE void tile_rows(int rt, int fmt, int mats, const int8_t *xq, long ldq, const float *xd, const float *xl,
                      const float *xs, long ldf, int r0, long K, long group, const void *const *wr, const float *scz,
                      __m256 (*acc)[MB]) {
    for (int j0 = 0; j0 < mats * PB; j0 += JT)
        tile_columns(rt, fmt, mats, xq, ldq, xd, xl, xs, ldf, r0, K, group, wr, scz, acc, j0);
}

BLOCK_TARGET void BLOCK(int fmt, const int8_t *xq, long ldq, const float *xd, const float *xl,
           const float *xs, long ldf, int n, long K, long group, int mats, const void *const *p, long o0, int ob,
           float *res) {
    __m256 acc[n][MB];
    long tail_from = fmt == 0 ? K / QB * QB : K / SB * SB, row_bytes = fmt == 0 ? K : (K + 1) / 2;
    long groups = fmt == 1 ? (K + group - 1) / group : 1;
    const void *wr[MB]; /* entry i: row o0 + i / mats of matrix i % mats */
    const uint16_t *scales[MB], *zeros[MB]; /* int4: its scales' and zeros' row */
    for (int j = 0; j < PB; j++) {
        long at = o0 + (j < ob ? j : ob - 1); /* a short block repeats its last row (its results not kept) */
        for (int m = 0; m < mats; m++) {
            wr[j * mats + m] = (const uint8_t *)p[3 * m] + at * row_bytes;
            if (fmt == 1)
                scales[j * mats + m] = (const uint16_t *)p[3 * m + 1] + at * groups,
                zeros[j * mats + m] = (const uint16_t *)p[3 * m + 2] + at * groups;
        }
    }
    /* int4: entry i's (scale, scale x zero) of group g at 2 (i groups + g), a pair one address (two
       arrays were 0.94-0.97x: 16 experts' 1024 x 3584 FFNs, 1 row, 1 thread, Zen 4 at load 6,
       bench/packed_rows.py 9 rounds, from DRAM and warm; the compiler kept their pointers in vector
       registers) */
    float scz[MB * groups * 2];
    if (fmt == 1) {
        for (int m = 0; m < mats; m++) prefetch_scales(p[3 * m + 1], p[3 * m + 2], o0, groups);
        for (int i = 0; i < mats * PB; i++) scale_pairs(scales[i], zeros[i], groups, scz + i * groups * 2);
    }
    _Static_assert(RT == 4, "the tiles below: 1, 2, 3 or RT rows");
    if (mats == 2) /* one row (cpu_packed.c) */
        tile_rows(1, fmt, 2, xq, ldq, xd, xl, xs, ldf, 0, K, group, wr, scz, acc);
    else
        for (int r0 = 0; r0 < n; r0 += RT) {
            int rt = n - r0 < RT ? n - r0 : RT;
            if (rt == 1)
                tile_rows(1, fmt, 1, xq, ldq, xd, xl, xs, ldf, r0, K, group, wr, scz, acc);
            else if (rt == 2)
                tile_rows(2, fmt, 1, xq, ldq, xd, xl, xs, ldf, r0, K, group, wr, scz, acc);
            else if (rt == 3)
                tile_rows(3, fmt, 1, xq, ldq, xd, xl, xs, ldf, r0, K, group, wr, scz, acc);
            else
                tile_rows(RT, fmt, 1, xq, ldq, xd, xl, xs, ldf, r0, K, group, wr, scz, acc);
        }
    for (int m = 0; m < mats; m++)
        for (int r = 0; r < n; r++)
            for (int j = 0; j < ob; j++) {
                const void *const *w = p + 3 * m;
                float v = hsum8(acc[r][j * mats + m]); /* then the tail's columns, where K leaves some */
                if (tail_from < K)
                    v = flowmoe_packed_tail(fmt, xq + r * ldq, xd + r * ldf, K, group, w[0], w[1], w[2], o0 + j,
                                            tail_from, v);
                res[(m * n + r) * PB + j] = fmt == 0 ? v * ((const float *)w[1])[o0 + j] : v;
            }
}

