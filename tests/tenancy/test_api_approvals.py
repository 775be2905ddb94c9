"""Four-eyes approvals through the management API: ask with the evidence of an approval_required
answer, decide (never one's own), carry out once, refuse when stale or expired."""

from datetime import timedelta

import pytest
from django.utils import timezone

from tenancy.models import ApprovalRequest, AuditEvent, Contract
from tenancy.services import clients, contracts

pytestmark = pytest.mark.django_db

APPROVALS = "/api/tenancy/approvals/"
CONTRACTS = "/api/tenancy/contracts/"
KEYS = "/api/tenancy/credentials/"


def error_code(response) -> str:
    return response.json()["error"]["code"]


@pytest.fixture
def limited(personas):
    """acme is limited to 160 GiB of GPU memory: raising that needs an approval."""
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_limit=160)
    return f"{CONTRACTS}{personas.acme.org.public_id}/"


def ask_from_refusal(api, user, refusal, **extra):
    """File an approval request exactly from a 428 approval_required answer."""
    details = refusal.json()["error"]["details"]
    body = {"action": details["action"], "scope": details["scope"], "evidence": details["evidence"],
            "fingerprint": details["fingerprint"], "reason": "The new cluster arrived."} | extra
    response = api(user).post(APPROVALS, body)
    assert response.status_code == 201, response.content
    return response.json()


def test_raising_a_limit_is_asked_approved_by_another_and_carried_out_once(personas, api, ada, limited):
    olivia = api(personas.olivia)
    refusal = olivia.patch(limited, {"gpu_memory_gib_limit": 200})
    assert (refusal.status_code, error_code(refusal)) == (428, "approval_required")
    assert refusal.json()["error"]["details"]["evidence"]["proposed"]["gpu_memory_gib_limit"] == "200"
    asked = ask_from_refusal(api, personas.olivia, refusal)
    assert asked["status"] == "pending" and asked["fingerprint"] == refusal.json()["error"]["details"]["fingerprint"]
    assert asked["requested_by"] == "olivia" and asked["scope_written"] == "org:acme"

    own = olivia.post(f"{APPROVALS}{asked['id']}/approve/", {"reason": "fine by me"})
    assert (own.status_code, error_code(own)) == (403, "four_eyes")
    approved = api(ada).post(f"{APPROVALS}{asked['id']}/approve/", {"reason": "budgeted"})
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert approved.json()["decided_by"] == "ada"

    done = olivia.patch(limited, {"gpu_memory_gib_limit": 200, "approval": asked["id"]})
    assert done.status_code == 200, done.content
    assert done.json()["gpu_memory_gib_limit"] == "200.00"
    assert ApprovalRequest.objects.get(public_id=asked["id"]).status == "used"
    again = olivia.patch(limited, {"gpu_memory_gib_limit": 240, "approval": asked["id"]})
    assert (again.status_code, error_code(again)) == (409, "approval_invalid")


def test_approval_of_a_contract_that_changed_since_is_stale(personas, api, ada, limited):
    olivia = api(personas.olivia)
    asked = ask_from_refusal(api, personas.olivia, olivia.patch(limited, {"gpu_memory_gib_limit": 200}))
    api(ada).post(f"{APPROVALS}{asked['id']}/approve/", {})
    assert olivia.patch(limited, {"cores_limit": 64}).status_code == 200  # the world moves on
    stale = olivia.patch(limited, {"gpu_memory_gib_limit": 200, "approval": asked["id"]})
    assert (stale.status_code, error_code(stale)) == (409, "approval_stale")
    assert Contract.objects.get(scope=personas.acme.org).gpu_memory_gib_limit == 160


def test_asking_with_a_fingerprint_the_state_no_longer_matches_is_refused(personas, api, limited):
    olivia = api(personas.olivia)
    refusal = olivia.patch(limited, {"gpu_memory_gib_limit": 200})
    olivia.patch(limited, {"gpus_limit": 8})
    details = refusal.json()["error"]["details"]
    response = olivia.post(APPROVALS, {"action": details["action"], "scope": details["scope"],
                                       "evidence": details["evidence"], "fingerprint": details["fingerprint"],
                                       "reason": "more"})
    assert (response.status_code, error_code(response)) == (409, "approval_stale")
    assert not ApprovalRequest.objects.exists()


def test_evidence_is_rebuilt_from_the_state_not_taken_from_the_caller(personas, api, limited):
    forged = {"scope": "org:acme", "current": {"gpu_memory_gib_limit": "9999"},
              "proposed": {"gpu_memory_gib_limit": "200"}}
    asked = api(personas.olivia).post(APPROVALS, {"action": "contract.raise_limit", "scope": "org:acme",
                                                  "evidence": forged, "reason": "more"}).json()
    assert asked["evidence"]["current"]["gpu_memory_gib_limit"] == "160"
    assert asked["evidence"]["proposed"]["gpu_memory_gib_limit"] == "200"


def test_a_change_that_raises_no_limit_needs_no_approval(personas, api, limited):
    response = api(personas.olivia).post(APPROVALS, {"action": "contract.raise_limit", "scope": "org:acme",
                                                     "proposed": {"gpu_memory_gib_limit": 100}, "reason": "less"})
    assert (response.status_code, error_code(response)) == (400, "invalid_contract")
    unknown = api(personas.olivia).post(APPROVALS, {"action": "scope.delete", "scope": "org:acme", "reason": "x"})
    assert (unknown.status_code, error_code(unknown)) == (400, "invalid")


def test_production_key_needs_an_approval_from_someone_else(personas, api):
    client = clients.create_client(personas.max_actor, personas.acme.project, "prod-bot", environment="production",
                                   access="inference")
    maxi = api(personas.max)
    refusal = maxi.post(KEYS, {"client": str(client.public_id), "name": "prod"})
    assert (refusal.status_code, error_code(refusal)) == (428, "approval_required")
    assert refusal.json()["error"]["details"]["evidence"]["client"] == str(client.public_id)
    asked = maxi.post(APPROVALS, {"action": "credential.create_production", "subject": str(client.public_id),
                                  "reason": "launch"})
    assert asked.status_code == 201, asked.content
    assert asked.json()["fingerprint"] == refusal.json()["error"]["details"]["fingerprint"]
    approval_id = asked.json()["id"]
    # A member may ask, not decide; the viewer neither.
    assert error_code(maxi.post(f"{APPROVALS}{approval_id}/approve/", {})) == "permission_denied"
    assert api(personas.vera).post(f"{APPROVALS}{approval_id}/approve/", {}).status_code == 403
    assert api(personas.olivia).post(f"{APPROVALS}{approval_id}/approve/", {}).status_code == 200
    created = maxi.post(KEYS, {"client": str(client.public_id), "name": "prod", "approval": approval_id})
    assert created.status_code == 201, created.content
    assert created.json()["key"].startswith("brk_")
    reused = maxi.post(KEYS, {"client": str(client.public_id), "name": "prod-2", "approval": approval_id})
    assert (reused.status_code, error_code(reused)) == (409, "approval_invalid")


def test_production_key_approval_goes_stale_when_the_client_changes(personas, api):
    client = clients.create_client(personas.max_actor, personas.acme.project, "prod-bot", environment="production")
    asked = api(personas.max).post(APPROVALS, {"action": "credential.create_production",
                                               "subject": str(client.public_id), "reason": "launch"}).json()
    api(personas.olivia).post(f"{APPROVALS}{asked['id']}/approve/", {})
    api(personas.max).patch(f"/api/tenancy/clients/{client.public_id}/", {"all_models": True})
    stale = api(personas.max).post(KEYS, {"client": str(client.public_id), "approval": asked["id"]})
    assert (stale.status_code, error_code(stale)) == (409, "approval_stale")


def test_rejection_needs_a_reason_and_a_rejected_approval_cannot_be_used(personas, api, ada, limited):
    olivia = api(personas.olivia)
    asked = ask_from_refusal(api, personas.olivia, olivia.patch(limited, {"gpu_memory_gib_limit": 200}))
    no_reason = api(ada).post(f"{APPROVALS}{asked['id']}/reject/", {})
    assert no_reason.status_code == 400
    rejected = api(ada).post(f"{APPROVALS}{asked['id']}/reject/", {"reason": "not this quarter"})
    assert rejected.json()["status"] == "rejected" and rejected.json()["decision_reason"] == "not this quarter"
    used = olivia.patch(limited, {"gpu_memory_gib_limit": 200, "approval": asked["id"]})
    assert (used.status_code, error_code(used)) == (409, "approval_invalid")
    twice = api(ada).post(f"{APPROVALS}{asked['id']}/approve/", {})
    assert (twice.status_code, error_code(twice)) == (409, "approval_invalid")


def test_an_expired_request_cannot_be_approved(personas, api, ada, limited):
    asked = ask_from_refusal(api, personas.olivia, api(personas.olivia).patch(limited, {"gpu_memory_gib_limit": 200}))
    ApprovalRequest.objects.filter(public_id=asked["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = api(ada).post(f"{APPROVALS}{asked['id']}/approve/", {})
    assert (response.status_code, error_code(response)) == (409, "approval_expired")


def test_viewer_cannot_ask_and_outsider_gets_404(personas, api, limited):
    vera = api(personas.vera).post(APPROVALS, {"action": "contract.raise_limit", "scope": "project:acme/ml/search",
                                               "proposed": {"gpus_limit": 1}, "reason": "x"})
    assert vera.status_code in (400, 403)  # nothing to raise there, or no right to ask: never created
    asked = ask_from_refusal(api, personas.olivia, api(personas.olivia).patch(limited, {"gpu_memory_gib_limit": 200}))
    oscar = api(personas.oscar)
    for response in (oscar.get(f"{APPROVALS}{asked['id']}/"),
                     oscar.post(f"{APPROVALS}{asked['id']}/approve/", {}),
                     oscar.post(f"{APPROVALS}{asked['id']}/reject/", {"reason": "mine now"})):
        assert response.status_code == 404
    spy = oscar.post(APPROVALS, {"action": "contract.raise_limit", "scope": "org:acme",
                                 "proposed": {"gpu_memory_gib_limit": 999}, "reason": "x"})
    assert spy.status_code == 404
    assert ApprovalRequest.objects.count() == 1


def test_viewer_may_not_ask_for_an_approval_on_her_project(personas, api):
    contracts.set_contract(personas.olivia_actor, personas.acme.project, gpus_limit=2)
    response = api(personas.vera).post(APPROVALS, {"action": "contract.raise_limit",
                                                   "scope": "project:acme/ml/search",
                                                   "proposed": {"gpus_limit": 4}, "reason": "more"})
    assert (response.status_code, error_code(response)) == (403, "permission_denied")


def test_service_clients_do_not_ask_for_approvals(personas, api, management_key, limited):
    robot = management_key()
    contracts.set_contract(personas.olivia_actor, personas.acme.project, gpus_limit=2)
    response = api().post(APPROVALS, {"action": "contract.raise_limit", "scope": "project:acme/ml/search",
                                      "proposed": {"gpus_limit": 4}, "reason": "more"}, format="json",
                          HTTP_AUTHORIZATION=f"Bearer {robot.key}")
    assert (response.status_code, error_code(response)) == (403, "four_eyes")


def test_inbox_boxes_show_mine_to_decide_and_decided(personas, api, ada, limited):
    olivia_asked = ask_from_refusal(api, personas.olivia,
                                    api(personas.olivia).patch(limited, {"gpu_memory_gib_limit": 200}))
    ada_asked = api(ada).post(APPROVALS, {"action": "contract.raise_limit", "scope": "org:acme",
                                          "proposed": {"gpu_memory_gib_limit": 300}, "reason": "even more"}).json()

    def box(user, name):
        return [row["id"] for row in api(user).get(APPROVALS, {"box": name}).json()["results"]]

    assert box(personas.olivia, "mine") == [olivia_asked["id"]]
    assert box(personas.olivia, "to_decide") == [ada_asked["id"]]
    assert box(ada, "to_decide") == [olivia_asked["id"]]
    assert box(personas.max, "to_decide") == []  # a member decides nothing
    api(ada).post(f"{APPROVALS}{olivia_asked['id']}/approve/", {})
    assert box(personas.olivia, "decided") == [olivia_asked["id"]]
    assert box(personas.olivia, "mine") == []
    assert api(personas.olivia).get(APPROVALS, {"box": "someone"}).status_code == 400


def test_each_approval_step_leaves_one_event(personas, api, ada, limited):
    refusal = api(personas.olivia).patch(limited, {"gpu_memory_gib_limit": 200})
    before = AuditEvent.objects.count()
    asked = ask_from_refusal(api, personas.olivia, refusal)
    api(ada).post(f"{APPROVALS}{asked['id']}/approve/", {})
    api(personas.olivia).patch(limited, {"gpu_memory_gib_limit": 200, "approval": asked["id"]})
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:])
    # Carrying out is two changes: the approval is spent, and the contract set.
    assert actions == ["approval.request", "approval.approve", "approval.use", "contract.set"]
