"""Management API routes of the gateway app (mounted under /api/gateway/)."""

from rest_framework.routers import SimpleRouter

from gateway.api.views import UsageRecordViewSet

router = SimpleRouter()
router.register("usage", UsageRecordViewSet, basename="gateway-usage")
urlpatterns = router.urls
