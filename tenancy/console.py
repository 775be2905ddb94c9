"""The console's bases, for every app's views.

Concrete views are declarations over these. ``ConsoleMixin`` narrows every queryset to what the
caller may see before anything runs (``narrow``: by default the rows of scopes where the caller holds
a role) and looks objects up by public id through it, so an object outside the caller's reach is a
404; it turns a service's refusal into a refusal page (403 for "not allowed"). ``ObjectAction`` is a
POST on one such object that calls one service and answers with a redirect, or with the swapped piece
of page to an HTMX request. ``filtered`` reads a FilterSet as a console page shows it; ``scope_crumbs``
is a record page's trail through the tree (``berth/breadcrumbs.html``), as far as the caller sees it.
Services check permissions and write the audit log: views never write rows.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from django.utils.http import url_has_allowed_host_and_scheme
from django.views import View

from berth.errors import BerthError, InvalidInput, NotFound, PermissionDenied
from berth.htmx import PageView, wants_fragment
from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Scope


class ConsoleMixin(LoginRequiredMixin):
    """A console view over one model, narrowed to the caller: lists read ``get_queryset()``, object
    views ``get_object()`` (by ``public_id`` through the narrowed queryset: outside reach is 404)."""

    model: type | None = None
    queryset = None
    scope_field = "scope"  # how to reach a row's Scope, for ``access.visible_to``

    @property
    def actor(self) -> Actor:
        return Actor.from_request(self.request)

    def get_queryset(self):
        queryset = self.queryset if self.queryset is not None else self.model.objects.all()
        return self.narrow(queryset.all())

    def narrow(self, queryset):
        """The rows the caller may see; a view whose rows are not reached through a Scope says here
        what its rule is instead."""
        return access.visible_to(self.request.user, queryset, self.scope_field)

    def get_object(self):
        if getattr(self, "_object", None) is None:
            self._object = get_object_or_404(self.get_queryset(), public_id=self.kwargs["public_id"])
        return self._object

    def may(self, action: str, obj) -> bool:
        return access.can(self.request.user, action, obj)

    def dispatch(self, request, *args, **kwargs):
        try:
            return super().dispatch(request, *args, **kwargs)
        except NotFound as error:
            raise Http404(error.message) from None
        except PermissionDenied as error:
            return render(request, "tenancy/refused.html", {"error": error}, status=403)
        except BerthError as error:  # any other refusal that reached here: said, with its status
            return render(request, "tenancy/refused.html", {"error": error, "title": "Cannot do that"},
                          status=error.status)


class ConsolePage(ConsoleMixin, PageView):
    pass


class ObjectAction(ConsoleMixin, View):
    """A POST on one visible object: validate the form, call the service, then redirect (or, to an
    HTMX request, answer with the swapped piece). A refusal other than those in ``page_refusals``
    (404 and 403 pages) is shown where the person pressed the button."""

    http_method_names = ["post"]
    form_class = None
    page_refusals: tuple = (NotFound, PermissionDenied)

    def post(self, request, *args, **kwargs):
        obj = self.get_object()
        form = self.form_class(request.POST) if self.form_class else None
        try:
            if form is not None and not form.is_valid():
                raise InvalidInput(first_error(form), details=form.errors.get_json_data())
            result = self.perform(obj, form.cleaned_data if form is not None else {})
        except self.page_refusals:
            raise
        except BerthError as error:
            return self.failed(obj, error)
        return self.done(obj, result)

    def perform(self, obj, data):
        raise NotImplementedError

    def success_url(self, obj, result) -> str:
        raise NotImplementedError

    def fragment(self, obj, result, error=None) -> HttpResponse | None:
        """The swapped piece for HTMX requests; None to redirect them too."""
        return None

    def done(self, obj, result):
        return self._fragment_or(obj, result, None) or HttpResponseRedirect(
            next_url(self.request) or self.success_url(obj, result))

    def failed(self, obj, error: BerthError):
        response = self._fragment_or(obj, None, error)
        if response is not None:
            return response
        messages.error(self.request, error.message)
        return HttpResponseRedirect(next_url(self.request) or self.success_url(obj, None))

    def _fragment_or(self, obj, result, error) -> HttpResponse | None:
        if not wants_fragment(self.request):
            return None
        response = self.fragment(obj, result, error=error)
        if response is not None:
            # The same URL answers a plain post with a redirect: no cache may hand one for the other.
            patch_vary_headers(response, ("HX-Request",))
        return response


def filtered(filterset):
    """The rows ``filterset`` selects, as a console page shows them. The API refuses a filter it
    cannot read (400) or a scope outside the caller's reach (404, as one that does not exist); a page
    shows nothing instead, and says why on the filter form."""
    if filterset.is_bound and not filterset.is_valid():
        return filterset.queryset.none()
    try:
        return filterset.qs
    except (NotFound, InvalidInput) as refusal:
        filterset.form.add_error(None, refusal.message)
        return filterset.queryset.none()


def scope_crumbs(user, scope: Scope) -> list[tuple[str, str]]:
    """Breadcrumbs (name, page) of ``scope`` and the scopes above it, top first, leaving out those
    outside ``user``'s reach: a crumb would tell them what such a scope is called."""
    above = access.visible_to(user, Scope.objects.filter(path__in=scope.ancestor_paths()), "")
    # A scope's ancestors' paths are prefixes of its own: ordered by path, the organisation comes first.
    return [(s.name, reverse("tenancy:scope", args=[s.public_id])) for s in above.order_by("path")]


def first_error(form) -> str:
    for field, errors in form.errors.items():
        label = form.fields[field].label or field.replace("_", " ") if field in form.fields else ""
        return f"{label}: {errors[0]}".capitalize() if label else errors[0]
    return "The form is invalid."


def next_url(request) -> str | None:
    """Where the form asked to go back to (``next``), when it is on this site."""
    target = request.POST.get("next") or request.GET.get("next")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return target
    return None
