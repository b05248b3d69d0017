/* RMSNorm rows on the CPU in one call, giving the floats of torch's composite (F.rms_norm, and
   Hugging Face's float32 RMSNorm) bit for bit: built by norm.py's caller through native.library().

   out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the mean and everything before the cast in
   fp32. torch dispatches that as ~13 operations (upcast, pow, sum, div, add, rsqrt, mul, casts),
   ~30-45 us for one 1024-wide row on a 2-vCPU AMD EPYC, most of it per-operation cost. The sum of
   squares follows torch's CPU sum over a contiguous last dimension (aten's SumKernel: the row as
   vectors of `width` floats, the Vectorized<float> its sum kernel runs (cpu_norm.py), summed as four
   interleaved rows with a cascade of 2^4-step levels, the vectors' leftovers into the first, the
   four added in order, then the scalar tail, then the lanes in order); the rest is elementwise. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#pragma GCC optimize("fp-contract=off") /* torch rounds each product before adding it: no FMA */

#define ILP 4     /* rows of vectors torch's multi_row_sum interleaves */
#define LEVELS 4  /* its cascade levels */
#define WMAX 16   /* the widest Vectorized<float> (AVX-512, which torch's sum kernel does not use) */

/* acc[0..width) += v[i * width .. (i + 1) * width) */
static inline void add_vector(float *acc, const float *v, long i, int width) {
    for (int l = 0; l < width; l++) acc[l] += v[i * width + l];
}

static long ceil_log2(long x) {
    if (x <= 2) return 1;
    long bits = 0;
    for (unsigned long v = (unsigned long)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* The sum of v[0..n) in torch's CPU order for a contiguous last dimension with Vectorized<float> of
   `width` lanes (see the file's notes; rows narrower than a vector: its scalar path, the same order
   one lane wide). Also cpu_router.c's. */
float flowmoe_torch_sum(const float *v, long n, int width) {
    width = n >= width ? width : 1;
    long vectors = n / width, size = vectors / ILP;
    long power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4, step = 1L << power;
    float acc[LEVELS][ILP][WMAX];
    memset(acc, 0, sizeof acc);
    long i = 0;
    while (i + step <= size) {
        for (long j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++) add_vector(acc[0][k], v, i * ILP + k, width);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < width; l++) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
            if (i & ((step - 1) << (j * power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++) add_vector(acc[0][k], v, i * ILP + k, width);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < width; l++) acc[0][k][l] += acc[j][k][l];
    for (long u = size * ILP; u < vectors; u++) add_vector(acc[0][0], v, u, width);
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < width; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (long e = vectors * width; e < n; e++) total += v[e];
    for (int l = 0; l < width; l++) total += acc[0][0][l];
    return total;
}

/* out [rows, dim] (contiguous) = RMSNorm of x [rows, dim] (row stride ldx) with weight [dim], all
   in fp32 or all in bf16; `width`: the Vectorized<float> size of torch's sum kernel (cpu_norm.py's SUM_WIDTH). */
void flowmoe_rms_norm(const void *x, long rows, long dim, long ldx, const void *weight, int bf16, double eps,
                      int width, void *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * ldx * (bf16 ? 2 : 4);
        float squares[dim > 0 ? dim : 1]; /* each rounded to fp32, as torch's pow(2) */
        for (long i = 0; i < dim; i++) squares[i] = bf16_or_float(row, i, bf16) * bf16_or_float(row, i, bf16);
        float scale = 1.0f / sqrtf(flowmoe_torch_sum(squares, dim, width) / (float)dim + (float)eps);
        for (long i = 0; i < dim; i++) {
            float normed = bf16_or_float(row, i, bf16) * scale;
            if (bf16)
                ((uint16_t *)out)[r * dim + i] = float_to_bf16(bf16_to_float(((const uint16_t *)weight)[i]) * bf16_to_float(float_to_bf16(normed)));
            else
                ((float *)out)[r * dim + i] = ((const float *)weight)[i] * normed;
        }
    }
}

/* The residual add before a norm, then the norm (cpu_norm.py's entry): sum [rows, dim] (contiguous)
   += residual [rows, dim] (contiguous; NULL: nothing added, sum left as it is), each element rounded
   to the dtype as torch's add rounds it (the sum of two floats in fp32, then to bf16 nearest even),
   then out = RMSNorm of the sum as flowmoe_rms_norm gives it. */
void flowmoe_add_rms_norm(void *sum, const void *residual, long rows, long dim, const void *weight, int bf16,
                          double eps, int width, void *out, int threads) {
    long n = residual ? rows * dim : 0;
    if (bf16)
        for (long i = 0; i < n; i++)
            ((uint16_t *)sum)[i] = float_to_bf16(bf16_to_float(((const uint16_t *)sum)[i]) +
                                                     bf16_to_float(((const uint16_t *)residual)[i]));
    else
        for (long i = 0; i < n; i++) ((float *)sum)[i] += ((const float *)residual)[i];
    flowmoe_rms_norm(sum, rows, dim, dim, weight, bf16, eps, width, out, threads);
}
