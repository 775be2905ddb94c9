"""Load scaling: one step at a time, with the load behind each decision.

Only for models whose max exceeds their base. Busy — one request or more waiting per ready replica,
or more in flight than the measured capacity — held for 60 s adds one replica (never while another
is still starting, never above max). Quiet — nothing waiting and the rest under 70 % of their
measured capacity — held for 10 minutes removes one load-added replica.
"""

from __future__ import annotations

import dataclasses

UP_WAITING, UP_AFTER_S, DOWN_AFTER_S, DOWN_HEADROOM = 1.0, 60.0, 600.0, 0.7


@dataclasses.dataclass(frozen=True)
class Load:
    replicas: int  # ready
    running: int
    waiting: int
    starting: int = 0


@dataclasses.dataclass(frozen=True)
class ScaleState:
    extra: int = 0
    busy_since: float | None = None
    quiet_since: float | None = None


@dataclasses.dataclass(frozen=True)
class ScaleDecision:
    state: ScaleState
    change: int  # +1, -1 or 0
    reason: str


def step(state: ScaleState, load: Load, *, base: int, maximum: int, now: float,
         max_concurrency: int | None = None) -> ScaleDecision:
    if base <= 0 or maximum <= base:
        return ScaleDecision(ScaleState(), 0, "")
    per_replica = load.waiting / max(load.replicas, 1)
    measured = max_concurrency is not None and max_concurrency > 0
    over = measured and load.running + load.waiting > max_concurrency * max(load.replicas, 1)
    fits_fewer = (not measured) or load.running <= DOWN_HEADROOM * max_concurrency * max(load.replicas - 1, 0)
    said = (f"{per_replica:.2f} waiting per replica, {load.running} in flight"
            + (f", measured {max_concurrency} per replica" if measured else ""))
    if per_replica >= UP_WAITING or over:
        since = state.busy_since if state.busy_since is not None else now
        if now - since >= UP_AFTER_S and base + state.extra < maximum and load.starting == 0:
            return ScaleDecision(ScaleState(state.extra + 1, now, None), +1,
                                 f"busy for {now - since:.0f} s ({said}): one replica added")
        return ScaleDecision(ScaleState(state.extra, since, None), 0, "")
    if load.waiting == 0 and state.extra > 0 and fits_fewer:
        since = state.quiet_since if state.quiet_since is not None else now
        if now - since >= DOWN_AFTER_S:
            return ScaleDecision(ScaleState(state.extra - 1, None, now), -1,
                                 f"quiet for {now - since:.0f} s ({said}): one load-added replica removed")
        return ScaleDecision(ScaleState(state.extra, None, since), 0, "")
    return ScaleDecision(ScaleState(state.extra, None, None), 0, "")
