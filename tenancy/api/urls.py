"""Management API routes of the tenancy app (mounted under /api/tenancy/ once it has any)."""

urlpatterns: list = []
