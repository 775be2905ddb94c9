"""The placement policy's rules as the operator tuned them (``BERTH_SCHEDULER_*`` settings)."""

from __future__ import annotations

from django.conf import settings

from scheduler.policy.inputs import Settings


def policy_settings() -> Settings:
    """The policy's tunable rules as the operator set them: every snapshot the running system builds,
    and the recovery ladder's memory, use these."""
    park_after = settings.SCHEDULER_PARK_AFTER
    return Settings(min_lifetime_s=settings.SCHEDULER_MIN_LIFETIME_SECONDS,
                    preempt_hold_s=settings.SCHEDULER_PREEMPT_HOLD_SECONDS, max_victims=settings.SCHEDULER_MAX_VICTIMS,
                    park_after=park_after, crash_retries=park_after - 1,
                    starved_after_s=settings.SCHEDULER_STARVED_AFTER_SECONDS,
                    sleep_window_s=settings.SCHEDULER_SLEEP_WINDOW_SECONDS)
