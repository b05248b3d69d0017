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
#define ROW_BLOCK flowmoe_packed_row_block_avx512 /* cpu_packed_tiles.h's int4 one-row block */
/* no prefetch of the next block in int8's one-row tiles: 16 experts' 1024 x 3584 FFNs, 1 thread,
   Zen 4, bench/packed_rows.py 9 rounds at load 5: 1 row 1.25x from DRAM (21.4 -> 27.7 GB/s, 84% of
   the read roof), 1.18x warm; 2 and 8 rows (which keep it) 1.10x / 1.02x; without it int4's were
   0.92x and the several-row tiles' 0.36-0.83x, so they keep it. Their own rows' lines NTA_AHEAD bytes
   ahead non-temporally instead (cpu_rows_avx512.c's notes: the weights' stream then leaves the
   caches' other lines alone): int8 experts, issue 25's checkpoint, b1, 1 thread, eager, step 0.935x
   (256 bytes ahead; 512: 0.961x; 6 alternated rounds), though the kernel alone (bench/packed_rows.py,
   7 rounds) reads 0.96x from DRAM and 0.79x with the experts in the L3. int4's row step the same
   way: 0.981x, kept as it is. */
#define INT8_ROW_PREFETCH 0
#define INT4_ROW 1 /* int4 one-row tiles by int4_row_at (cpu_packed_tiles.h: 1.07x from DRAM, 1.11x warm) */

/* cpu_packed_tiles.h's dot4. */
INLINE __m256i dot4(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

/* cpu_packed_tiles.h's dot4_twice. */
INLINE __m256i dot4_twice(__m256i u, __m256i s, __m256i v, __m256i t) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), v, t);
}

#include "cpu_packed_tiles.h"
