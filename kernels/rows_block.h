/* What cpu_rows_avx2.c's and cpu_rows_avx512.c's blocks share: where each of a block's `rows` weight
   rows starts. */
#ifndef FLOWMOE_ROWS_BLOCK_H
#define FLOWMOE_ROWS_BLOCK_H

/* wp[j] = row o0 + j of w ([*, K] of esize-byte elements) for j < rows; a short last block (ob < rows)
   repeats its last row, whose results are not kept. */
static inline void block_rows(const void **wp, int rows, const void *w, long o0, int ob, long K, int esize) {
    for (int j = 0; j < rows; j++) wp[j] = (const char *)w + (o0 + (j < ob ? j : ob - 1)) * K * esize;
}

#endif
