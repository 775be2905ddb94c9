"""Management API routes of the gateway app (mounted under /api/gateway/ once it has any)."""

urlpatterns: list = []
