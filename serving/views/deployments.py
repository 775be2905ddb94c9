"""The Models area of the console: deployments, one deployment, and the deploy wizard."""

from __future__ import annotations

import json

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import Http404
from django.shortcuts import redirect
from django.views import View

from berth.errors import BerthError
from berth.htmx import PageView, render_page
from serving.deployments import gate, operations, service
from serving.deployments.service import visible_deployments
from serving.models import DeploymentState as S, Operation
from serving.models.states import SETTLED
from serving.views.forms import DeployForm
from serving.views.live import deployment_events
from serving.views.tables import DeploymentTable, EventTable, OperationTable
from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


class DeploymentsView(LoginRequiredMixin, PageView):
    template_name = "serving/deployments.html"
    fragment_template_name = "serving/deployments_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["table"] = DeploymentTable(visible_deployments(self.request.user))
        return context


class DeploymentView(LoginRequiredMixin, PageView):
    template_name = "serving/deployment.html"
    fragment_template_name = "serving/deployment_live.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        deployment = visible_deployments(self.request.user).filter(public_id=kwargs["public_id"]).first()
        if deployment is None:
            raise Http404("No such deployment, or it is outside your reach.")
        events = list(deployment.events.all())
        operations = Operation.objects.filter(source=deployment) | Operation.objects.filter(target=deployment)
        context.update(deployment=deployment, events=EventTable(reversed(events)),
                       operations=OperationTable(operations.distinct()),
                       log_tail=next((e.log_tail for e in reversed(events) if e.log_tail), ""),
                       settled=deployment.state in SETTLED,
                       live_events=bool(settings.REDIS_URL))
        return context


class DeploymentActionView(LoginRequiredMixin, View):
    """POST stop / start / remove on one deployment, then back to where the person was."""

    verbs = {"stop": service.stop, "start": service.start, "remove": service.remove, "sleep": service.sleep,
             "wake": service.wake}

    def post(self, request, public_id, verb):
        deployment = visible_deployments(request.user).filter(public_id=public_id).first()
        if deployment is None or verb not in self.verbs:
            raise Http404("No such deployment, or it is outside your reach.")
        try:
            done = self.verbs[verb](Actor.from_request(request), deployment)
        except BerthError as error:
            messages.error(request, error.message)
            return redirect("serving:deployment", public_id=public_id)
        if verb == "wake":
            self.say_how_the_wake_stands(request, done)
        if verb == "remove":
            messages.success(request, f"{deployment.name} removed.")
            return redirect("serving:index")
        return redirect("serving:deployment", public_id=public_id)

    @staticmethod
    def say_how_the_wake_stands(request, deployment) -> None:
        """A wake not done within the wait goes on in the background: say where it stands."""
        if deployment.state == S.READY:
            messages.success(request, f"{deployment.name} is awake.")
        elif deployment.state == S.SLEEPING:
            position = gate.wake_position(deployment.replica_set.filter(state=S.SLEEPING))
            messages.info(request, f"{deployment.name} waits for a start-up slot (position {position}) and wakes at "
                                   "its turn." if position else f"{deployment.name} is waking.")


class ReconfigureView(LoginRequiredMixin, View):
    """Change engine settings in place. Refused at once when the new settings would not fit in A's
    place; otherwise the switch runs in the background and rolls back on failure."""

    def post(self, request, public_id):
        deployment = visible_deployments(request.user).filter(public_id=public_id).first()
        if deployment is None:
            raise Http404("No such deployment, or it is outside your reach.")
        try:
            patch = json.loads(request.POST.get("config") or "{}")
            if not isinstance(patch, dict):
                raise ValueError("a JSON object")
            operations.reconfigure(Actor.from_request(request), deployment, patch)
            messages.success(request, f"Reconfiguring {deployment.name}: the new settings fit, so it restarts with "
                                      "them (with the old ones again if they fail).")
        except ValueError as error:
            messages.error(request, f"The settings must be a JSON object: {error}")
        except BerthError as error:
            messages.error(request, error.message)
        return redirect("serving:deployment", public_id=public_id)


class DeployView(LoginRequiredMixin, View):
    """The wizard: the preview runs as one types (debounced); only Deploy changes anything."""

    def get(self, request):
        return render_page(request, "serving/deploy.html", "serving/deploy.html", {"form": DeployForm()})

    def post(self, request):
        form = DeployForm(request.POST)
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
                form.add_error(None, error.message)
                return render_page(request, "serving/deploy.html", "serving/deploy.html",
                                   {"form": form, "refusal": error}, status=error.status)
            messages.success(request, f"{deployment.name} is deploying on {deployment.node.name}.")
            return redirect("serving:deployment", public_id=deployment.public_id)
        return render_page(request, "serving/deploy.html", "serving/deploy.html", {"form": form}, status=400)


class PreviewView(LoginRequiredMixin, View):
    def post(self, request):
        form = DeployForm(request.POST)
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
                                 config=form.engine_config(), owner=owner, priority=data["priority"])


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
