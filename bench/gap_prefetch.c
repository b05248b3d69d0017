/* A decode step's shape in C, for bench/gap_prefetch.py (issue 25): `layers` layers of `seg_mib` MiB
   of weights, each read as `pieces` kernels (equal parts of it, in order), each kernel after a host
   gap of `gap_us` / `pieces` on thread 0 (the Python between two kernels) and read once at `threads`
   threads, each thread its static share in address order (as flowmoe's GEMV kernels split a weight).
   During a gap the other threads either wait (spin, as OpenMP's idle workers do) or read ahead:
   thread 1 reads the first `ahead_kib` / `pieces` KiB of the kernel's weights (`mode` 0: loads; 1:
   prefetcht1 only), so that the kernel finds them in the caches.
   Prints one JSON line: each step's milliseconds. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The sum of [p, p + n) as fp32 lanes (n a multiple of 256): a read of every line. */
static __m512 read_range(const char *p, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long i = 0; i < n; i += 256) {
        a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 64));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 128));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 192));
    }
    return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: gap_prefetch LAYERS SEG_MIB GAP_US AHEAD_KIB MODE STEPS THREADS PIECES\n");
        return 2;
    }
    int layers = atoi(argv[1]), mode = atoi(argv[5]), steps = atoi(argv[6]), threads = atoi(argv[7]);
    int pieces = atoi(argv[8]);
    long seg = (atol(argv[2]) << 20) / pieces / 4096 * 4096, ahead = (atol(argv[4]) << 10) / pieces / 256 * 256;
    double gap = atof(argv[3]) * 1e-6 / pieces;
    layers *= pieces; /* each piece a kernel of its own */
    long total = seg * layers;
    char *w = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (w == MAP_FAILED) return 1;
    madvise(w, total, MADV_HUGEPAGE);
    memset(w, 1, total);
    volatile float sink = 0;
    printf("{\"step_ms\": [");
    for (int s = 0; s < steps; s++) {
        double t0 = now();
        for (int l = 0; l < layers; l++) {
            const char *layer = w + l * seg;
#pragma omp parallel num_threads(threads)
            {
                int t = omp_get_thread_num(), n = omp_get_num_threads();
                if (t == 0) {
                    double end = now() + gap;
                    while (now() < end) _mm_pause();
                } else if (t == 1 && ahead > 0) {
                    if (mode == 0) {
                        float f = _mm512_reduce_add_ps(read_range(layer, ahead));
#pragma omp atomic
                        sink += f;
                    } else {
                        for (long i = 0; i < ahead; i += 64) _mm_prefetch(layer + i, _MM_HINT_T1);
                    }
                }
#pragma omp barrier
                long share = seg / n / 256 * 256, lo = t * share, hi = t == n - 1 ? seg : lo + share;
                float f = _mm512_reduce_add_ps(read_range(layer + lo, hi - lo));
#pragma omp atomic
                sink += f;
            }
        }
        printf("%s%.4f", s ? ", " : "", (now() - t0) * 1e3);
    }
    printf("]}\n");
    return sink == 0.5f; /* keeps the reads */
}
