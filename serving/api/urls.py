"""Management API routes of the serving app (mounted under /api/serving/ once it has any)."""

urlpatterns: list = []
