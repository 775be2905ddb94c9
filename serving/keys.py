"""Per-replica engine keys: derived from the cluster secret and the replica id, never stored.

The gateway derives the same key when it forwards a request, so only it can call an engine; a
leaked key opens one replica, and dies with it.
"""

from django.utils.crypto import salted_hmac


def replica_key(replica_id: str) -> str:
    return "bre_" + salted_hmac("berth.serving.replica-key", str(replica_id), algorithm="sha256").hexdigest()
