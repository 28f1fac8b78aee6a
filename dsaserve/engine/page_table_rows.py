"""The page-table rows running requests hold: one row of the batch builder's table a request (engine/batch.py), the
free ones, the rows promised to a running leader's parked n > 1 followers, and which taking of a row a request's is
(`Req.row_gen`: a wide decode graph's device copy of the table stages only a row's new pages while the same taking
holds it, engine/page_table_mirror.py)."""

from __future__ import annotations

import itertools

from dsaserve.engine.request import Req


class PageTableRows:
    def __init__(self, rows: int):
        self.free = list(range(rows - 1, -1, -1))
        self.reservations: dict[Req, int] = {}  # running leader -> rows promised to its parked followers
        self._gens = itertools.count()

    @property
    def reserved(self) -> int:
        return sum(self.reservations.values())

    def take(self, req: Req) -> None:
        req.row, req.row_gen, req.pages_synced = self.free.pop(), next(self._gens), 0

    def give_back(self, req: Req) -> None:
        self.free.append(req.row)
        req.row, req.pages_synced = -1, 0

    def shrink_reservation(self, leader: Req) -> None:
        """A parked follower left: its leader never holds more reserved rows than it has followers."""
        if leader in self.reservations:
            self.reservations[leader] = min(self.reservations[leader], len(leader.followers))
            if not self.reservations[leader]:
                del self.reservations[leader]
