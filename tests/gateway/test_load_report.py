"""The gateway tells the placement loop what it has in flight per replica while a request runs,
and takes it back when the request ends (a real gateway process, a real llama-server)."""

import pytest

from serving import load
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def test_a_request_in_flight_is_reported_for_its_replica_until_it_ends(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    client = gateway.openai(make_key().key)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
        max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the engine is answering: the request is in flight
    wait_until(lambda: load.current().in_flight.get(chat_engine.replica_id) == 1, 15,
               what="the request reported in flight for its replica")
    stream.close()  # the client goes away: the gateway closes the engine's request too
    wait_until(lambda: chat_engine.replica_id not in load.current().in_flight, 15,
               what="the replica reported idle again")
