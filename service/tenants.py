"""Tenants: who sends a request, for the fair shares of one deployment between its API keys
(docs/deploy.md, "One deployment, several tenants").

Every accepted key belongs to one tenant:
- each table of the keys file (BERTSERVE_KEYS_FILE) is a tenant of its own, with its weight and
  the default priority of its requests;
- the keys of BERTSERVE_API_KEYS (and BERTSERVE_API_KEY) are one tenant together, `default`,
  of weight 1: they are one client's keys while it rotates them;
- with no key set at all, every request is the one tenant `anonymous`.

A tenant's weight is its share, against the other tenants with work waiting, of each model's
time (runtime.fairness: weighted fair queueing of the model's tokens) and of the process's
in-flight, receiving and queued places (`Held`); its name labels the metrics and its refusals,
never its key."""

from __future__ import annotations

import hmac
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from bertserve.runtime.schemas import PRIORITIES
from bertserve.service.http.auth import bearer

NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")  # a Prometheus label value, an access-log word
FIELDS = {"key", "keys", "weight", "priority"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int | None = None  # its requests' default priority (None: the server's)


ANONYMOUS = Tenant("anonymous")
DEFAULT = Tenant("default")


class KeysFileError(ValueError):
    """A keys file that cannot be used, with the file and the table named."""


def read_keys_file(path: Path, min_length: int) -> list[tuple[bytes, Tenant]]:
    """The (key, tenant) pairs of a keys file: TOML, one table a tenant,

    [search]
    keys = ["<key>", "<key>"]   # or key = "<key>"; each of min_length characters or more
    weight = 3                  # > 0, default 1
    priority = 0                # PRIORITIES, default: the server's for its kind
    """
    try:
        tables = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KeysFileError(f"keys file {path}: {exc}") from None
    pairs: list[tuple[bytes, Tenant]] = []
    low, high = PRIORITIES
    for name, table in tables.items():
        where = f"keys file {path}, [{name}]"
        if not NAME.fullmatch(name) or name in (ANONYMOUS.name, DEFAULT.name):
            raise KeysFileError(
                f"{where}: a tenant's name is 1-63 of a-z 0-9 _ . - (starting with a letter or "
                f"digit), not {ANONYMOUS.name!r} or {DEFAULT.name!r}"
            )
        if not isinstance(table, dict):
            raise KeysFileError(f"{where}: a table (key/keys, weight, priority), not a value")
        unknown = set(table) - FIELDS
        if unknown:
            raise KeysFileError(
                f"{where}: unknown fields {sorted(unknown)}; known: {sorted(FIELDS)}"
            )
        keys = table.get("keys", []) + ([table["key"]] if "key" in table else [])
        if not keys or not all(isinstance(k, str) for k in keys):
            raise KeysFileError(f'{where}: give its key as key = "..." or keys = ["..."]')
        short = [k for k in keys if len(k.strip()) < min_length]
        if short:
            raise KeysFileError(f"{where}: every key needs {min_length} characters or more")
        weight = table.get("weight", 1)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not (math.isfinite(weight) and weight > 0)
        ):
            raise KeysFileError(f"{where}: weight must be a number above 0; got {weight!r}")
        priority = table.get("priority")
        if priority is not None and (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not low <= priority <= high
        ):
            raise KeysFileError(
                f"{where}: priority must be an integer from {low} (served first) to {high}"
            )
        tenant = Tenant(name, float(weight), priority)
        pairs.extend((k.strip().encode(), tenant) for k in keys)
    seen: set[bytes] = set()
    for key, tenant in pairs:
        if key in seen:
            raise KeysFileError(f"keys file {path}: a key is given twice (last in [{tenant.name}])")
        seen.add(key)
    return pairs


class Tenants:
    """Every accepted key and its tenant; `of` says whose a request's Authorization is."""

    def __init__(self, pairs: list[tuple[bytes, Tenant]]) -> None:
        self.pairs = pairs
        self.keys = tuple(key for key, _ in pairs)
        # The tenants that share the process's places (`places`): each once, in the file's order.
        named = {tenant.name: tenant for _, tenant in pairs}
        self.all: tuple[Tenant, ...] = tuple(named.values()) or (ANONYMOUS,)
        self.total_weight = sum(t.weight for t in self.all)

    def of(self, given: list[bytes]) -> Tenant | None:
        """The tenant of `given` (a request's Authorization headers, read as
        service.http.auth.bearer reads them); None when no key matches (401 is the API key
        check's to answer). With one tenant (no key set: `anonymous`), that one, unchecked:
        a wrong key is refused by the key check all the same. Every key is compared in
        constant time, as `authorized` does."""
        if len(self.all) == 1:
            return self.all[0]
        token = bearer(given)
        found = None
        for key, tenant in self.pairs:
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def share(self, limit: int, tenant: Tenant) -> int:
        """A tenant's part of `limit` places: limit x its weight / every tenant's weight, at
        least 1; the whole limit where there is one tenant."""
        if len(self.all) == 1:
            return limit
        return max(1, int(limit * tenant.weight / self.total_weight))


@dataclass(slots=True)
class Held:
    """One tenant's places in this process (service.state.Slot) and its caps: its shares of
    max_receiving, max_in_flight and max_queued_batches (`Tenants.share`). The caps partition
    each limit, so one tenant's flood or slow bodies never take another's places; the
    process-wide limits still hold."""

    tenant: Tenant
    receiving_cap: int
    running_cap: int  # in flight, not queued
    queued_cap: int
    receiving: int = 0
    running: int = 0
    queued: int = 0


def places(tenants: Tenants, receiving: int, in_flight: int, queued: int) -> dict[str, Held]:
    """Each tenant's Held, by name; none where there is one tenant (nothing to share)."""
    if len(tenants.all) < 2:
        return {}
    return {
        t.name: Held(
            t,
            tenants.share(receiving, t),
            tenants.share(in_flight, t),
            tenants.share(queued, t),
        )
        for t in tenants.all
    }
