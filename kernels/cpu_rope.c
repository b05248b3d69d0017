/* Rotary embeddings (rotate-half) of a step's query and key heads in one C call (cpu_rope.py),
   giving the floats of rope.py's torch form x * cos + x.roll(R / 2) * signed_sin bit for bit: each
   product and the sum rounded to the tensors' dtype as torch's three operations round them (fp32,
   or bf16 rounded to nearest even). */

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#pragma GCC optimize("fp-contract=off") /* torch rounds each product before the sum: no FMA */

/* One (token, head) row: out[d] = x[d] cos[d] + x[(d + R / 2) mod R] sin[d] in the dtype. */
static inline __attribute__((always_inline)) void rotate_row(const void *x, long row, const void *cos,
                                                             const void *sin, long table, long R, int bf16,
                                                             void *out, long at) {
    long half = R / 2;
    for (long d = 0; d < R; d++) {
        long from = d < half ? d + half : d - half;
        float a = bf16_rounded(bf16_or_float(x, row + d, bf16) * bf16_or_float(cos, table + d, bf16), bf16);
        float y = a + bf16_rounded(bf16_or_float(x, row + from, bf16) * bf16_or_float(sin, table + d, bf16), bf16);
        if (bf16)
            ((uint16_t *)out)[at + d] = float_to_bf16(y);
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
