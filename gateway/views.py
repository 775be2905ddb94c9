"""The gateway console: usage (records, totals, charts), model splits, the Batch API's batches, and the
playground."""

from __future__ import annotations

import time
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views import View

from berth.errors import BerthError, NotFound
from berth.htmx import render_page, wants_fragment
from gateway import services, splits
from gateway.batch.service import ACTIVE, eta_seconds
from gateway.filtersets import BatchFilterSet, UsageRecordFilterSet
from gateway.models import Batch, ModelSplit, UsageRecord
from gateway.tables import BatchTable, duration, progress
from tenancy import access
from tenancy.audit import Actor
from tenancy.console import ConsoleMixin, ConsolePage, ObjectAction, filtered
from tenancy.models import Scope, ServiceClient
from tenancy.services import clients

PLAYGROUND_KEY_LIFETIME = timedelta(minutes=10)
_SESSION_KEYS = "gateway_playground_keys"


def _visible_scope_paths(user) -> list[str]:
    return list(access.visible_to(user, Scope.objects.all(), "").order_by("path").values_list("path", flat=True)[:500])


class IndexView(ConsolePage):
    """Recent requests (one line each), charts and usage by model and day, one request by its id,
    and the model splits."""

    model = UsageRecord
    template_name = "gateway/index.html"

    def narrow(self, queryset):
        return services.visible_usage(self.request.user, queryset)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        user = self.request.user
        visible = self.get_queryset()
        filterset = UsageRecordFilterSet(self.request.GET or None, queryset=visible)
        records = filterset.qs if filterset.is_bound and filterset.is_valid() else visible
        scope = (self.request.GET.get("scope") or "").strip()
        in_scope = filterset.under_scope(visible, "scope", scope) if scope else visible
        totals = services.totals_by_model_and_day(in_scope)
        context.update(filterset=filterset, records=records.order_by("-started_at")[:100],
                       totals=totals, charts=services.charts(in_scope, totals=totals),
                       scopes=_visible_scope_paths(user), chosen_scope=scope,
                       splits=services.visible_splits(user), environments=services.ENVIRONMENTS)
        return context


class SplitSaveView(ConsoleMixin, View):
    """Create a split from the console form: variants written as ``model:weight, model:weight``; the
    scope by its path, among those the caller sees (another's is a 404)."""

    http_method_names = ["post"]
    model = Scope
    scope_field = ""

    def post(self, request):
        data = request.POST
        variants = []
        try:
            for part in filter(None, (p.strip() for p in data.get("variants", "").split(","))):
                name, _, weight = part.rpartition(":")
                variants.append({"model": name.strip(), "weight": int(weight)})
        except ValueError:
            messages.error(request, "Variants are written model:weight, separated by commas.")
            return redirect("gateway:index")
        scope = get_object_or_404(self.get_queryset(), path=data["scope"]) if data.get("scope") else None
        try:
            services.save_split(request.user, None, model_name=data.get("model_name", ""), scope=scope,
                                variants=variants, environments=data.getlist("environments"),
                                note=data.get("note", ""))
        except BerthError as error:
            messages.error(request, error.message)
        else:
            messages.success(request, "Split saved; the gateway applies it within a moment.")
        return redirect("gateway:index")


class SplitDeleteView(ObjectAction):
    """Remove a visible split; a refusal (not an admin of its scope) is said on the usage page."""

    model = ModelSplit
    page_refusals = (NotFound,)

    def narrow(self, queryset):
        return services.visible_splits(self.request.user, queryset)

    def perform(self, split, data):
        services.delete_split(self.request.user, split)

    def success_url(self, split, result):
        return reverse("gateway:index")


class BatchMixin:
    """Batches, narrowed by the gateway's one rule (``services.visible_batches``: those of the projects
    the caller holds a role in), with what the pages show of each."""

    model = Batch
    queryset = Batch.objects.select_related("client__project", "credential", "input_file", "output_file",
                                            "error_file")

    def narrow(self, queryset):
        return services.visible_batches(self.request.user, queryset)


class BatchesView(BatchMixin, ConsolePage):
    """The batches, newest first, filtered by the FilterSet the API's list reads; the table refreshes
    itself through the same URL's fragment, filters included."""

    template_name = "gateway/batches.html"
    fragment_template_name = "gateway/batches_table.html"
    shown = 200

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = BatchFilterSet(self.request.GET, queryset=self.get_queryset().order_by("-created_at", "-id"))
        chosen = any(filterset.data.get(name) for name in filterset.filters)
        context["filterset"] = filterset
        context["table"] = BatchTable(filtered(filterset)[:self.shown],
                                      empty_message="No batches match these filters." if chosen else None)
        return context


def batch_context(request, batch, **extra) -> dict:
    """The batch page's facts and its panel (status, progress, the cancel button), as the page, its
    polled fragment and the answer to a cancel show them."""
    active = batch.status in ACTIVE
    may_cancel = services.may_cancel_batch(request.user, batch)
    ended = batch.completed + batch.failed
    return {"batch": batch, "active": active, "progress": progress(batch), "eta": duration(eta_seconds(batch)),
            "percent": round(ended * 100 / batch.total) if batch.total else None,
            "may_cancel": may_cancel, "cancellable": may_cancel and active and batch.status != Batch.Status.CANCELLING,
            **extra}


class BatchView(BatchMixin, ConsolePage):
    """One batch: whose it is, its progress (the panel polls itself while the batch runs and answers
    286, stop, once it has ended) and, for a member of its project, the cancel button."""

    template_name = "gateway/batch.html"
    fragment_template_name = "gateway/batch_panel.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        batch = self.get_object()
        context.update(batch_context(self.request, batch))
        context["breadcrumbs"] = [(batch.public_id, self.request.path)]  # after Gateway › Batches
        return context

    def render_to_response(self, context, **kwargs):
        response = super().render_to_response(context, **kwargs)
        if wants_fragment(self.request) and not context["active"]:
            response.status_code = 286  # the batch has ended: htmx stops polling
        return response


class BatchCancelView(BatchMixin, ObjectAction):
    """POST: cancel a visible batch (``services.cancel_batch``: a member of its project; a viewer is
    refused with a 403 page). A batch that has ended already is said where the button was. To HTMX:
    the panel swapped in place with the outcome; otherwise back to the batch's page."""

    def perform(self, batch, data):
        return services.cancel_batch(self.actor, batch)

    def done(self, batch, result):
        if not wants_fragment(self.request):
            messages.success(self.request, f"{batch.public_id} is cancelling: lines in flight finish, the rest "
                                           "are not sent.")
        return super().done(batch, result)

    def fragment(self, batch, result, error=None):
        fresh = self.get_queryset().get(pk=batch.pk)
        said = error.message if error is not None else (f"{fresh.public_id} is cancelling: lines in flight finish, "
                                                        "the rest are not sent.")
        context = batch_context(self.request, fresh, result=said, result_is_error=error is not None)
        # 200 with a refusal inside: htmx swaps only successful answers; the panel says what went wrong.
        return render(self.request, "gateway/batch_panel.html", context)

    def success_url(self, batch, result):
        return reverse("gateway:batch", kwargs={"public_id": batch.public_id})


def _usable_clients(user):
    clients = access.visible_to(user, ServiceClient.objects.filter(is_active=True).select_related("project"),
                                "project").order_by("project__path", "name")
    return [c for c in clients if c.may_infer and access.can(user, "use", c)]


def _playground_key(request, client) -> str:
    """A short-lived key of ``client`` for the playground: minted through Tenancy (audited) and kept
    only in the caller's session until it nearly expires. Never rendered, never logged."""
    kept = request.session.get(_SESSION_KEYS, {})
    now = time.time()
    entry = kept.get(str(client.public_id))
    if entry and entry[1] - now > 60:
        return entry[0]
    credential, plaintext = clients.create_credential(Actor.from_request(request), client, name="playground",
                                                      lifetime=PLAYGROUND_KEY_LIFETIME)
    kept = {k: v for k, v in kept.items() if v[1] > now}
    kept[str(client.public_id)] = [plaintext, credential.expires_at.timestamp()]
    request.session[_SESSION_KEYS] = kept
    return plaintext


def _forget_playground_key(request, client) -> None:
    """The gateway refused the kept key (revoked, or its client's keys rotated away): the next send
    mints a new one rather than failing until the old one would have expired."""
    kept = dict(request.session.get(_SESSION_KEYS, {}))
    if kept.pop(str(client.public_id), None) is not None:
        request.session[_SESSION_KEYS] = kept


def _gateway_url(request) -> str:
    return (getattr(settings, "GATEWAY_INTERNAL_URL", "") or request.build_absolute_uri("/")).rstrip("/")


def send_playground_request(base_url: str, key: str, kind: str, model: str, text: str) -> dict:
    """Send one chat or embedding request through the gateway; what the page shows of it."""
    import httpx

    if kind == "embedding":
        path, body = "/v1/embeddings", {"model": model, "input": text}
    else:
        path, body = "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                              "max_tokens": 256}
    started = time.perf_counter()
    try:
        response = httpx.post(base_url + path, json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError as exc:
        return {"ok": False, "status": None, "error": f"The gateway could not be reached ({exc.__class__.__name__}).",
                "latency_ms": round((time.perf_counter() - started) * 1000, 1)}
    latency = round((time.perf_counter() - started) * 1000, 1)
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    result = {"ok": response.status_code == 200, "status": response.status_code, "latency_ms": latency,
              "request_id": response.headers.get("x-request-id", ""), "kind": kind}
    if response.status_code != 200:
        error = payload.get("error") if isinstance(payload, dict) else None
        result["error"] = (error or {}).get("message") or response.text[:500]
        result["code"] = (error or {}).get("code", "")
        return result
    usage = payload.get("usage") or {}
    result.update(prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                  model=payload.get("model", model))
    if kind == "embedding":
        vector = (payload.get("data") or [{}])[0].get("embedding") or []
        result.update(dimensions=len(vector), preview=", ".join(f"{v:.4f}" for v in vector[:8]))
    else:
        choice = (payload.get("choices") or [{}])[0]
        result["answer"] = (choice.get("message") or {}).get("content", "")
    return result


class PlaygroundView(LoginRequiredMixin, View):
    """Send a chat or embedding request as one of the caller's service clients (HTMX: the answer
    replaces the result panel). The key is minted for the client with a ten-minute lifetime."""

    @staticmethod
    def _choices(request) -> dict:
        """The caller's clients and what any of them may call — as ``/v1/models`` lists it for each
        client's key, so a split scoped to another tenant is never named here either."""
        table = splits.load_table()
        usable = _usable_clients(request.user)
        models = set()
        for client in usable:
            models |= set(splits.callable_models(table, client.project.path, client.environment,
                                                 client.allows_model))
        return {"clients": usable, "models": sorted(models)}

    def get(self, request):
        return render(request, "gateway/playground.html", self._choices(request))

    def post(self, request):
        data = request.POST
        kind = "embedding" if data.get("kind") == "embedding" else "chat"
        model, text = (data.get("model") or "").strip(), data.get("text") or ""
        client = ServiceClient.objects.filter(public_id=data.get("client") or None).first() \
            if _looks_like_uuid(data.get("client")) else None
        if client is None or not access.can(request.user, "use", client):
            result = {"ok": False, "error": "Choose one of your service clients."}
        elif not model or not text.strip():
            result = {"ok": False, "error": "Choose a model and write something to send."}
        else:
            try:
                key = _playground_key(request, client)
            except BerthError as error:
                result = {"ok": False, "error": f"No key could be made for {client.name}: {error.message}"}
            else:
                result = send_playground_request(_gateway_url(request), key, kind, model, text)
                if result.get("status") == 401:
                    _forget_playground_key(request, client)
                    result["note"] = "The playground's key was refused; the next request makes it a new one."
        result.setdefault("client", client.name if client else "")
        context = {"result": result, "chosen": data}
        if not wants_fragment(request):  # without JavaScript: the whole page, with the result
            context.update(self._choices(request))
        return render_page(request, "gateway/playground.html", "gateway/playground_result.html", context)


def _looks_like_uuid(value) -> bool:
    import uuid

    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
