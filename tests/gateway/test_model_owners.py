"""A tenant's own model (its catalog entry's owner, else its deployments') is called and listed only by
clients of that scope and below: to every other tenant it is as unknown as a model that does not exist,
whatever their keys' model rules say. A model without an owner is shared."""

import httpx
import pytest

from serving.models import ModelEntry
from serving import events
from serving.control.routing import load_table
from tenancy.services.tree import create_scope


def own_entry(name, owner, **fields):
    made = ModelEntry.objects.create(name=name, task="completion", source_kind="local", format="gguf", owner=owner,
                                     **fields)
    events.routing_changed()
    return made


@pytest.fixture
def neighbour(tree):
    """Another organisation, with a project of its own."""
    org = create_scope(tree.actor, "org", tree.org.slug + "-next", "Next door")
    team = create_scope(tree.actor, "team", "apps", "Apps", org)
    return create_scope(tree.actor, "project", "app", "App", team)


@pytest.mark.django_db(transaction=True)
def test_the_routing_table_says_whose_model_it_is(tree, deploy, neighbour):
    own_entry("owned-model", tree.team, scaling_min=0)
    row = deploy("hand-made", state="stopped").deployment
    row.owner = neighbour
    row.save(update_fields=["owner"])
    deploy("shared-hand-made", state="stopped")
    table = load_table()
    owned, hand, shared = (table.route(n) for n in ("owned-model", "hand-made", "shared-hand-made"))
    assert owned.owner == tree.team.path and owned.admits(tree.project.path) and owned.admits(tree.team.path)
    assert not owned.admits(neighbour.path) and not owned.admits(tree.org.path)
    assert not owned.admits(tree.team.path + "x/search")  # a team whose name merely begins the same
    assert hand.owner == neighbour.path and not hand.admits(tree.project.path)
    assert shared.owner is None and shared.admits(neighbour.path)


@pytest.mark.django_db(transaction=True)
def test_another_tenants_own_model_is_neither_listed_nor_callable(gateway, deploy, make_key, tiny_engine, tree,
                                                                  neighbour):
    deploy("team-tiny", tiny_engine)
    own_entry("team-tiny", tree.team, scaling_min=1)
    mine, theirs = make_key(), make_key(project=neighbour)  # both may call every model by their own rules
    # A request first: a name the gateway does not know yet makes it read the table again (the change
    # message may still be on its way), so the listing below sees the same table.
    answer = gateway.openai(mine.key).completions.create(model="team-tiny", prompt="hello", max_tokens=2)
    assert answer.usage.completion_tokens >= 1
    assert "team-tiny" in {m.id for m in gateway.openai(mine.key).models.list().data}

    assert "team-tiny" not in {m.id for m in gateway.openai(theirs.key).models.list().data}
    refused = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                         headers={"Authorization": f"Bearer {theirs.key}"},
                         json={"model": "team-tiny", "prompt": "hello", "max_tokens": 2})
    unknown = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                         headers={"Authorization": f"Bearer {theirs.key}"},
                         json={"model": "no-such-model", "prompt": "hello", "max_tokens": 2})
    assert refused.status_code == unknown.status_code == 404
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
    assert tree.team.path not in refused.text
