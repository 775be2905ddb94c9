"""A model answers to its catalog aliases; with no ready replica, a ready fallback serves instead."""

import pytest

from serving.models import ModelEntry
from serving import events
from tests.gateway.usage import record_of


def entry(name, **fields):
    made = ModelEntry.objects.create(name=name, task="completion", source_kind="local", format="gguf", **fields)
    events.routing_changed()
    return made


@pytest.mark.django_db(transaction=True)
def test_an_alias_reaches_the_model(gateway, deploy, make_key, tiny_engine):
    deploy("tiny-main", tiny_engine)
    entry("tiny-main", aliases=["tiny-alias"], scaling_min=1)
    client = gateway.openai(make_key().key)
    answer = client.completions.create(model="tiny-alias", prompt="hello", max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    listed = {m.id for m in client.models.list().data}
    assert {"tiny-main", "tiny-alias"} <= listed


@pytest.mark.django_db(transaction=True)
def test_a_ready_fallback_serves_while_the_model_has_no_replica(gateway, deploy, make_key, tiny_engine):
    deploy("fallback-tiny", tiny_engine)
    deploy("primary-big", state="stopped")
    entry("primary-big", fallbacks=["fallback-tiny"], scaling_min=1)
    client = gateway.openai(make_key().key)
    answer = client.completions.with_raw_response.create(model="primary-big", prompt="hello", max_tokens=2,
                                                         extra_headers={"X-Request-Id": "fallback-1"})
    assert answer.http_response.status_code == 200
    assert record_of("fallback-1").model_served == "fallback-tiny"
