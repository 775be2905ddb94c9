"""The placement policy's verbs with effects: decisions recorded as evidence, explain and headroom
(dry runs, recorded too), the bounded history. The reconcile loop, API, console and commands call
these; the policy itself (``scheduler.policy``) stays pure."""

from __future__ import annotations

import dataclasses
import logging

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Count, F, OuterRef, QuerySet, Subquery

from scheduler import reach, recovery_service
from scheduler.models import DecisionTally, PlacementDecision, RecoveryState
from scheduler.policy import plan as policy
from scheduler.policy.inputs import Move, Plan, Snapshot
from scheduler.policy.placement import Fleet
from tenancy.models import Scope

log = logging.getLogger(__name__)
HISTORY_DEFAULT = 10_000
MOVES_KEY = "berth:placement:moves"


def note_moves(plan: Plan) -> None:
    """Keep the last pass's moves (replicas leaving a draining node or restarting, and where each
    stands) for the node and model pages: every pass writes them, so they are never older than one."""
    cache.set(MOVES_KEY, [dataclasses.asdict(move) for move in plan.moves], None)


def moves(*, node: str | None = None, models=None) -> list[Move] | None:
    """The last pass's moves off ``node``, or of ``models`` (names); None when the cache does not
    answer (the pages say so rather than show nothing moving)."""
    try:
        stored = cache.get(MOVES_KEY) or []
    except Exception as error:  # noqa: BLE001 - a page reading it must still render
        log.warning("could not read the placement moves: %s", error)
        return None
    found = [Move(**move) for move in stored]
    return [m for m in found if (node is None or m.node == node) and (models is None or m.model in models)]


def _history_limit() -> int:
    return int(getattr(settings, "SCHEDULER_DECISION_HISTORY", HISTORY_DEFAULT))


TALLIED = (PlacementDecision.Verdict.PREEMPTED,)  # the verdicts counted over all time (a metric's counter)


def trim_history() -> int:
    """Keep only the newest ``SCHEDULER_DECISION_HISTORY`` decisions; what goes of the tallied
    verdicts is added to their ``DecisionTally`` first, in the same transaction."""
    limit = _history_limit()
    cutoff = PlacementDecision.objects.order_by("-created_at", "-id").values_list("id", flat=True)[limit:limit + 1]
    cutoff = list(cutoff)
    if not cutoff:
        return 0
    doomed = PlacementDecision.objects.filter(id__lte=cutoff[0])
    with transaction.atomic():
        for model, verdict, count in (doomed.filter(verdict__in=TALLIED).order_by().values("model", "verdict")
                                      .annotate(n=Count("pk")).values_list("model", "verdict", "n")):
            tally, _ = DecisionTally.objects.select_for_update().get_or_create(model=model, verdict=verdict)
            DecisionTally.objects.filter(pk=tally.pk).update(count=F("count") + count)
        deleted, _ = doomed.delete()
    return deleted


def tallied(verdict: str, models) -> dict[str, int]:
    """{model: decisions of ``verdict`` over all time} for ``models``: those kept and those trimmed."""
    kept = dict(PlacementDecision.objects.filter(verdict=verdict, model__in=models).order_by()
                .values_list("model").annotate(n=Count("pk")))
    for model, count in DecisionTally.objects.filter(verdict=verdict, model__in=models).values_list("model", "count"):
        kept[model] = kept.get(model, 0) + count
    return kept


def _owners(snapshot: Snapshot) -> dict:
    """{model id: its owner Scope} for the snapshot's models that have one (one query): the row
    keeps who may read it."""
    paths = {m.id: m.owner for m in snapshot.models if m.owner}
    scopes = {s.path: s for s in Scope.objects.filter(path__in=set(paths.values()))}
    return {model: scopes[path] for model, path in paths.items() if path in scopes}


def record_plan(snapshot: Snapshot, plan: Plan) -> list[PlacementDecision]:
    """Store one row per model the plan decides something about, with the inputs' digest, the
    plan's fingerprint and the free memory before and after."""
    digest, fingerprint = snapshot.digest(), plan.fingerprint()
    before = Fleet(snapshot.nodes, snapshot.replicas).total_free_bytes()
    after = Fleet(snapshot.nodes, policy.apply(snapshot, plan).replicas).total_free_bytes()
    owners = _owners(snapshot)
    rows = [PlacementDecision(kind=PlacementDecision.Kind.PLAN, model=d.model, owner=owners.get(d.model),
                              verdict=d.verdict,
                              reason_codes=list(d.codes), detail=d.detail[:4000], inputs_digest=digest,
                              fingerprint=fingerprint, node=d.node, accelerators=list(d.accelerators),
                              victims=list(d.victims), headroom_before_bytes=before, headroom_after_bytes=after)
            for d in plan.decisions]
    with transaction.atomic():
        created = PlacementDecision.objects.bulk_create(rows)
        trim_history()
    return created


def explain_placement(snapshot: Snapshot, model_id: str, *, record: bool = True) -> dict:
    """Per profile and node, why the model's next replica would be rejected (or that it fits)."""
    rows = policy.explain(snapshot, model_id)
    plan = policy.schedule(snapshot)
    unschedulable = next((u for u in plan.unschedulable if u.model == model_id), None)
    answer = {"model": model_id, "rows": rows, "fits_somewhere": any(r["fits"] for r in rows),
              "pending": {"reason": unschedulable.reason, "code": unschedulable.code} if unschedulable else None}
    if record:
        codes = sorted({r["code"] or "fits" for r in rows}) or ["unknown-model"]
        _dry_run(snapshot, plan, PlacementDecision.Kind.EXPLAIN, model_id, codes,
                 detail=(unschedulable.reason if unschedulable else f"{sum(r['fits'] for r in rows)} spot(s) fit"),
                 evidence={"rows": rows[:500]})
    return answer


def headroom(snapshot: Snapshot, model_id: str, *, limit: int = 16, record: bool = True) -> dict:
    """How many more replicas of the model fit, by a dry run on a copy of the inventory."""
    answer = policy.headroom(snapshot, model_id, limit=limit)
    if record:
        plan = policy.schedule(snapshot)
        _dry_run(snapshot, plan, PlacementDecision.Kind.HEADROOM, model_id, ["headroom"],
                 detail=f"{answer['more']} more; {answer.get('blocked', '')}", evidence=answer,
                 before=answer.get("free_bytes_before"), after=answer.get("free_bytes_after"))
    return answer


def _dry_run(snapshot, plan, kind, model_id, codes, *, detail="", evidence=None, before=None, after=None):
    with transaction.atomic():
        row = PlacementDecision.objects.create(
            kind=kind, model=model_id, owner=_owners(snapshot).get(model_id),
            verdict=PlacementDecision.Verdict.DRY_RUN, reason_codes=codes,
            detail=detail[:4000], inputs_digest=snapshot.digest(), fingerprint=plan.fingerprint(),
            headroom_before_bytes=before, headroom_after_bytes=after, evidence=evidence or {})
        trim_history()
    return row


def latest_per_model(rows: QuerySet) -> QuerySet:
    """The newest of ``rows`` for each model. A correlated subquery, not ``DISTINCT ON`` (which only
    PostgreSQL has): the embedded default runs on SQLite."""
    newest = rows.filter(model=OuterRef("model")).order_by("-created_at", "-id").values("id")[:1]
    return rows.filter(id=Subquery(newest))


def parked_and_unplaceable(caller, limit: int = 200) -> dict:
    """Parked models (from the recovery memory, ``scheduler.recovery_service.parked``; a model
    whose latest decision is parked but which has no failure memory left is listed from the
    decision, not retriable) and unplaceable ones (the latest verdict per model is unschedulable),
    among the models whose latest decision ``caller`` may read (``scheduler.reach``)."""
    latest = reach.visible_decisions(caller, latest_per_model(
        PlacementDecision.objects.filter(kind=PlacementDecision.Kind.PLAN)))
    rows = latest.order_by("model").values("model", "verdict", "detail", "reason_codes", "created_at")[:limit * 4]
    parked = recovery_service.parked(limit, models=None if reach.sees_everything(caller) else latest.values("model"))
    by_decision = [r for r in rows if r["verdict"] == PlacementDecision.Verdict.PARKED]
    # A model with a recovery row is described by it (a retried one is no longer parked, whatever
    # the last plan said); only a parked verdict with no row at all is listed from the decision.
    remembered = set(RecoveryState.objects.filter(model__in=[r["model"] for r in by_decision])
                     .values_list("model", flat=True))
    for row in by_decision:
        if row["model"] not in remembered:
            parked.append({"model": row["model"], "parked": True, "kind": "", "consecutive": None, "level": None,
                           "last_error": "", "last_failure_at": None, "since": row["created_at"],
                           "detail": row["detail"], "retried_by": "", "retried_at": None, "retriable": False})
    unplaceable = [r for r in rows if r["verdict"] == PlacementDecision.Verdict.UNSCHEDULABLE][:limit]
    return {"parked": parked[:limit], "unplaceable": unplaceable}
