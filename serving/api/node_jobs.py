"""The node API's leased jobs (``/api/node/jobs/``): a node's agent claims its work, extends the lease
while it works, reports, and completes or fails it (``serving.control.node_jobs``). Only a node's own
credential is taken here (``NodeAuthentication``), and a node reaches only its own jobs."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler.api.node_auth import IsNode, NodeAuthentication
from serving.control import node_jobs

MAX_WAIT_SECONDS = 30  # a long poll holds a server thread: the agent asks again after this at most

REFUSED = {401: OpenApiResponse(description="node_credential_invalid or node_revoked"),
           403: OpenApiResponse(description="node_ownership_mismatch: another node's job (audited)"),
           404: OpenApiResponse(description="node_job_not_found"),
           409: OpenApiResponse(description="node_lease_stale: not the job's current lease; nothing changed")}


class ClaimRequestSerializer(serializers.Serializer):
    wait = serializers.FloatField(default=0, min_value=0, max_value=MAX_WAIT_SECONDS,
                                  help_text="Seconds to wait for a job when none is queued (a long poll).")
    agent = serializers.CharField(default="", allow_blank=True, max_length=64,
                                  help_text="The agent's instance (new at each start), as its first heartbeat said.")


class ClaimedJobSerializer(serializers.Serializer):
    id = serializers.UUIDField(source="public_id")
    kind = serializers.CharField()
    replica = serializers.UUIDField(source="replica.public_id", allow_null=True, default=None)
    payload = serializers.JSONField()
    lease = serializers.CharField(help_text="Present it with every call on this job; only its hash is kept.")
    lease_expires_at = serializers.DateTimeField()
    attempt = serializers.IntegerField(source="attempts")


class ClaimSerializer(serializers.Serializer):
    job = ClaimedJobSerializer()


class LeaseSerializer(serializers.Serializer):
    lease = serializers.CharField(max_length=200)


class LeaseAnswerSerializer(serializers.Serializer):
    lease_expires_at = serializers.DateTimeField()
    cancel_requested = serializers.BooleanField(help_text="Stop the work, then complete or fail the job.")


class ReportSerializer(LeaseSerializer):
    event = serializers.CharField(max_length=64)
    data = serializers.DictField(default=dict)


class CompleteSerializer(LeaseSerializer):
    result = serializers.DictField(default=dict)


class FailSerializer(LeaseSerializer):
    error = serializers.CharField(max_length=10_000)
    details = serializers.DictField(default=dict)
    retry = serializers.BooleanField(default=False, help_text="Queue it again while attempts are left.")


class NodeView(APIView):
    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]

    def body(self, serializer_class) -> dict:
        body = serializer_class(data=self.request.data)
        body.is_valid(raise_exception=True)
        return body.validated_data


class ClaimView(NodeView):
    """The node's most urgent job, leased to it; waits up to ``wait`` seconds for one (204: none)."""

    @extend_schema(request=ClaimRequestSerializer, responses={200: ClaimSerializer, 204: None, 401: REFUSED[401]})
    def post(self, request):
        body = self.body(ClaimRequestSerializer)
        claimed = node_jobs.claim(request.auth, wait_seconds=body["wait"], agent=body["agent"])
        if claimed is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        job, lease = claimed
        job.lease = lease
        return Response(ClaimSerializer({"job": job}).data)


class LeaseView(NodeView):
    """Extend the job's lease (the heartbeat of the work); says whether its cancellation was asked for."""

    @extend_schema(request=LeaseSerializer, responses={200: LeaseAnswerSerializer, **REFUSED})
    def post(self, request, public_id):
        job = node_jobs.extend(request.auth, public_id, self.body(LeaseSerializer)["lease"])
        return Response(LeaseAnswerSerializer(job).data)


class ReportView(NodeView):
    """What the node sees while it works; the answer is the job kind's (e.g. whether to go on)."""

    @extend_schema(request=ReportSerializer, responses={200: dict, 400: OpenApiResponse(
        description="unknown_node_report"), **REFUSED})
    def post(self, request, public_id):
        data = self.body(ReportSerializer)
        return Response(node_jobs.report(request.auth, public_id, data["lease"], data["event"], data["data"]))


class CompleteView(NodeView):
    """The job is done, with its result."""

    @extend_schema(request=CompleteSerializer, responses={200: dict, **REFUSED})
    def post(self, request, public_id):
        data = self.body(CompleteSerializer)
        return Response(node_jobs.complete(request.auth, public_id, data["lease"], data["result"]))


class FailView(NodeView):
    """The job failed, with the evidence; ``retry`` queues it again while attempts are left."""

    @extend_schema(request=FailSerializer, responses={200: dict, **REFUSED})
    def post(self, request, public_id):
        data = self.body(FailSerializer)
        return Response(node_jobs.fail(request.auth, public_id, data["lease"], data["error"], data["details"],
                                       retry=data["retry"]))
