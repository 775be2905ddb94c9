from django.contrib import admin

from scheduler.models import Accelerator, CalibrationRecord, MemoryReservation, Node, NodeEngine, RecoveryState


class NodeEngineInline(admin.TabularInline):
    model = NodeEngine
    extra = 0


class AcceleratorInline(admin.TabularInline):
    model = Accelerator
    fk_name = "node"
    extra = 0
    fields = ("index", "mig_index", "accelerator_class", "memory_total_bytes", "healthy", "placeable", "unplaceable_reason")
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "address", "cpu_count", "agent_version", "last_heartbeat_at")
    list_filter = ("state",)
    search_fields = ("name", "address")
    inlines = [NodeEngineInline, AcceleratorInline]


@admin.register(MemoryReservation)
class MemoryReservationAdmin(admin.ModelAdmin):
    list_display = ("holder", "node", "accelerator", "bytes", "created_at")
    search_fields = ("holder",)


@admin.register(CalibrationRecord)
class CalibrationRecordAdmin(admin.ModelAdmin):
    list_display = ("model_name", "engine", "engine_version", "device", "outcome", "estimated_bytes", "measured_bytes",
                    "created_at")
    list_filter = ("engine", "outcome")
    search_fields = ("model_name", "model_key")


@admin.register(RecoveryState)
class RecoveryStateAdmin(admin.ModelAdmin):
    """Read-only: retry a parked model from the placement page or the API (it is audited there)."""

    list_display = ("model", "kind", "consecutive", "level", "parked", "parked_at", "last_failure_at", "retried_by")
    list_filter = ("parked", "kind")
    search_fields = ("model",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
