/* The host kernels on either side of a layer's attention, each side in one call (cpu_attention_ends.py):
   PRE_ATTN's norm, q/k/v projection and rope, and POST_ATTN's o projection, residual add and norm.
   The same kernels in the same order as the separate calls (cpu_norm.c, cpu_expert.c's
   flowmoe_linear, cpu_rope.c), each stage's output rounded to the dtype in memory before the next
   reads it: the same floats, one call from Python instead of three (two), where a decode step's
   calls, between kernels that stream the weights, cost 10-20 us each. */

#include <stdlib.h>

void flowmoe_add_rms_norm(void *sum, const void *residual, long rows, long dim, const void *weight, int bf16,
                          double eps, int width, void *out, int threads);
int flowmoe_linear(const void *x, long ldx, int n, long K, const void *w, int bf16, long O, const float *bias,
                   void *y, long ldy, int isa, int threads);
void flowmoe_rope_inplace(void *x, long T, long heads, long R, long ld_t, long ld_h, const void *cos,
                          const void *sin, int bf16);

/* qkv [T, O] = RMSNorm(hidden [T, H], norm_w) @ w [O, H]^T (+ bias [O], fp32), then in each row of qkv
   (heads of D columns) the first `heads` heads' first R dims rotated with cos, sin [T, R]; all fp32
   or all bf16 (`bf16`). `norm_threads`, `threads`: the norm's and the projection's (as cpu_norm.py and
   cpu_expert.py choose them). Returns 0, or 1 where there is no memory for the normed rows. */
int flowmoe_pre_attention(const void *hidden, long T, long H, const void *norm_w, double eps, int width,
                          int norm_threads, const void *w, int bf16, long O, const float *bias, void *qkv,
                          long heads, long R, long D, const void *cos, const void *sin, int isa, int threads) {
    void *normed = malloc((size_t)(T > 0 ? T : 1) * H * (bf16 ? 2 : 4)); /* [T, H] */
    if (!normed) return 1;
    flowmoe_add_rms_norm((void *)hidden, 0, T, H, norm_w, bf16, eps, width, normed, norm_threads);
    int status = flowmoe_linear(normed, H, (int)T, H, w, bf16, O, bias, qkv, O, isa, threads);
    free(normed);
    if (status) return status;
    flowmoe_rope_inplace(qkv, T, heads, R, O, D, cos, sin, bf16);
    return 0;
}

/* total [T, H] = attn [T, K] (row stride lda) @ w [H, K]^T (+ bias [H], fp32), then += residual [T, H],
   and normed [T, H] = RMSNorm(total, norm_w); all fp32 or all bf16. Returns 0, or 1 where the
   projection had no memory for its buffers. */
int flowmoe_post_attention(const void *attn, long lda, long T, long K, const void *w, int bf16, long H,
                           const float *bias, const void *residual, const void *norm_w, double eps, int width,
                           int norm_threads, void *total, void *normed, int isa, int threads) {
    int status = flowmoe_linear(attn, lda, (int)T, K, w, bf16, H, bias, total, H, isa, threads);
    if (status) return status;
    flowmoe_add_rms_norm(total, residual, T, H, norm_w, bf16, eps, width, normed, norm_threads);
    return 0;
}
