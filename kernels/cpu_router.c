/* The host half of a softmax-then-top-k router for a step's tokens in one call (cpu_router.py):
   after torch's softmax and top-k, the chosen probabilities renormalised (each token's over its
   own k) and cast, then the (token, slot) pairs sorted by expert (stable: token order within an
   expert, as router.py's argsort) with each expert's count. torch dispatches that as ~10
   operations (sum, div, cast, reshape, argsort, floor-divide, take, bincount, and a copy of the
   counts to a list); the floats here are torch's: the sum in its order (cpu_norm.c's
   flowmoe_torch_sum), the division and the bf16 rounding as its kernels do them. */

#include <stdint.h>
#include <string.h>

#include "bf16.h"

float flowmoe_torch_sum(const float *v, long n, int width); /* cpu_norm.c */

/* top [T, k] fp32 (each token's top-k probabilities) and indices [T, k] (their experts, < E) ->
   weights [T, k] (top / its row's sum where `norm`, else top; bf16 where `bf16`, else fp32), rows
   [T k] (the token of each pair, pairs sorted by expert), scales [T k] (their weights, in that
   order) and counts [E] (pairs per expert). `width`: torch's Vectorized<float> lanes. */
void flowmoe_route_tail(long T, int k, int E, const float *top, const int64_t *indices, int norm, int width,
                        int bf16, void *weights, int64_t *rows, void *scales, int64_t *counts) {
    long pairs = T * k, start[E > 0 ? E : 1];
    for (long t = 0; t < T; t++) {
        float sum = norm ? flowmoe_torch_sum(top + t * k, k, width) : 1.0f;
        for (int j = 0; j < k; j++) {
            float w = norm ? top[t * k + j] / sum : top[t * k + j];
            if (bf16)
                ((uint16_t *)weights)[t * k + j] = float_to_bf16(w);
            else
                ((float *)weights)[t * k + j] = w;
        }
    }
    memset(counts, 0, sizeof *counts * E);
    for (long p = 0; p < pairs; p++) counts[indices[p]]++;
    for (long e = 0, at = 0; e < E; at += counts[e], e++) start[e] = at;
    for (long p = 0; p < pairs; p++) {
        long at = start[indices[p]]++;
        rows[at] = p / k;
        if (bf16)
            ((uint16_t *)scales)[at] = ((const uint16_t *)weights)[p];
        else
            ((float *)scales)[at] = ((const float *)weights)[p];
    }
}
