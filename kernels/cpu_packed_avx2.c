/* cpu_packed.c's block with AVX2, FMA and F16C intrinsics (compiled with a target attribute, so it
   is in every x86 build and runs only where cpu_packed.py finds the three): cpu_packed_tiles.h's,
   its integer dot products by maddubs (unsigned x signed bytes -> pairs summed in int16) and madd by
   ones (pairs of pairs into int32 lanes). And quantize_row's activation levels for whole blocks
   (flowmoe_quantize_blocks_avx2). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline BLOCK_TARGET __attribute__((always_inline))
#define BLOCK flowmoe_packed_block_avx2
#define INT8_ROW_PREFETCH 1 /* int8 one-row tiles prefetch too (cpu_packed_tiles.h, prefetch_next) */
/* int4 one-row tiles by int4_tile (cpu_packed_tiles.h): with int4_row_at out of line, the compiler's
   registers in this block changed and its int8 one-row tiles were 0.92-0.95x (Zen 4, 1 thread,
   bench/packed_rows.py --blocks avx2,avx2, 5-9 rounds) */
#define INT4_ROW 0
#define QMAX 127.0f /* cpu_packed.c's */

/* cpu_packed_tiles.h's dot4: the int32 lane sums of u x s's 4 products. */
INLINE __m256i dot4(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* cpu_packed_tiles.h's dot4_twice: dot4(u, s) + dot4(v, t), the pairs summed in int16 first. */
INLINE __m256i dot4_twice(__m256i u, __m256i s, __m256i v, __m256i t) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t)),
                             _mm256_set1_epi16(1));
}

#include "cpu_packed_tiles.h"

/* The levels of a block of QB activations x in column order and its d (cpu_packed.c's quantize_row,
   the same bits: max |x| is exact in any order; d = max / QMAX and its inverse, each level
   round(x x inverse) half away from zero as trunc(v) + (|v - trunc(v)| >= 0.5 ? sign(v) : 0), each
   step exact but the product, rounded once as there). */
INLINE __m256i block_levels(const float *x, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    __m256 v[4], largest = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    *d = top / QMAX;
    __m256 inverse = _mm256_set1_ps(*d != 0.0f ? 1.0f / *d : 0.0f);
    __m256i level[4];
    for (int i = 0; i < 4; i++) {
        __m256 scaled = _mm256_mul_ps(v[i], inverse);
        __m256 whole = _mm256_round_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(scaled, whole)), half, _CMP_GE_OQ);
        __m256 step = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(scaled, sign), one));
        level[i] = _mm256_cvttps_epi32(_mm256_add_ps(whole, step));
    }
    /* int32 columns 0-7, 8-15, 16-23, 24-31 -> bytes, 4-column pieces interleaved by the packs, put in order */
    __m256i pieces = _mm256_packs_epi16(_mm256_packs_epi32(level[0], level[1]), _mm256_packs_epi32(level[2], level[3]));
    return _mm256_permutevar8x32_epi32(pieces, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* quantize_row's levels and d of x's first `blocks` whole blocks (int4: an even count, whole
   superblocks, each laid out as its even columns' levels, then its odd ones'); int4 also the lanes'
   d and the `groups` group sums over the row's `supers` superblocks (cpu_packed.c's quantize_row, the
   same bits: the sums' fma in its order, lane by lane). */
BLOCK_TARGET void flowmoe_quantize_blocks_avx2(const float *x, long blocks, int fmt, long supers, long group,
                                               long groups, int8_t *xq, float *xd, float *lanes, float *sums) {
    if (fmt == 0) {
        for (long b = 0; b < blocks; b++)
            _mm256_storeu_si256((__m256i *)(xq + b * QB), block_levels(x + b * QB, xd + b));
        return;
    }
    /* in-lane bytes 0, 2, .., 14, then 1, 3, .., 15: each 128-bit lane's even columns, then its odd */
    const __m256i apart = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (long s = 0; s < supers; s++) {
        /* each block as [its even columns' 16 | its odd columns' 16] */
        __m256i first = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(block_levels(x + s * SB, xd + 2 * s), apart), _MM_SHUFFLE(3, 1, 2, 0));
        __m256i second = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(block_levels(x + s * SB + QB, xd + 2 * s + 1), apart), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i *)(xq + s * SB), _mm256_permute2x128_si256(first, second, 0x20));
        _mm256_storeu_si256((__m256i *)(xq + s * SB + QB), _mm256_permute2x128_si256(first, second, 0x31));
        _mm256_storeu_ps(lanes + s * 8,
                         _mm256_set_m128(_mm_set1_ps(xd[2 * s + 1]), _mm_set1_ps(xd[2 * s])));
    }
    const __m256i ones = _mm256_set1_epi8(1);
    for (long g = 0, per = group / SB; g < groups; g++) {
        __m256 acc = _mm256_setzero_ps();
        for (long s = g * per; s < (g + 1) * per && s < supers; s++) {
            __m256i even = _mm256_loadu_si256((const __m256i *)(xq + s * SB));
            __m256i odd = _mm256_loadu_si256((const __m256i *)(xq + s * SB + QB));
            acc = add_sums(acc, dot4_twice(ones, even, ones, odd), _mm256_loadu_ps(lanes + s * 8));
        }
        _mm256_storeu_ps(sums + g * 8, acc);
    }
}
