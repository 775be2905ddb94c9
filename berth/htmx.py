"""One URL serves the full page and its HTMX fragment.

A plain request gets the page (which includes the fragment); an HTMX request — other than a
boosted navigation, which wants the whole page — gets the fragment alone. The response varies on
``HX-Request`` so no cache hands one to a client that asked for the other.
"""

from __future__ import annotations

from django.shortcuts import render
from django.utils.cache import patch_vary_headers
from django.views.generic import TemplateView


def wants_fragment(request) -> bool:
    htmx = getattr(request, "htmx", None)
    return bool(htmx) and not htmx.boosted


def render_page(request, page_template: str, fragment_template: str, context: dict | None = None,
                status: int = 200):
    template = fragment_template if wants_fragment(request) else page_template
    response = render(request, template, context or {}, status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response


class PageView(TemplateView):
    """A console page whose ``fragment_template_name`` is also served alone to HTMX requests."""

    fragment_template_name: str = ""

    def get_template_names(self):
        if self.fragment_template_name and wants_fragment(self.request):
            return [self.fragment_template_name]
        return super().get_template_names()

    def render_to_response(self, context, **kwargs):
        response = super().render_to_response(context, **kwargs)
        patch_vary_headers(response, ("HX-Request",))
        return response
