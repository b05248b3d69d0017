/* A MoE layer's combine on the CPU in one call (cpu_combine.py): the residual plus the routed
   experts' outputs added into their tokens' rows, experts in ascending order, the floats of
   moe_model.py's torch path bit for bit. That path is ~6 operations (zeros, cat, cast, index_add_,
   add), each run cold after the layer's experts streamed their weights through the caches.

   torch's path: moe = zeros [T, H] in the residual's dtype; every output row cast to that dtype;
   index_add_ sums each row's entries in index order in fp32 and rounds the sum once to the dtype
   (its CPU kernel accumulates bf16 in fp32: tests/test_cpu_combine.py checks it against torch);
   out = hidden + moe (bf16: computed in fp32, rounded). Every element's adds happen in one fixed
   order whatever the threads (they share out the columns). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define COLUMNS 256   /* columns per thread's share (a 1 KiB fp32 run of a row) */
#define GRAIN 32768   /* elements below which one thread adds them all: torch's at::internal::GRAIN_SIZE */

/* out [T, H] (contiguous) = hidden [T, H] (row stride ldh) + the sum, per row, of the output rows
   of `experts` experts in turn: expert e's values [n_e, H] (contiguous, bf16 where values_bf16
   else fp32) go to the rows rows[...] (each expert's n_e in turn). hidden and out in bf16 where
   `bf16`, else fp32. Returns 0, or 1 where there is no memory for the sums. */
int flowmoe_combine(long T, long H, const void *hidden, long ldh, int bf16, int experts, const void *const *values,
                    const int *ns, int values_bf16, const int64_t *rows, void *out, int threads) {
    float *moe = calloc(T * H > 0 ? T * H : 1, sizeof(float));
    if (!moe) return 1;
    long shares = (H + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * H >= GRAIN)
    for (long share = 0; share < shares; share++) {
        long h0 = share * COLUMNS, h1 = h0 + COLUMNS < H ? h0 + COLUMNS : H, entry = 0;
        for (int e = 0; e < experts; e++)
            for (int i = 0; i < ns[e]; i++, entry++) {
                float *sum = moe + rows[entry] * H;
                for (long h = h0; h < h1; h++)
                    sum[h] += bf16_rounded(bf16_or_float(values[e], (long)i * H + h, values_bf16), bf16);
            }
        for (long t = 0; t < T; t++)
            for (long h = h0; h < h1; h++) {
                float v = bf16_or_float(hidden, t * ldh + h, bf16) + bf16_rounded(moe[t * H + h], bf16);
                if (bf16)
                    ((uint16_t *)out)[t * H + h] = float_to_bf16(v);
                else
                    ((float *)out)[t * H + h] = v;
            }
    }
    free(moe);
    return 0;
}

/* out [n, H] = values [n, H] times each row's combine weight scales[i], as torch's values *
   scales[:, None] computes it: the product in fp32, rounded once to out's dtype. values, scales and
   out each bf16 where their flag says, else fp32; all contiguous. What a packed expert's outputs
   need after its kernel (packed_experts.py): one call, where torch's mul dispatches cold. */
void flowmoe_scale_rows(long n, long H, const void *values, int values_bf16, const void *scales, int scales_bf16,
                        void *out, int out_bf16) {
    for (long i = 0; i < n; i++) {
        float scale = bf16_or_float(scales, i, scales_bf16);
        for (long h = 0; h < H; h++) {
            float v = bf16_or_float(values, i * H + h, values_bf16) * scale;
            if (out_bf16)
                ((uint16_t *)out)[i * H + h] = float_to_bf16(v);
            else
                ((float *)out)[i * H + h] = v;
        }
    }
}
