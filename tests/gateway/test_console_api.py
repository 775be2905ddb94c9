"""The usage API and console page: records narrowed to the caller's scopes."""

from datetime import timedelta

import pytest
from django.utils import timezone

from gateway.models import UsageRecord
from tenancy.models import Membership, Role

pytestmark = pytest.mark.django_db


@pytest.fixture
def records(tree):
    now = timezone.now()
    other = tree.org.path + "-other/ml/x"

    def make(request_id, path, model="tiny"):
        return UsageRecord.objects.create(request_id=request_id, started_at=now, finished_at=now + timedelta(seconds=1),
                                          endpoint="chat/completions", model_asked=model, model_served=model,
                                          status=200, total_ms=12.5, prompt_tokens=5, completion_tokens=7,
                                          scope_path=path)

    return [make("mine-1", tree.project.path), make("mine-2", tree.project.path, "other-model"),
            make("theirs-1", other)]


@pytest.fixture
def member(django_user_model, tree):
    user = django_user_model.objects.create_user("mia", "mia@example.org", "a-long-test-password")
    Membership.objects.create(user=user, scope=tree.team, role=Role.MEMBER)
    return user


def test_usage_api_lists_only_the_callers_scopes_and_filters(client, member, records):
    client.force_login(member)
    listed = client.get("/api/gateway/usage/").json()
    assert sorted(r["request_id"] for r in listed["results"]) == ["mine-1", "mine-2"]
    filtered = client.get("/api/gateway/usage/", {"model": "other-model"}).json()
    assert [r["request_id"] for r in filtered["results"]] == ["mine-2"]
    one = client.get("/api/gateway/usage/mine-1/")
    assert one.status_code == 200 and one.json()["completion_tokens"] == 7
    assert client.get("/api/gateway/usage/theirs-1/").status_code == 404


def test_console_page_shows_recent_requests_and_totals(client, member, records):
    client.force_login(member)
    page = client.get("/gateway/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "mine-1" in text and "theirs-1" not in text and "Usage by model and day" in text
    found = client.get("/gateway/", {"request_id": "mine-2"}).content.decode()
    assert "mine-2" in found and "mine-1" not in found
