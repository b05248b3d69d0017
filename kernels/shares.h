/* A thread's share of a parallel loop over the blocks of several experts, whose blocks cost by how
   many rows their expert has (cpu_expert.c's FFNs; cpu_packed.c's). OpenMP's static schedule gives
   each thread as many iterations, so in a prefill, where routing gives one expert 17 rows and another
   119, the thread holding the busier experts ran on while the other waited at the barrier (a 128-token
   prefill's experts at 2 threads). Here each thread takes a contiguous span of iterations of about
   equal cost: iteration t (expert t / blocks) costs SHARE_FIXED + ns[t / blocks], the fixed part the
   block's read of its weights (worth a few rows of arithmetic; at one or two rows, a decode step's,
   the spans are as static's). Which thread computes a block does not change its sums. */
#ifndef FLOWMOE_SHARES_H
#define FLOWMOE_SHARES_H

#define SHARE_FIXED 8 /* a block's weight read, in rows of its arithmetic */

typedef struct {
    long from, to; /* iterations [from, to) */
} span;

/* The first iteration of the experts' blocks (ns[e] rows each, `blocks` blocks an expert) whose
   cost before it reaches `cost`. */
static inline long iteration_at(int experts, const int *ns, long blocks, long cost) {
    long before = 0;
    for (int e = 0; e < experts; e++) {
        long each = SHARE_FIXED + ns[e], all = each * blocks;
        if (cost <= before + all) return e * blocks + (cost - before + each - 1) / each;
        before += all;
    }
    return experts * blocks;
}

/* Thread `id` of `threads`'s span of the experts x blocks iterations. */
static inline span share_of(int experts, const int *ns, long blocks, int id, int threads) {
    long total = 0;
    for (int e = 0; e < experts; e++) total += (SHARE_FIXED + ns[e]) * blocks;
    return (span){iteration_at(experts, ns, blocks, total * id / threads),
                  iteration_at(experts, ns, blocks, total * (id + 1) / threads)};
}

#endif
