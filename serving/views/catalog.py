"""The mirror's console tabs: Held, Explore and Fetch, each its own URL doing only its own work
(only Explore calls the hub; only Held refreshes), and a model's card."""

from __future__ import annotations

import dataclasses

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import redirect
from django.urls import reverse
from django.views import View

from berth.errors import BerthError
from berth.htmx import render_page
from scheduler import memory
from scheduler.models import CalibrationRecord
from serving.catalog import entries, fetch, hub, placing, profiles, queries, restarts, room, servability
from serving.catalog.errors import HubUnreachable
from serving.control import serve_model as serve
from serving.deployments.states import holder_of
from serving.models import FetchJob, ModelEntry, ProfileSpeed
from serving.models.states import LOADABLE
from serving.views.catalog_tables import FetchJobTable, FileTable, HeldTable, deployable
from tenancy import access
from tenancy.audit import Actor
from tenancy.console import ConsolePage, ObjectAction
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


class EntryMixin:
    """Catalog entries, narrowed by the catalog's one rule (``entries.visible_entries``: shared ones
    and those of scopes the caller sees)."""

    model = ModelEntry
    queryset = ModelEntry.objects.select_related("owner").prefetch_related("files")

    def narrow(self, queryset):
        return queryset.filter(pk__in=entries.visible_entries(self.request.user).values("pk"))


class HeldView(EntryMixin, ConsolePage):
    template_name = "serving/catalog/held.html"
    fragment_template_name = "serving/catalog/held_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        jobs = list(queries.visible_jobs(self.request.user)[:20])
        running = [j for j in jobs if j.status in ("queued", "running")]
        counts = {"held": 0, "downloading": len(running), "failed": sum(j.status == "failed" for j in jobs)}
        rows = queries.held(self.request.user, list(self.get_queryset()))
        counts["held"] = len(rows)
        context.update(table=HeldTable(rows), jobs=FetchJobTable(jobs), counts=counts, polling=bool(running), tab="held")
        return context

    def render_to_response(self, context, **kwargs):
        response = super().render_to_response(context, **kwargs)
        if self.request.headers.get("HX-Request") and not context["polling"]:
            response.status_code = 286  # nothing is downloading: htmx stops polling
        return response


@dataclasses.dataclass(frozen=True)
class ReplicaMemory:
    """What a replica's load measured, against what it reserved (on each of its GPUs, or the node's RAM)."""

    measured_bytes: int | None
    how: str = ""  # which measurement it was
    over_bytes: int = 0  # how far the measurement exceeds the reservation


def with_memory(replicas: list[tuple]) -> list[tuple]:
    """``(deployment, replica)`` pairs, each replica with its ``memory`` (``ReplicaMemory``): on a GPU
    the device memory its load measured (the engine's processes, or the device's delta) from its load
    record; on the CPU its peak resident memory. Host memory is never shown against a GPU reservation."""
    loads = memory.load_measurements([holder_of(replica) for _, replica in replicas])
    for deployment, replica in replicas:
        record = loads.get(holder_of(replica))
        if record is not None and record.measured_bytes:
            measured, how = record.measured_bytes, record.get_measurement_display() or "measured"
        elif not deployment.gpu_uuids and replica.peak_memory_bytes:
            measured, how = replica.peak_memory_bytes, CalibrationRecord.Measurement.PEAK_RSS.label
        else:
            measured, how = None, ""
        reserved = replica.memory_reserved_bytes
        over = measured - reserved if measured and reserved and measured > reserved else 0
        replica.memory = ReplicaMemory(measured, how, over)
    return replicas


class ModelCardView(EntryMixin, ConsolePage):
    """A held model: servability, replicas, the room for more, its placement (a form) and files.

    A refused placement re-shows the form as typed, each problem under the field it concerns."""

    template_name = "serving/catalog/card.html"

    def entry(self):
        """The model with what runs it (404 outside the caller's reach)."""
        return queries.held(self.request.user, [self.get_object()])[0]

    def get_context_data(self, **kwargs):

        context = super().get_context_data(**kwargs)
        entry = kwargs.get("entry") or self.entry()
        verdict = None
        try:
            verdict = servability.check_entry(entry)
        except BerthError as error:
            context["not_servable"] = error.message
        files = list(entry.files.select_related("node"))
        held = entries.nodes_holding([f.path for f in files])
        for file in files:
            file.held_on = held.get(file.path, [])
        owners = placing.owners_for(self.request.user)
        if entry.owner is not None and entry.owner not in owners:
            owners.insert(0, entry.owner)  # shown as it is, even where the caller may not give it away
        speeds = {row.profile: row for row in ProfileSpeed.objects.filter(model=entry.name)}
        ways = [{"name": p.get("name", ""), "engine": profiles.engine(p), "context": p.get("context"),
                 "slots": profiles.slots(p), "priority": p.get("priority"), "speed": speeds.get(p.get("name"))}
                for p in entry.profiles or []]
        context.update(entry=entry, files=FileTable(files), verdict=verdict, tab="held", profiles=ways,
                       deployable=bool(deployable(entry)),
                       replicas=with_memory([(d, r) for d in entry.deployments for r in d.replica_set.all()
                                             if r.state in LOADABLE]),
                       room=room.room_for_more(entry), where=entry.placement,
                       values=kwargs.get("values") or placement_values(entry), problems=kwargs.get("problems") or {},
                       refusal=kwargs.get("refusal"), other_problems=kwargs.get("other_problems") or [],
                       may_change=placing.may_change(self.request.user, entry), restart=restarts.progress(entry),
                       owners=owners, may_share=access.is_superuser(self.request.user),
                       classes=ModelEntry.ServiceClass.choices, default_idle=ModelEntry.DEFAULT_IDLE_SECONDS,
                       breadcrumbs=[(entry.name, self.request.path)])  # after Models › Catalog
        return context

    def post(self, request, public_id):
        entry = self.entry()
        # A field the form did not send stays as it is (the owner too).
        values = {**placement_values(entry),
                  **{key: request.POST[key].strip() for key in (*placing.FIELDS, "owner") if key in request.POST}}
        changes = {key: values[key] for key in placing.FIELDS if key in request.POST}
        for key in ("scaling_min", "scaling_max", "idle_timeout_seconds", "max_output_tokens"):
            if key in changes:
                changes[key] = _number(changes[key])
        for key in ("idle_timeout_seconds", "max_output_tokens"):
            if changes.get(key) == "":
                changes[key] = None  # blank: the default, no cap
        if "pinned" in changes:  # a hidden "off" comes before the checkbox: the last value sent wins
            changes["pinned"] = {"on": True, "off": False}.get(changes["pinned"], changes["pinned"])
        if "fallbacks" in changes:  # typed as names between commas
            changes["fallbacks"] = [name.strip() for name in changes["fallbacks"].split(",") if name.strip()]
        try:
            owner = placing.resolve_owner(request.user, values["owner"]) if "owner" in request.POST else placing.KEEP
            entry = placing.change(Actor.from_request(request), entry, changes, owner=owner)
        except BerthError as error:
            problems, others = {}, []
            for problem in (error.details.get("problems") if isinstance(error.details, dict) else None) or []:
                if problem["field"] in placing.LABELS:  # shown under its field
                    problems.setdefault(problem["field"], []).append(problem["message"])
                else:
                    others.append(f"{problem['field']}: {problem['message']}")
            context = self.get_context_data(entry=entry, values=values, refusal=error, other_problems=others,
                                            problems={field: {"label": placing.LABELS[field], "messages": found}
                                                      for field, found in problems.items()})
            return self.render_to_response(context, status=error.status)
        messages.success(request, f"{entry.name}: {describe_placement(entry)}.")
        return redirect("serving:catalog-card", public_id=public_id)


class ModelRestartView(EntryMixin, ObjectAction):
    """POST a rolling restart of the model (``serving.catalog.restarts``); back to its card, which
    shows where it stands. A refusal (nothing runs, the caller's role) is said there."""

    def perform(self, entry, data):
        entry = restarts.restart(self.actor, entry)
        messages.success(self.request, f"{entry.name}: a rolling restart is under way — each replica is replaced "
                                       "by a fresh one, the new one ready before the old stops.")
        return entry

    def success_url(self, entry, result):
        return reverse("serving:catalog-card", kwargs={"public_id": entry.public_id})


def _number(text: str) -> int | str:
    """A whole number as typed, or the text itself for the validation to name."""
    try:
        return int(text)
    except ValueError:
        return text


def placement_values(entry: ModelEntry) -> dict[str, str]:
    """The placement form's fields as the entry holds them."""
    return {"scaling_min": str(entry.scaling_min), "scaling_max": str(entry.scaling_max),
            "service_class": entry.service_class,
            "idle_timeout_seconds": "" if entry.idle_timeout_seconds is None else str(entry.idle_timeout_seconds),
            "pinned": "on" if entry.pinned else "off", "fallbacks": ", ".join(entry.fallbacks or []),
            "max_output_tokens": "" if entry.max_output_tokens is None else str(entry.max_output_tokens),
            "draft": entry.draft, "owner": str(entry.owner.public_id) if entry.owner else ""}


def describe_placement(entry: ModelEntry) -> str:
    """``at least 1, at most 2 replicas, class automatic (standard), idle timeout the default, not pinned,
    owner shared``"""
    kind = f"automatic ({entry.effective_class})" if not entry.service_class else entry.service_class
    idle = f"{entry.idle_timeout_seconds} s" if entry.idle_timeout_seconds else "the default"
    owner = entry.owner.written if entry.owner else "shared"
    stand_ins = f", falls back to {', '.join(entry.fallbacks)}" if entry.fallbacks else ""
    draft = f", drafted by {entry.draft}" if entry.draft else ""
    cap = f", at most {entry.max_output_tokens} output tokens a request" if entry.max_output_tokens else ""
    return (f"at least {entry.scaling_min}, at most {entry.scaling_max} replicas, class {kind}, "
            f"idle timeout {idle}, {'pinned' if entry.pinned else 'not pinned'}{stand_ins}{draft}{cap}, owner {owner}")


class ExploreView(LoginRequiredMixin, View):
    def get(self, request):
        query, repo = request.GET.get("q", "").strip(), request.GET.get("repo", "").strip()
        context = {"q": query, "repo": repo, "tab": "explore"}
        try:
            if repo:
                listing = hub.repository(repo, request.GET.get("revision") or "main")
                sets = listing.file_sets()
                context.update(listing=listing, sets=sets)
                chosen = request.GET.get("estimate")
                if chosen:
                    file = next((f for s in sets for f in s.files if f.path == chosen), None)
                    if file is not None:
                        context["estimate"] = hub.remote_estimate(listing.repo, listing.commit, file)
            elif query:
                context["results"] = hub.search(query)
        except HubUnreachable as error:
            context["unreachable"] = error.message
        except BerthError as error:
            context["error"] = error.message
        return render_page(request, "serving/catalog/explore.html", "serving/catalog/explore.html", context,
                           status=503 if "unreachable" in context else 200)


class FetchView(LoginRequiredMixin, View):
    def get(self, request):
        return self.form(request, dict(request.GET.items()))

    def form(self, request, values, refusal=None, status=200):
        return render_page(request, "serving/catalog/fetch.html", "serving/catalog/fetch.html",
                           {"values": values, "refusal": refusal, "tab": "fetch"}, status=status)

    def post(self, request):
        values = {k: request.POST.get(k, "").strip() for k in ("repo", "revision", "quant", "file", "patterns",
                                                                 "name", "owner")}
        try:
            owner = None
            if values["owner"]:
                owner = resolve_scope(values["owner"], access.visible_to(request.user, Scope.objects.all(), ""))
            job = fetch.start(Actor.from_request(request), fetch.FetchRequest(
                repo=values["repo"], revision=values["revision"] or "main", quant=values["quant"] or None,
                file=values["file"] or None, patterns=tuple(p for p in values["patterns"].split() if p),
                name=values["name"] or None, owner=owner, allow_pickle=request.POST.get("allow_pickle") == "on"))
        except BerthError as error:
            return self.form(request, values, refusal=error, status=error.status)
        messages.success(request, f"Fetching {job.repo} at {job.commit[:8]}: follow it on Held.")
        return redirect("serving:catalog-held")


SERVE_FIELDS = ("repo", "revision", "quant", "file", "name", "owner", "node", "context")


class ServeView(LoginRequiredMixin, View):
    """Serve in one command from the console: the same job as ``manage.py serve_model`` on the
    control queue; a refusal returns to the Fetch tab's serve form with the reason."""

    def get(self, request):
        return redirect("serving:catalog-fetch")

    def post(self, request):
        values = {k: request.POST.get(k, "").strip() for k in SERVE_FIELDS}
        values["on_demand"] = request.POST.get("on_demand") == "on"
        try:
            job = serve.start_from_values(Actor.from_request(request), request.user, values)
        except BerthError as error:
            return render_page(request, "serving/catalog/fetch.html", "serving/catalog/fetch.html",
                               {"values": {}, "serve_values": values, "serve_refusal": error, "tab": "fetch"},
                               status=error.status)
        return redirect("serving:catalog-job", public_id=job.public_id)


class JobView(ConsolePage):
    """One fetch or serve job: each step and file as it changes. htmx polls the fragment while
    the job runs; once it has ended the fragment carries no trigger and answers 286 (stop)."""

    model = FetchJob
    queryset = FetchJob.objects.select_related("owner", "model")
    template_name = "serving/catalog/job.html"
    fragment_template_name = "serving/catalog/job_status.html"

    def narrow(self, queryset):
        return queries.visible_jobs(self.request.user, queryset)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        job = self.get_object()
        running = job.status in (FetchJob.Status.QUEUED, FetchJob.Status.RUNNING)
        context.update(job=job, polling=running, tab="fetch",
                       breadcrumbs=[(f"{job.get_kind_display()} {job.repo}", self.request.path)])
        return context

    def render_to_response(self, context, **kwargs):
        response = super().render_to_response(context, **kwargs)
        if self.request.headers.get("HX-Request") and not context["polling"]:
            response.status_code = 286  # the job has ended: htmx stops polling
        return response
