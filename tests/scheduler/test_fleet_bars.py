"""The Fleet page's and a node page's memory bar for each GPU: what Berth reserves on that card (its
reservations summed in the page's one query), not another card's nor the node's own system memory."""

from __future__ import annotations

import pytest

from scheduler.models import Accelerator, MemoryReservation
from scheduler.services import NodeReport, register_node

pytestmark = pytest.mark.django_db

GIB = 1 << 30


def test_each_gpu_bar_says_what_is_reserved_on_that_card(client, admin_user):
    node = register_node(NodeReport(name="bar-node", address="127.0.0.1", memory_total_bytes=64 * GIB))
    first, second, idle = (Accelerator.objects.create(node=node, index=i, uuid=f"GPU-bar-{i}", accelerator_class="H100",
                                                      memory_total_bytes=80 * GIB) for i in range(3))
    for holder, card, size in (("a", first, 1), ("b", first, 2), ("c", second, 5), ("system", None, 7)):
        MemoryReservation.objects.create(node=node, accelerator=card, holder=holder, bytes=size * GIB)
    client.force_login(admin_user)
    for url in ("/fleet/", f"/fleet/nodes/{node.public_id}/"):
        page = client.get(url).content.decode()
        bars = [part.split("GiB reserved")[0].rsplit("·", 1)[-1].strip() for part in page.split('class="bar"')[1:]]
        assert bars == ["3.0", "5.0", "0.0"], (url, bars)
