from rest_framework import serializers

from gateway.batch.service import eta_seconds
from gateway.models import Batch, UsageRecord


class UsageRecordSerializer(serializers.ModelSerializer):
    client = serializers.SerializerMethodField()

    class Meta:
        model = UsageRecord
        fields = ["request_id", "started_at", "finished_at", "endpoint", "stream", "model_asked", "model_served",
                  "replica_id", "status", "error_code", "queue_ms", "ttft_ms", "total_ms", "prompt_tokens",
                  "completion_tokens", "cost", "key_prefix", "client", "scope_path"]

    def get_client(self, record) -> str | None:
        return str(record.client.public_id) if record.client_id and record.client else None


class ModelSplitSerializer(serializers.Serializer):
    """A canary/experiment split: ``model_name`` → ``variants`` by weight, sticky per client."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    model_name = serializers.CharField(max_length=200)
    scope = serializers.CharField(allow_null=True, required=False, default=None,
                                  help_text="The scope path whose clients the split applies to; null: every client "
                                            "(staff only).")
    variants = serializers.ListField(child=serializers.DictField(), required=False, default=list,
                                     help_text='[{"model": "name", "weight": 90}, …]')
    environments = serializers.ListField(child=serializers.ChoiceField(["production", "staging", "development"]),
                                         required=False, default=list,
                                         help_text="Client environments allowed to call model_name; empty: any.")
    enabled = serializers.BooleanField(required=False, default=True)
    note = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)

    def to_representation(self, split):
        data = super().to_representation(split)
        data["scope"] = split.scope.path if split.scope_id else None
        return data


class BatchCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class BatchSerializer(serializers.Serializer):
    """A batch of the Batch API as its project's people see it: OpenAI's fields (times as ISO 8601
    here, as everywhere in this API) with whose it is, and its progress."""

    id = serializers.CharField(source="public_id", read_only=True)
    endpoint = serializers.CharField(read_only=True)
    status = serializers.ChoiceField(choices=Batch.Status.choices, read_only=True)
    completion_window = serializers.CharField(read_only=True)
    client = serializers.UUIDField(source="client.public_id", read_only=True)
    client_name = serializers.CharField(source="client.name", read_only=True)
    scope_path = serializers.CharField(read_only=True)
    key_prefix = serializers.CharField(source="credential.prefix", read_only=True)
    input_file_id = serializers.CharField(source="input_file.public_id", read_only=True, allow_null=True)
    output_file_id = serializers.CharField(source="output_file.public_id", read_only=True, allow_null=True)
    error_file_id = serializers.CharField(source="error_file.public_id", read_only=True, allow_null=True)
    request_counts = BatchCountsSerializer(source="*", read_only=True)
    eta_seconds = serializers.SerializerMethodField(
        help_text="Seconds until it ends at the pace it has gone so far; null until a line has ended, or "
                  "once it is not in progress.")
    metadata = serializers.DictField(child=serializers.CharField(), read_only=True)
    errors = serializers.JSONField(read_only=True, allow_null=True)
    created_at = serializers.DateTimeField(read_only=True)
    expires_at = serializers.DateTimeField(read_only=True)
    in_progress_at = serializers.DateTimeField(read_only=True, allow_null=True)
    finalizing_at = serializers.DateTimeField(read_only=True, allow_null=True)
    completed_at = serializers.DateTimeField(read_only=True, allow_null=True)
    failed_at = serializers.DateTimeField(read_only=True, allow_null=True)
    expired_at = serializers.DateTimeField(read_only=True, allow_null=True)
    cancelling_at = serializers.DateTimeField(read_only=True, allow_null=True)
    cancelled_at = serializers.DateTimeField(read_only=True, allow_null=True)

    def get_eta_seconds(self, batch) -> int | None:
        return eta_seconds(batch)
