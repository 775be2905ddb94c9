from rest_framework import serializers

from gateway.models import UsageRecord


class UsageRecordSerializer(serializers.ModelSerializer):
    client = serializers.SerializerMethodField()

    class Meta:
        model = UsageRecord
        fields = ["request_id", "started_at", "finished_at", "endpoint", "stream", "model_asked", "model_served",
                  "replica_id", "status", "error_code", "queue_ms", "ttft_ms", "total_ms", "prompt_tokens",
                  "completion_tokens", "cost", "key_prefix", "client", "scope_path"]

    def get_client(self, record) -> str | None:
        return str(record.client.public_id) if record.client_id and record.client else None
