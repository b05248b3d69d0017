/* Rotary embeddings (rotate-half) of a step's query and key heads in one C call (cpu_rope.py),
   giving the floats of rope.py's torch form x * cos + x.roll(R / 2) * signed_sin bit for bit: each
   product and the sum rounded to the tensors' dtype as torch's three operations round them (fp32,
   or bf16 rounded to nearest even). */

#include <stdint.h>
#include <string.h>

#pragma GCC optimize("fp-contract=off") /* torch rounds each product before the sum: no FMA */

static inline float value(const void *p, long i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The bits of v rounded to bf16 (nearest even; NaN stays NaN), in the high half. */
static inline uint32_t bf16_high(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC00000u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

/* v rounded to the dtype (bf16 where `bf16`), as a float. */
static inline float rounded(float v, int bf16) {
    if (!bf16) return v;
    uint32_t u = bf16_high(v);
    memcpy(&v, &u, sizeof v);
    return v;
}

/* One (token, head) row: out[d] = x[d] cos[d] + x[(d + R / 2) mod R] sin[d] in the dtype. */
static inline __attribute__((always_inline)) void rotate_row(const void *x, long row, const void *cos,
                                                             const void *sin, long table, long R, int bf16,
                                                             void *out, long at) {
    long half = R / 2;
    for (long d = 0; d < R; d++) {
        long from = d < half ? d + half : d - half;
        float a = rounded(value(x, row + d, bf16) * value(cos, table + d, bf16), bf16);
        float y = a + rounded(value(x, row + from, bf16) * value(sin, table + d, bf16), bf16);
        if (bf16)
            ((uint16_t *)out)[at + d] = (uint16_t)(bf16_high(y) >> 16);
        else
            ((float *)out)[at + d] = y;
    }
}

/* out [T, heads, R] (contiguous) = x * cos + roll(x, R / 2) * sin for x [T, heads, R] (strides
   ld_t, ld_h, 1 in elements) and cos, sin [T, R] (contiguous), all fp32 or all bf16. */
void flowmoe_rope(const void *x, long T, long heads, long R, long ld_t, long ld_h, const void *cos, const void *sin,
                  int bf16, void *out) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < heads; h++) {
            long row = t * ld_t + h * ld_h, at = (t * heads + h) * R;
            if (bf16)
                rotate_row(x, row, cos, sin, t * R, R, 1, out, at);
            else
                rotate_row(x, row, cos, sin, t * R, R, 0, out, at);
        }
}

/* The same rotation in place: x [T, heads, R'] (strides ld_t, ld_h, 1; R' >= R) has the first R
   dims of each row replaced by their rotation, the rest left as they are (a partial rotary's pass-
   through dims); each row is read whole before it is written. */
void flowmoe_rope_inplace(void *x, long T, long heads, long R, long ld_t, long ld_h, const void *cos,
                          const void *sin, int bf16) {
    size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
    float row_copy[R > 0 ? R : 1]; /* R values of either dtype: a float each is room enough */
    for (long t = 0; t < T; t++)
        for (long h = 0; h < heads; h++) {
            long row = t * ld_t + h * ld_h;
            memcpy(row_copy, (char *)x + row * size, R * size);
            if (bf16)
                rotate_row(row_copy, 0, cos, sin, t * R, R, 1, x, row);
            else
                rotate_row(row_copy, 0, cos, sin, t * R, R, 0, x, row);
        }
}
