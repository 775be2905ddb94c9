"""Who may read /metrics (it names every model and its traffic): this machine, or with
BERTH_METRICS_TOKEN set, only the bearer of that token. The real gateway process answers a
loopback scrape in tests/gateway/test_resilience.py; the rule itself is checked here on the
request as the ASGI server hands it over."""

import pytest

from gateway.app import Call, Gateway
from gateway.errors import MetricsNotAllowed


def scrape(peer, authorization=None):
    """The rule applied to a GET /metrics from ``peer`` (the ASGI scope's client)."""
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"method": "GET", "path": "/metrics", "headers": headers, "client": peer}
    Gateway._allow_metrics(Call(scope, None, None), scope)


@pytest.mark.parametrize("peer", [("127.0.0.1", 50000), ("::1", 50000)])
def test_this_machine_reads_the_metrics_without_a_token(peer, settings):
    settings.GATEWAY_METRICS_TOKEN = ""
    scrape(peer)


@pytest.mark.parametrize("peer", [("192.0.2.7", 50000), None, ("unix-socket", 0)])
def test_another_machine_or_an_unknown_peer_is_refused_without_a_token(peer, settings):
    settings.GATEWAY_METRICS_TOKEN = ""
    with pytest.raises(MetricsNotAllowed) as refused:
        scrape(peer)
    assert refused.value.status == 403 and refused.value.code == "metrics_not_allowed"
    assert "BERTH_METRICS_TOKEN" in refused.value.message


def test_with_a_token_only_its_bearer_reads_them_wherever_it_is(settings):
    settings.GATEWAY_METRICS_TOKEN = "scrape-secret-0123456789"
    scrape(("192.0.2.7", 50000), "Bearer scrape-secret-0123456789")
    for peer, sent in ((("192.0.2.7", 50000), "Bearer wrong"), (("127.0.0.1", 1), None),
                       (("127.0.0.1", 1), "Bearer scrape-secret-012345678")):
        with pytest.raises(MetricsNotAllowed):
            scrape(peer, sent)  # once a token is set, loopback needs it too
