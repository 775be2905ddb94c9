"""A world with one of every tenant object, all of acme's, for the walks that call every route as every
persona (``tests/test_persona_walk.py``, the console's walk and the schema fuzzing).

Every acme object's name carries the marker ``zacme``: an outsider's answer that contains it, or one of
the objects' ids, has leaked. Fleet-wide objects (a node, its accelerator, a calibration record) carry
no marker, but the node holds acme's weights file, whose path does.
"""

from __future__ import annotations

import types
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone

MARKER = "zacme"
SECRET_DIR = f"/models/{MARKER}-private"


def build_world(personas) -> types.SimpleNamespace:
    from gateway.batch.files import new_id
    from gateway.models import Batch, ModelSplit, UsageRecord
    from scheduler.models import (Accelerator, CalibrationRecord, HeldWeight, ModelDirectory, PlacementDecision,
                                  RecoveryState)
    from scheduler.services import NodeReport, register_node
    from serving.models import FetchJob, ModelEntry, ModelFile
    from serving.models import Deployment, DeploymentEvent
    from tenancy.models import AuditEvent, Membership
    from tenancy.services import approvals, clients, contracts, tree

    olivia, oscar = personas.olivia_actor, personas.oscar_actor
    acme = personas.acme
    sibling = tree.create_scope(olivia, "project", "other", "Other", acme.team)
    admin = get_user_model().objects.create_user("adam", "adam@example.org", personas.password)
    Membership.objects.create(user=admin, scope=acme.org, role="admin")  # a second pair of eyes

    def management_key(actor, project, name):
        client = clients.create_client(actor, project, name, access="management")
        return clients.create_credential(actor, client, name="walk")[1]

    globex_key = management_key(oscar, personas.globex.project, "globex-robot")
    sibling_key = management_key(olivia, sibling, "sibling-robot")

    client = clients.create_client(olivia, acme.project, f"{MARKER}-indexer", description=f"{MARKER} indexer",
                                   all_models=True)
    credential, _ = clients.create_credential(olivia, client, name=f"{MARKER}-ci")
    contract = contracts.set_contract(olivia, acme.project, gpus_limit=4, rpm_limit=100)
    evidence = contracts.raise_limit_evidence(acme.project, gpus_limit=8)
    approval = approvals.request_approval(olivia, "contract.raise_limit", acme.project, acme.project, evidence,
                                          f"{MARKER}: more GPUs")
    membership = Membership.objects.get(user=personas.vera, scope=acme.project)
    audit_event = AuditEvent.objects.filter(scope_path=acme.project.path).order_by("-id").first()

    node = register_node(NodeReport(name="walk-node", address="127.0.0.1"))
    accelerator = Accelerator.objects.create(node=node, index=0, uuid="GPU-walk-0", name="NVIDIA H100 80GB HBM3",
                                             accelerator_class="H100-80GB", memory_total_bytes=80 * 2**30)
    directory = ModelDirectory.objects.create(node=node, path=SECRET_DIR)
    weights_path = f"{SECRET_DIR}/{MARKER}-weights.gguf"
    HeldWeight.objects.create(directory=directory, path=weights_path, size_bytes=1024, format="gguf")

    model = ModelEntry.objects.create(name=f"{MARKER}-model", owner=acme.project, source_kind="local",
                                      source_path=weights_path, format="gguf", task="chat",
                                      profiles=[{"name": "cpu", "engine": "llamacpp", "file": f"{MARKER}-weights.gguf",
                                                 "context": 512}])
    ModelFile.objects.create(model=model, repo_path=f"{MARKER}-weights.gguf", path=weights_path, size=1024)
    fetch = FetchJob.objects.create(repo=f"{MARKER}/private-repo", owner=acme.project, status="failed",
                                    error=f"{MARKER} failed")
    deployment = Deployment.objects.create(name=f"{MARKER}-model", model_path=weights_path, node=node,
                                           owner=acme.project, state="stopped", created_by=personas.olivia,
                                           memory_reserved_bytes=2**20)
    DeploymentEvent.objects.create(deployment=deployment, from_state="planned", to_state="stopped",
                                   message=f"{MARKER} stopped")
    split = ModelSplit.objects.create(model_name=f"{MARKER}-split", scope=acme.project,
                                      variants=[{"model": f"{MARKER}-model", "weight": 1}])
    now = timezone.now()
    usage = UsageRecord.objects.create(
        request_id=f"{MARKER}-request-1", started_at=now - timedelta(seconds=2), finished_at=now,
        endpoint="chat/completions", model_asked=f"{MARKER}-model", model_served=f"{MARKER}-model", status=200,
        total_ms=12.0, prompt_tokens=3, completion_tokens=4, credential=credential, key_prefix=credential.prefix,
        client=client, project=acme.project, scope_path=acme.project.path)
    batch = Batch.objects.create(  # running: a third of its lines ended
        public_id=new_id("batch_"), endpoint="/v1/chat/completions", completion_window="24h",
        status=Batch.Status.IN_PROGRESS, metadata={"job": f"{MARKER}-nightly"}, credential=credential, client=client,
        scope_path=acme.project.path, total=9, completed=2, failed=1, expires_at=now + timedelta(hours=24),
        in_progress_at=now - timedelta(minutes=1))
    decision = PlacementDecision.objects.create(model=f"{MARKER}-model", owner=acme.project,
                                                verdict="unschedulable", reason_codes=["no_fit"],
                                                detail=f"{MARKER} does not fit", inputs_digest="0" * 32,
                                                fingerprint="0" * 32)
    RecoveryState.objects.create(model=f"{MARKER}-model", kind="crash", consecutive=5, parked=True,
                                 parked_at=now, last_error=f"{MARKER} crashed")
    calibration = CalibrationRecord.objects.create(
        model_key=weights_path, model_name=f"{MARKER}-model", engine="llamacpp", engine_version="b1", device="cpu",
        config={}, config_key="{}", estimated_bytes=2**20, measured_bytes=2**20, outcome="loaded")

    objects = types.SimpleNamespace(
        scope=acme.project, membership=membership, client=client, credential=credential,
        contract=contract, approval=approval, audit_event=audit_event, model=model, fetch=fetch,
        deployment=deployment, split=split, usage=usage, batch=batch, decision=decision)
    secrets = {MARKER, acme.project.path, weights_path,
               *(str(obj.public_id) for obj in vars(objects).values() if getattr(obj, "public_id", None))}
    return types.SimpleNamespace(
        personas=personas, sibling=sibling, team=acme.team, admin=admin, globex_key=globex_key, sibling_key=sibling_key, node=node,
        accelerator=accelerator, calibration=calibration, weights_path=weights_path, secrets=secrets, **vars(objects))


def leaked(world, text: str, *, outsider_of_acme: bool) -> list[str]:
    """The secrets of acme/ml/search that ``text`` contains (and "acme" itself, for another organisation)."""
    found = sorted(secret for secret in world.secrets if secret and secret in text)
    if outsider_of_acme and "acme" in text:
        found.append("acme")
    return found
