"""The mirror's console tabs: Held, Explore and Fetch, each its own URL doing only its own work
(only Explore calls the hub; only Held refreshes), and a model's card."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import Http404
from django.shortcuts import redirect
from django.views import View

from berth.errors import BerthError
from berth.htmx import PageView, render_page
from serving.catalog import entries, fetch, hub, servability
from serving.catalog.errors import HubUnreachable
from serving.catalog.models import FetchJob
from serving.catalog.tables import FetchJobTable, FileTable, HeldTable
from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


def held_entries(user):
    from serving.models import Deployment

    rows = list(entries.visible_entries(user).prefetch_related("files"))
    paths = {}
    for entry in rows:
        for profile in entry.profiles:
            paths.setdefault(profile.get("file"), []).append(entry)
        entry.deployments = []
    for deployment in Deployment.objects.filter(model_path__in=list(paths)).select_related("node") \
            .prefetch_related("replica_set"):
        for entry in paths.get(deployment.model_path, []):
            entry.deployments.append(deployment)
    return rows


def visible_jobs(user):
    queryset = FetchJob.objects.select_related("owner")
    if access.is_superuser(user):
        return queryset
    return access.visible_to(user, queryset.filter(owner__isnull=False), "owner")


class HeldView(LoginRequiredMixin, PageView):
    template_name = "serving/catalog/held.html"
    fragment_template_name = "serving/catalog/held_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        jobs = list(visible_jobs(self.request.user)[:20])
        running = [j for j in jobs if j.status in ("queued", "running")]
        counts = {"held": 0, "downloading": len(running), "failed": sum(j.status == "failed" for j in jobs)}
        rows = held_entries(self.request.user)
        counts["held"] = len(rows)
        context.update(table=HeldTable(rows), jobs=FetchJobTable(jobs), counts=counts, polling=bool(running), tab="held")
        return context

    def render_to_response(self, context, **kwargs):
        response = super().render_to_response(context, **kwargs)
        if self.request.headers.get("HX-Request") and not context["polling"]:
            response.status_code = 286  # nothing is downloading: htmx stops polling
        return response


class ModelCardView(LoginRequiredMixin, PageView):
    template_name = "serving/catalog/card.html"

    def entry(self):
        entry = next((e for e in held_entries(self.request.user) if str(e.public_id) == str(self.kwargs["public_id"])),
                     None)
        if entry is None:
            raise Http404("No such model, or it is outside your reach.")
        return entry

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        entry = self.entry()
        verdict = None
        try:
            verdict = servability.check(entries.served_path(entry))
        except BerthError as error:
            context["not_servable"] = error.message
        context.update(entry=entry, files=FileTable(entry.files.select_related("node")), verdict=verdict, tab="held",
                       replicas=[(d, r) for d in entry.deployments for r in d.replica_set.all()])
        return context

    def post(self, request, public_id):
        entry = self.entry()
        try:
            low, high = int(request.POST.get("scaling_min", "")), int(request.POST.get("scaling_max", ""))
            entries.save_entry(Actor.from_request(request), {"scaling_min": low, "scaling_max": high}, entry=entry)
            messages.success(request, f"{entry.name}: at least {low}, at most {high} replicas.")
        except ValueError:
            messages.error(request, "Minimum and maximum are whole numbers.")
        except BerthError as error:
            messages.error(request, error.message)
        return redirect("serving:catalog-card", public_id=public_id)


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
