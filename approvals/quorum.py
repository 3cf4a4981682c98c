"""When an approval has enough approvers: a total, and per-group minimums within it
("two approvers, at least one from finance"; docs/approvals.md, "Quorum").

Who may decide: members of the approval's group or of any group with a minimum (and
superusers). Each approver fills at most one group's seat — "one from finance and one from
legal" takes two people even if someone is in both — so the seats are matched to the
approvers (a small bipartite matching: at most ``policies.MAX_REQUIRED`` seats). A
superuser counts towards the total, and towards a group's minimum only as a member of it.

Pure functions over who approved: ``approvals.services.approval_decide`` settles an approval
with them, the dispatch re-checks an approved one against the current policy with them, and
the pages say what is still needed ("1 of 2, needs 1 from finance").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Approver:
    key: Any
    groups: frozenset[str]
    superuser: bool = False


@dataclass(frozen=True)
class Quorum:
    approvals: int
    required: int
    # seats of each group not filled yet (only groups still missing someone)
    missing: dict[str, int] = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.approvals >= self.required and not self.missing

    @property
    def missing_total(self) -> int:
        return sum(self.missing.values())

    def describe(self) -> str:
        """ "1 of 2, needs 1 from finance" """
        text = f"{self.approvals} of {self.required}"
        if self.missing:
            text += ", needs " + " and ".join(
                f"{n} from {g}" for g, n in sorted(self.missing.items())
            )
        return text


def eligible_groups(group: str, minimums: dict[str, int] | None) -> list[str]:
    """The groups whose members may decide: the approval's own, then those with a minimum."""
    return [group, *(g for g in sorted(minimums or {}) if g != group)]


def assess(
    approvers: Iterable[Approver], *, group: str, required: int, minimums: dict[str, int] | None
) -> Quorum:
    minimums = {g: n for g, n in (minimums or {}).items() if n}
    pool = set(eligible_groups(group, minimums))
    counted = [a for a in approvers if a.superuser or a.groups & pool]
    seats = [g for g, n in sorted(minimums.items()) for _ in range(n)]
    matched = _match(seats, counted)
    missing: dict[str, int] = {}
    for index, seat in enumerate(seats):
        if index not in matched:
            missing[seat] = missing.get(seat, 0) + 1
    return Quorum(approvals=len(counted), required=required, missing=missing)


def refusal(
    approvers: list[Approver],
    newcomer: Approver,
    *,
    group: str,
    required: int,
    minimums: dict[str, int] | None,
) -> str:
    """Why ``newcomer``'s approval would not count ("" when it would): every approval still
    to come is reserved for a group's minimum, and the newcomer fills none of them. Refused
    rather than recorded, so an approval never holds more approvers than it needs and nobody
    believes their approval moved it on."""
    before = assess(approvers, group=group, required=required, minimums=minimums)
    if not before.missing or before.missing_total < before.required - before.approvals:
        return ""
    after = assess([*approvers, newcomer], group=group, required=required, minimums=minimums)
    if after.missing_total < before.missing_total:
        return ""
    needed = " and ".join(f"{n} from {g}" for g, n in sorted(before.missing.items()))
    return (
        f"the approval{'s' if before.missing_total != 1 else ''} still needed must come from "
        f"a group with a minimum ({needed}): yours would not count"
    )


def _match(seats: list[str], approvers: list[Approver]) -> set[int]:
    """The seats filled by a maximum matching of seats to distinct approvers in their
    group (Kuhn's augmenting paths; a handful of seats)."""
    owner: dict[int, int] = {}  # approver index -> seat index

    def place(seat: int, seen: set[int]) -> bool:
        for index, approver in enumerate(approvers):
            if seats[seat] not in approver.groups or index in seen:
                continue
            seen.add(index)
            if index not in owner or place(owner[index], seen):
                owner[index] = seat
                return True
        return False

    for seat in range(len(seats)):
        place(seat, set())
    return set(owner.values())
