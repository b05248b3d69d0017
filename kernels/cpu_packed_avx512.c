/* cpu_packed.c's block with AVX512-VNNI's integer dot products on 256-bit vectors (AVX-512 VL;
   compiled with a target attribute, so it is in every x86 build and runs only where cpu_packed.py
   finds the flags): cpu_packed_tiles.h's, as cpu_packed_avx2.c's but each dot4 one vpdpbusd
   (unsigned x signed bytes, 4 products summed into each int32 lane) where AVX2 takes maddubs and
   madd, dot4_twice two: the same integer sums, so the AVX2 block's bits. 512-bit vectors (two weight
   rows' lanes a vector) were no faster on a Zen 4, which splits them into two 256-bit halves
   (bench/packed_rows.py, 1 and 8 rows). */

#include <immintrin.h>
#include <stdint.h>

#define BLOCK_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define INLINE static inline BLOCK_TARGET __attribute__((always_inline))
#define BLOCK flowmoe_packed_block_avx512

/* cpu_packed_tiles.h's dot4. */
INLINE __m256i dot4(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

/* cpu_packed_tiles.h's dot4_twice. */
INLINE __m256i dot4_twice(__m256i u, __m256i s, __m256i v, __m256i t) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), v, t);
}

#include "cpu_packed_tiles.h"
