/* A step's new keys and values into a layer's KV cache in one C call (cpu_kv.py): the bytes of
   torch's `keys[slots, :, positions] = k` (index_put_ of one dtype into another of the same dtype
   is a copy), without its two index_put_ and view operations per layer. */

#include <string.h>

/* For each sequence s (where[4 s ..] = token row, cache slot, past, count): its `count` tokens'
   rows of k and v [T, heads, ...] (strides in bytes k_t, k_h; v_t, v_h; each head's row_bytes
   contiguous) into keys / values [slots, heads, capacity, ...] (strides in bytes ks, kh, kp; vs,
   vh, vp) at positions past .. past + count - 1 of the slot. */
void flowmoe_write_kv(int sequences, const long *where, long heads, long row_bytes, const char *k, long k_t,
                      long k_h, const char *v, long v_t, long v_h, char *keys, long ks, long kh, long kp,
                      char *values, long vs, long vh, long vp) {
    for (int s = 0; s < sequences; s++) {
        long row = where[4 * s], slot = where[4 * s + 1], past = where[4 * s + 2], count = where[4 * s + 3];
        for (long j = 0; j < count; j++)
            for (long h = 0; h < heads; h++) {
                memcpy(keys + slot * ks + h * kh + (past + j) * kp, k + (row + j) * k_t + h * k_h, row_bytes);
                memcpy(values + slot * vs + h * vh + (past + j) * vp, v + (row + j) * v_t + h * v_h, row_bytes);
            }
    }
}
