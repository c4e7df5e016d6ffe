"""Fair shares of one model's queue between tenants (service.tenants: an API key's owner),
weighted: self-clocked fair queueing of the model's tokens, and the admission bounds split the
same way.

Tags. Each queued row gets a virtual finish tag: its tenant's previous tag in the row's
priority (or the queue's virtual time, if later: a tenant that had nothing queued starts
where service is now) plus the row's tokens over its tenant's weight. Within a priority the
batcher forms each call around the row of the least tag, and the queue's virtual time moves
to that tag; so while two tenants both have rows waiting, each is served tokens in proportion
to its weight, and a tenant that sends ten times as much only lengthens its own wait. The call
is filled by closeness in length (padding), the least tag among equals, from rows whose tags lie
within one call's tokens (its row cap times the first row's length, at most its token budget,
over the least weight waiting) of the first: no tenant gets more than a call ahead of its share.
Tokens, not rows: a tenant of long texts costs the model more for each.

Admission. A tenant's rows queued for a model are bounded by its share of the bound: the
bound times its weight over the weights of the tenants with rows of that kind queued, itself
included. Alone it has the whole bound, as before; beside others its flood meets 429 while
theirs is admitted. The queue may so hold up to twice a bound for a moment (a tenant arriving
at a queue another filled), never more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

ANONYMOUS = "anonymous"  # the tenant of a request no key names (service.tenants.ANONYMOUS)


class Fairness:
    def __init__(self) -> None:
        self._virtual: dict[int, float] = {}  # by priority: the tag of its last call's first row
        self._finish: dict[tuple[str, int], float] = {}  # by (tenant, priority): its last tag
        self._weights: dict[str, float] = {}  # the weight each tenant last came with
        self.queued: Counter[tuple[str, bool]] = Counter()  # rows by (tenant, client batch)

    def tags(
        self, tenant: str, weight: float, priority: int, lengths: Iterable[int]
    ) -> list[float]:
        """The finish tags of a request's rows, in order, counted as queued."""
        key = (tenant, priority)
        tag = max(self._virtual.get(priority, 0.0), self._finish.get(key, 0.0))
        tags = []
        for length in lengths:
            tag += length / weight
            tags.append(tag)
        self._finish[key] = tag
        self._weights[tenant] = weight
        return tags

    def served(self, priority: int, tag: float) -> None:
        """A call formed around a row of `priority` and `tag` (its least): the virtual time."""
        if tag > self._virtual.get(priority, 0.0):
            self._virtual[priority] = tag

    def recount(self, rows: Iterable[tuple[str, bool]]) -> None:
        """The rows still queued, by (tenant, client batch), after a sweep; an empty queue
        starts every tenant afresh."""
        self.queued = Counter(rows)
        if not self.queued:
            self._virtual.clear()
            self._finish.clear()

    def share(self, tenant: str, weight: float, bulk: bool) -> float:
        """The part of a bound of kind `bulk` that `tenant` may hold: its weight over the
        weights of the tenants with rows of that kind queued, itself among them; 1 alone."""
        total = weight
        for (other, kind), count in self.queued.items():
            if kind == bulk and count > 0 and other != tenant:
                total += self._weights.get(other, 1.0)
        return weight / total

    def window(self, weights: Iterable[float], tokens: int) -> float:
        """How far past the first row's tag a row may lie and still join its call: one call's
        tokens over the least weight among those waiting."""
        least = min(weights, default=1.0)
        return tokens / least
