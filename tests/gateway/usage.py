"""Reading what the gateway wrote: usage records arrive in batches, so tests wait for them."""

from gateway.models import UsageRecord
from tests.assets.waiting import wait_until


def record_of(request_id):
    return wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first(), 20,
                      what=f"the usage record of {request_id}")
