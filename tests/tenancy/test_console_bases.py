"""The console's bases (``tenancy.console``) as every app's views use them."""

import pytest
from django.urls import reverse

from tenancy.models import Membership

pytestmark = pytest.mark.django_db


def test_a_refused_htmx_action_varies_on_hx_request_as_one_that_succeeds(personas, browse):
    # The same URL answers a plain post with a redirect: a cache must never hand one for the other.
    membership = Membership.objects.get(user=personas.vera)
    url = reverse("tenancy:membership_role", args=[membership.public_id])
    olivia = browse(personas.olivia)
    refused = olivia.post(url, {"role": "emperor"}, HTTP_HX_REQUEST="true")
    assert refused.status_code == 200 and refused.content.decode().lstrip().startswith('<tr id="membership-')
    assert "HX-Request" in refused["Vary"]
    assert Membership.objects.get(pk=membership.pk).role == "viewer"
    done = olivia.post(url, {"role": "member"}, HTTP_HX_REQUEST="true")
    assert done.status_code == 200 and "HX-Request" in done["Vary"]
    plain = olivia.post(url, {"role": "emperor"})
    assert plain.status_code == 302
