from django.contrib import admin

from scheduler.models import Node, NodeEngine


class NodeEngineInline(admin.TabularInline):
    model = NodeEngine
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "address", "cpu_count", "agent_version", "last_heartbeat_at")
    list_filter = ("state",)
    search_fields = ("name", "address")
    inlines = [NodeEngineInline]
