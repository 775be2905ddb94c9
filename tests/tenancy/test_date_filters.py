"""Date-time filters of every list (usage, audit): any ISO 8601 moment Python reads is compared in
UTC, and one that does not exist there is a 400 naming the parameter, never a server error."""

import json

import pytest

pytestmark = pytest.mark.django_db

LISTS = ("/api/gateway/usage/", "/api/tenancy/audit/", "/api/tenancy/audit/export/")


@pytest.mark.parametrize("url", LISTS)
def test_offsets_postgresql_refuses_are_compared_in_utc(url, personas, api):
    # Python reads offsets up to ±23:59; PostgreSQL refuses those beyond ±15:59.
    answer = api(personas.olivia).get(url, {"since": "2026-09-30T11:13:29+22:23", "until": "2106-05-09T18:45:27-23:10"})
    assert answer.status_code == 200, answer.content[:300]


@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("moment", ["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00", "not a date"])
def test_a_moment_outside_utcs_years_is_a_400_naming_the_filter(url, moment, personas, api):
    answer = api(personas.olivia).get(url, {"since": moment})
    assert answer.status_code == 400, answer.content[:300]
    assert "since" in json.loads(answer.content)["error"]["details"]
