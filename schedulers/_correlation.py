"""Klotski's expert correlation table (§6.2): which experts of the next MoE layer follow those of this one.

The table counts, per pair (a at MoE layer l, b at the next MoE layer), the
tokens whose expert path went through both (path length 1). Where the routing
source gives the per-token paths (`ExpertCounts.follows`: synthetic routing
does), those counts are added as they are; where it gives only token counts
per (layer, micro-batch) (a real run's gates, a recorded trace), a pair seen in
one micro-batch adds the tokens the two would share if independent within it,
c_a * c_b / tokens. A profile (`popularity`) seeds every row of a layer with
the next layer's popularity; the table keeps learning from every routing it
sees, the first ones being the warm-up. The hot experts are picked as Klotski's
code does (mindspore-lab/models research/SYSU/Klotski/mixtral/mixtral.py,
`get_prefetch_expert_index`): each expert of the previous layer contributes its
tokens to its top-k followers in the table, and the K most counted are hot.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from attrs import define, field

from flowmoe.core.plan import ExpertCounts


@define
class CorrelationTable:
    layers: list[int]  # the MoE layers, in order
    experts: int
    follow: int = 2  # a token's tendency: its expert's top-`follow` followers (the model's top-k)
    _table: dict[int, list[list[float]]] = field(factory=dict)  # layer -> [a][b] toward the next MoE layer
    _seen: dict[int, list[float]] = field(factory=dict)  # layer -> tokens per expert so far

    @classmethod
    def seeded(
        cls, layers: list[int], experts: int, popularity: Sequence[Sequence[float]] | None, follow: int = 2
    ) -> CorrelationTable:
        table = cls(layers, experts, follow)
        for layer in layers:
            row = list(popularity[layer]) if popularity is not None else [0.0] * experts
            table._seen[layer] = row
        for here, after in itertools.pairwise(layers):
            table._table[here] = [list(table._seen[after]) for _ in range(experts)]
        return table

    def learn(self, before: Sequence[ExpertCounts], after: Sequence[ExpertCounts]) -> None:
        """Routing of the same micro-batches at a MoE layer (`before`, may be empty) and the next."""
        for answer in after:
            for e, n in answer.counts:
                self._seen[answer.layer][e] += n
        for a_counts, b_counts in zip(before, after, strict=False) if before else ():
            rows = self._table[a_counts.layer]
            if b_counts.follows:
                for a, b, n in b_counts.follows:
                    rows[a][b] += n
                continue
            tokens = max(1, sum(n for _, n in a_counts.counts))
            for a, na in a_counts.counts:
                for b, nb in b_counts.counts:
                    rows[a][b] += na * nb / tokens

    def hot(self, layer: int, before: Sequence[ExpertCounts], k: int, among: Sequence[int]) -> list[int]:
        """The k experts of `layer` (from `among`) most likely to follow the routing `before` of the
        previous MoE layer (by popularity if there is none); ties to the lower id. As Klotski's code
        aggregates the tendencies (`get_prefetch_expert_index`): each previous expert's tokens count
        once for each of its top-`follow` followers in the table (those seen at all), and the k most
        counted are hot."""
        score = dict.fromkeys(among, 0.0)
        if before:
            rows = self._table[before[0].layer]
            for answer in before:
                for a, na in answer.counts:
                    for b in self._followers(rows[a], among):
                        score[b] += na
        else:
            for b in among:
                score[b] = self._seen[layer][b]
        return sorted(sorted(among, key=lambda b: (-score[b], b))[:k])

    def _followers(self, row: Sequence[float], among: Sequence[int]) -> list[int]:
        ranked = sorted((b for b in among if row[b] > 0), key=lambda b: (-row[b], b))
        return ranked[: self.follow]
