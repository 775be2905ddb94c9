"""The hub endpoints refuse what the hub could never answer with a 400 that says why, never a 500."""

import pytest
from rest_framework.test import APIClient

from tests.assets.hub_server import hub  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("query", [{}, {"repo": ""}, {"repo": "not a repo id"}, {"repo": "a/b/c/d"}])
def test_a_repository_the_hub_could_never_hold_is_a_400(query, hub, personas):
    caller = APIClient()
    caller.force_login(personas.max)
    answer = caller.get("/api/serving/hub/files/", query)
    assert answer.status_code == 400, answer.content[:300]
    assert answer.json()["error"]["code"] == "invalid"


@pytest.mark.parametrize("query", [{"repo": "acme/no-such-model"}, {"repo": "acme/tiny", "revision": "../../etc"}])
def test_an_unknown_repository_or_revision_is_a_404(query, hub, personas):
    hub.add("acme/tiny", {"tiny.gguf": b"GGUF"})
    caller = APIClient()
    caller.force_login(personas.max)
    answer = caller.get("/api/serving/hub/files/", query)
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "repository_not_found")
