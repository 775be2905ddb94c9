"""The Models area of the console: deployments, one deployment, and the deploy wizard."""

from __future__ import annotations

import json

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views import View

from berth.errors import BerthError, InvalidInput
from berth.htmx import render_page, wants_fragment
from serving.deployments import actions, gate, operations, service
from serving.deployments.filters import DeploymentFilterSet
from serving.deployments.service import visible_deployments
from serving.models import Deployment, DeploymentState as S, Operation
from serving.models.states import SETTLED, TERMINAL
from serving.views.forms import DeployForm
from serving.views.live import deployment_events
from serving.views.tables import DeploymentTable, EventTable, OperationTable
from serving.views.timeline import timeline
from tenancy import access
from tenancy.audit import Actor
from tenancy.console import ConsolePage, ObjectAction, filtered
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


class DeploymentMixin:
    """Deployments, narrowed by serving's one rule (``visible_deployments``: those whose owner scope
    the caller sees; ownerless ones for administrators), with what the pages show of each."""

    model = Deployment
    queryset = Deployment.objects.select_related("node", "owner").prefetch_related("replica_set__node")

    def narrow(self, queryset):
        return queryset.filter(pk__in=visible_deployments(self.request.user).values("pk"))


class DeploymentsView(DeploymentMixin, ConsolePage):
    """The deployments, filtered by the FilterSet the API's list reads; the table refreshes itself
    through the same URL's fragment, filters included."""

    template_name = "serving/deployments.html"
    fragment_template_name = "serving/deployments_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = DeploymentFilterSet(self.request.GET, queryset=self.get_queryset())
        chosen = any(filterset.data.get(name) for name in filterset.filters)
        context["filterset"] = filterset
        context["table"] = DeploymentTable(filtered(filterset),
                                           empty_message="No deployments match these filters." if chosen else None)
        return context


class DeploymentView(DeploymentMixin, ConsolePage):
    template_name = "serving/deployment.html"
    fragment_template_name = "serving/deployment_live.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        deployment = self.get_object()
        context.update(deployment_context(self.request, deployment))
        context["breadcrumbs"] = [(deployment.name, self.request.path)]  # after Models › Deployments
        return context


# The console's buttons, in the order they are shown: (label, class, confirmation). Stop and Remove
# end what runs or what is kept: they ask first.
BUTTONS = {
    "start": ("Start", "secondary", ""),
    "stop": ("Stop", "secondary", "Stop {name}? Requests to it fail until it runs again."),
    "sleep": ("Sleep", "secondary", ""),
    "wake": ("Wake", "secondary", ""),
    "remove": ("Remove", "danger", "Remove {name}? Its record and its events go; this cannot be undone."),
}


def may_act(request, deployment) -> bool:
    """Whether the caller's role lets them act on it (the service's own rule: member of its owner)."""
    try:
        service.require(Actor.from_request(request), "use", deployment)
    except BerthError:
        return False
    return True


def action_buttons(request, deployment) -> dict:
    """What the actions panel shows: a button for each verb possible in the deployment's state
    (``actions.possible``, the rule a verb posted anyway is refused by), none for a caller whose
    role does not let them act, and what it would take when none is offered."""
    allowed = may_act(request, deployment)
    possible = actions.possible(deployment)
    buttons = [{"verb": verb, "label": label, "style": style, "confirm": confirm.format(name=deployment.name)}
               for verb, (label, style, confirm) in BUTTONS.items() if allowed and verb in possible]
    if not allowed:
        owner = deployment.owner.written if deployment.owner else None
        none = f"Acting on it takes member (or above) of {owner}." if owner else "Only administrators act on it."
    else:
        none = "" if buttons else f"Nothing to do while it is {deployment.get_state_display().lower()}."
    return {"buttons": buttons, "may_act": allowed, "no_buttons": none,
            "may_reconfigure": allowed and "reconfigure" in possible}


def deployment_context(request, deployment) -> dict:
    """The deployment page's facts, live panel and actions, as the page and its fragments show them."""
    events = list(deployment.events.all())
    operations = Operation.objects.filter(source=deployment) | Operation.objects.filter(target=deployment)
    return {"deployment": deployment, "events": EventTable(reversed(events)),
            "timeline": timeline(deployment, events, timezone.now()),
            "operations": OperationTable(operations.distinct()),
            "log_tail": next((e.log_tail for e in reversed(events) if e.log_tail), ""),
            "settled": deployment.state in SETTLED, "live_events": bool(settings.REDIS_URL),
            **action_buttons(request, deployment)}


def _back_to(deployment) -> str:
    return reverse("serving:deployment", kwargs={"public_id": deployment.public_id})


class DeploymentActionView(DeploymentMixin, ObjectAction):
    """POST start / stop / sleep / wake / remove on one deployment. A verb the deployment's state
    does not take (``actions.require_possible``) is refused with the reason before the service is
    called, so nothing changes. To a plain POST: back to its page (to the list once removed), the
    outcome said there. To HTMX: the actions panel swapped in place with the outcome, the live panel
    with it (out of band); once removed, to the list (``HX-Redirect``). A refusal, even "not
    allowed", is said where the button was."""

    page_refusals = ()
    verbs = {"stop": service.stop, "start": service.start, "remove": service.remove, "sleep": service.sleep,
             "wake": service.wake}

    def post(self, request, *args, **kwargs):
        if kwargs["verb"] not in self.verbs:
            raise Http404("No such action.")
        return super().post(request, *args, **kwargs)

    def perform(self, deployment, data):
        verb = self.kwargs["verb"]
        service.require(self.actor, "use", deployment)  # a role that may not act hears that first
        actions.require_possible(deployment, verb)
        done = self.verbs[verb](self.actor, deployment)
        return deployment if verb == "remove" else done  # removed: the list is where to go back to

    def outcome(self, deployment, result) -> tuple[int, str]:
        """(message level, what happened), as the panel or the next page says it."""
        verb, name = self.kwargs["verb"], deployment.name
        if verb == "wake":
            return how_the_wake_stands(result)
        if verb == "stop" and result.state in TERMINAL:
            return messages.SUCCESS, f"{name} stopped."
        return messages.SUCCESS, {"start": f"{name} is starting.", "stop": f"{name} is stopping.",
                                  "sleep": f"{name} is going to sleep.", "remove": f"{name} removed."}[verb]

    def done(self, deployment, result):
        level, said = self.outcome(deployment, result)
        if self.kwargs["verb"] == "remove" or not wants_fragment(self.request):
            messages.add_message(self.request, level, said)  # said on the page gone to next
        self.said = (level, said)
        return super().done(deployment, result)

    def fragment(self, deployment, result, error=None):
        removed = error is None and self.kwargs["verb"] == "remove"
        fresh = None if removed else self.get_queryset().filter(pk=deployment.pk).first()
        if fresh is None:  # gone (removed now, or meanwhile by someone else): htmx goes to the list
            response = HttpResponse(status=204)
            response["HX-Redirect"] = reverse("serving:index")
            return response
        level, said = (messages.ERROR, error.message) if error is not None else self.said
        context = {**deployment_context(self.request, fresh), "result": said,
                   "result_is_error": level == messages.ERROR}
        # 200 with the refusal inside: htmx swaps only successful answers; the panel says what went wrong.
        return render(self.request, "serving/deployment_acted.html", context)

    def success_url(self, deployment, result):
        if result is not None and self.kwargs["verb"] == "remove":
            return reverse("serving:index")
        return _back_to(deployment)


def how_the_wake_stands(deployment) -> tuple[int, str]:
    """A wake not done within the wait goes on in the background: say where it stands."""
    if deployment.state == S.READY:
        return messages.SUCCESS, f"{deployment.name} is awake."
    if deployment.state == S.SLEEPING:
        position = gate.wake_position(deployment.replica_set.filter(state=S.SLEEPING))
        return messages.INFO, (f"{deployment.name} waits for a start-up slot (position {position}) and wakes at its "
                               "turn." if position else f"{deployment.name} is waking.")
    return messages.INFO, f"{deployment.name} is {deployment.state}."


class ReconfigureView(DeploymentMixin, ObjectAction):
    """Change engine settings in place. Refused at once when the new settings would not fit in A's
    place; otherwise the switch runs in the background and rolls back on failure. Either way back
    to the deployment's page, which says how it went."""

    page_refusals = ()

    def perform(self, deployment, data):
        service.require(self.actor, "use", deployment)
        actions.require_possible(deployment, "reconfigure")
        try:
            patch = json.loads(self.request.POST.get("config") or "{}")
        except ValueError as error:
            raise InvalidInput(f"The settings must be a JSON object: {error}") from None
        if not isinstance(patch, dict):
            raise InvalidInput('The settings must be a JSON object, e.g. {"context": 4096}.')
        operation = operations.reconfigure(self.actor, deployment, patch)
        messages.success(self.request, f"Reconfiguring {deployment.name}: the new settings fit, so it restarts with "
                                       "them (with the old ones again if they fail).")
        return operation

    def success_url(self, deployment, result):
        return _back_to(deployment)


class DeployView(LoginRequiredMixin, View):
    """The wizard: the preview runs as one types (debounced); only Deploy changes anything."""

    def get(self, request):
        """Blank, or filled in for ``?model=<held model's id>`` (and ``&profile=``)."""
        chosen = request.GET.get("model", "").strip()
        form = DeployForm.for_entry(request.user, chosen, request.GET.get("profile", "").strip()) if chosen \
            else DeployForm(user=request.user)
        return render_page(request, "serving/deploy.html", "serving/deploy.html", {"form": form})

    def post(self, request):
        form = DeployForm(request.POST, user=request.user)
        if form.is_valid():
            try:
                if form.cleaned_data.get("actions"):
                    operation = operations.deploy_after(Actor.from_request(request), _request(request, form),
                                                        form.cleaned_data["actions"])
                    messages.success(request, "Freeing memory first, then deploying: "
                                              + "; ".join(f"{a['kind']} {a['target']}" for a in operation.request["actions"]))
                    return redirect("serving:index")
                deployment = service.deploy(Actor.from_request(request), _request(request, form))
            except BerthError as error:
                form.place_problems(error)
                return render_page(request, "serving/deploy.html", "serving/deploy.html",
                                   {"form": form, "refusal": error}, status=error.status)
            messages.success(request, f"{deployment.name} is deploying on {deployment.node.name}.")
            return redirect("serving:deployment", public_id=deployment.public_id)
        return render_page(request, "serving/deploy.html", "serving/deploy.html", {"form": form}, status=400)


class PreviewView(LoginRequiredMixin, View):
    def post(self, request):
        form = DeployForm(request.POST, user=request.user)
        context = {"form": form}
        if form.is_valid():
            try:
                result = service.preview(Actor.from_request(request), _request(request, form))
                # Each plan with the actions the wizard posts back when it is chosen.
                context.update(result=result, plans=[
                    (plan, json.dumps([{"kind": a.kind, "target": a.target} for a in plan.actions]))
                    for plan in (result.fit.plans if result.fit else ())])
            except BerthError as error:
                context["error"] = error
        return render_page(request, "serving/preview.html", "serving/preview.html", context)


def _request(request, form) -> service.DeployRequest:
    data = form.cleaned_data
    owner = None
    if data.get("owner"):
        owner = resolve_scope(data["owner"], access.visible_to(request.user, Scope.objects.all(), ""))
    return service.DeployRequest(name=data["name"], model_path=data["model_path"], node=data["node"],
                                 engine=data["engine"], runtime=data["runtime"], task=data["task"],
                                 config=form.engine_config(), owner=owner, priority=data["priority"],
                                 accelerator=data["accelerator"],
                                 profile=(data.get("profile") or "") if form.entry is not None else "")


async def deployment_stream(request, public_id):
    """``text/event-stream`` of one deployment's transitions (404 outside the caller's reach)."""
    from asgiref.sync import sync_to_async
    from django.conf import settings
    from django.http import HttpResponse, StreamingHttpResponse

    user = await request.auser()
    if not user.is_authenticated:
        raise Http404("No such deployment, or it is outside your reach.")
    visible = await sync_to_async(lambda: visible_deployments(user).filter(public_id=public_id).exists())()
    if not visible:
        raise Http404("No such deployment, or it is outside your reach.")
    if not settings.REDIS_URL:
        return HttpResponse(status=204)  # nothing to listen to: the page polls
    response = StreamingHttpResponse(deployment_events(str(public_id)), content_type="text/event-stream")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response
