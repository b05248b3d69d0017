"""TaskNode is compared and hashed by value, as a frozen attrs class is (it is not frozen, for the
speed of making one; nothing changes a node once made: attrs.evolve derives another)."""

from __future__ import annotations

from attrs import evolve

from flowmoe.core.plan import Lane, Op, TaskNode


def test_nodes_equal_and_hash_by_value() -> None:
    node = TaskNode(7, Op.EXPERT_FFN, Lane.CPU_COMPUTE, layer=2, mb=0, expert=5, deps=(3, 4), rows=1)
    same = evolve(node)
    assert same == node and same is not node and hash(same) == hash(node)
    assert {node: "ran"}[same] == "ran"
    moved = evolve(node, lane=Lane.GPU_COMPUTE)
    assert moved != node and node.lane is Lane.CPU_COMPUTE
    assert node.label == "expert_ffn L2 mb0 e5"
