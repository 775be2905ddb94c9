"""Management API routes of the tenancy app, mounted under /api/tenancy/."""

from rest_framework.routers import SimpleRouter

from tenancy.api import views

app_name = "tenancy-api"
router = SimpleRouter()
router.register("scopes", views.ScopeViewSet, basename="scope")
router.register("memberships", views.MembershipViewSet, basename="membership")
router.register("clients", views.ServiceClientViewSet, basename="client")
router.register("credentials", views.CredentialViewSet, basename="credential")
router.register("contracts", views.ContractViewSet, basename="contract")
router.register("approvals", views.ApprovalRequestViewSet, basename="approval")
router.register("audit", views.AuditEventViewSet, basename="audit-event")
urlpatterns = router.urls
