"""cpu_kv.c's write of a step's keys and values into a layer's cache against kv_cache.write_rows'
indexed writes (torch's index_put_): the same bytes, fp32 and bf16, decode and prefill rows of
strided k / v views of a fused projection; and what it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from flowmoe.kernels import cpu_kv
from flowmoe.kernels.kv_cache import write_rows
from flowmoe.kernels.layout import TokenLayout

compiled = pytest.mark.skipif(cpu_kv.kernel() is None, reason="no C kernels on this host")


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [(1, 1, 1), (1, 3, 2)])
def test_write_is_the_indexed_write(dtype: torch.dtype, counts: tuple[int, ...]) -> None:
    layout = TokenLayout(slots=(2, 0, 1), counts=counts, past=(5, 0, 14))
    keys, values = (torch.randn(3, 4, 16, 32).to(dtype) for _ in range(2))
    heads = torch.randn(layout.tokens, 12, 32).to(dtype)  # q, k and v heads
    k, v = heads[:, 4:8], heads[:, 8:]
    want_keys, want_values = keys.clone(), values.clone()
    write_rows(want_keys, want_values, layout.token_slots, layout.positions, k, v)
    assert cpu_kv.write(keys, values, layout, k, v)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_what_it_leaves_to_torch() -> None:
    keys, values = torch.zeros(2, 4, 16, 32), torch.zeros(2, 4, 16, 32)
    k, v = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    no_slot, past_end = TokenLayout(slots=(2,), counts=(1,), past=(0,)), TokenLayout((0,), (1,), (16,))
    assert not cpu_kv.write(keys, values, no_slot, k, v)
    assert not cpu_kv.write(keys, values, past_end, k, v)
    fits, two = TokenLayout(slots=(1,), counts=(1,), past=(3,)), TokenLayout((1,), (2,), (3,))
    assert not cpu_kv.write(keys, values, fits, k.bfloat16(), v.bfloat16())  # dtypes differ
    assert not cpu_kv.write(keys, values, fits, k[..., ::2], v[..., ::2])  # strided rows
    assert not cpu_kv.write(keys, values, two, k, v)  # tokens differ
