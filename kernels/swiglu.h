/* The SwiGLU activation of one gate / up pair, as the expert kernels compute it (cpu_expert.c,
   cpu_packed.c): SiLU(gate) * up, or GPT-OSS's clamped form (gate clamped above at `limit`, up to
   [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)). */
#ifndef FLOWMOE_SWIGLU_H
#define FLOWMOE_SWIGLU_H

#include <math.h>

static inline float swiglu(float g, float u, int clamped, float alpha, float limit) {
    if (!clamped) return g / (1.0f + expf(-g)) * u;
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

#endif
