"""A CPU GEMM of a few rows against a weight matrix streamed from DRAM: how much longer than one row.

At one row (a decode token) a CPU expert is a matrix-vector product and streams its weights once at
what the cores read (`HardwareSpec.cpu_stream_bandwidth`). With a few rows it does not stay at that
time, as a bandwidth roofline would have it: the BLAS a PyTorch CPU expert runs (MKL / oneDNN) packs
the weight panel for its GEMM kernel and runs its micro-kernel on a tile it cannot fill, so the time
grows with the rows long before the flops bind. Fiddler measures it on its Xeon hosts ("the latency
associated with CPU processing tends to scale almost linearly with the input size", §3.2 and Appendix A,
Fig. 7; its latency model, efeslab/fiddler src/fiddler/mixtral.py, prices a CPU expert at tokens x a
per-token cost); flowmoe's own calibration measures the same shape, a little under linear:

`flowmoe calibrate` on the dev VM (bench/sim_accuracy_profile.json, `cpu_roofline`: float32 matmuls of
a 2048 x 2048 weight kept out of cache, one thread, AMD EPYC with AVX2): 5.92 / 6.41 / 12.15 / 14.91 /
27.24 GFLOP/s at 1 / 2 / 4 / 8 / 16 rows, so r x F(1) / F(r) = 1 / 1.85 / 1.95 / 3.18 / 3.48 times the
one-row time. At 1 row that GEMM is at its memory roof (11.8 GB/s); from 32 rows on it nears its
large-GEMM rate, where the cost model's flop term already binds, so the factor stays at 16 rows' beyond.

The factor scales the streaming term of a CPU GEMM node (an expert FFN on `cpu.compute`) whose host has
no measured CPU roofline (a calibrated profile prices its rows itself). It is carried to every host as
measured here: an estimate for other BLAS builds and ISAs, below Fiddler's linear.
"""

from __future__ import annotations

import bisect
import math

# (rows, time / one row's time): flowmoe calibrate, bench/sim_accuracy_profile.json (see above)
_MEASURED_GFLOPS = ((1, 5.9246), (2, 6.4064), (4, 12.1464), (8, 14.9080), (16, 27.2422))
ROWS_FACTOR: tuple[tuple[float, float], ...] = tuple(
    (float(rows), rows * _MEASURED_GFLOPS[0][1] / gflops) for rows, gflops in _MEASURED_GFLOPS
)
SOURCE = (
    "flowmoe calibrate on the dev VM (bench/sim_accuracy_profile.json cpu_roofline; float32, cold "
    "2048 x 2048 weight, 1 thread, AVX2 EPYC): 1 / 1.85 / 1.95 / 3.18 / 3.48 x the one-row time at "
    "1 / 2 / 4 / 8 / 16 rows; Fiddler §3.2, Appendix A (Fig. 7): CPU expert latency almost linear in tokens"
)


def rows_factor(rows: float) -> float:
    """The time of a CPU GEMM of `rows` rows over the time of one row, streaming the same weights:
    the measured points interpolated in log(rows), 1 at one row or fewer, flat past the last point."""
    table = ROWS_FACTOR
    if rows <= table[0][0]:
        return 1.0
    if rows >= table[-1][0]:
        return table[-1][1]
    k = bisect.bisect_right([r for r, _ in table], rows)
    (r0, f0), (r1, f1) = table[k - 1], table[k]
    w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
    return f0 + w * (f1 - f0)
