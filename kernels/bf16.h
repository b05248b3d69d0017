/* One value between bf16 and fp32, as torch converts it: the kernels' shared definitions (each .c
   that needs them includes this file; native.py compiles the .c files only). */
#ifndef FLOWMOE_BF16_H
#define FLOWMOE_BF16_H

#include <stdint.h>
#include <string.h>

/* bf16 bits -> fp32 (exact). */
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

/* v rounded to bf16 where `bf16` (as a float), else v. */
static inline float bf16_rounded(float v, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

/* x[i] as fp32: bf16 where `bf16`, else fp32. */
static inline float bf16_or_float(const void *x, long i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#endif
