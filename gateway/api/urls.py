"""Management API routes of the gateway app (mounted under /api/gateway/)."""

from rest_framework.routers import SimpleRouter

from gateway.api.views import BatchViewSet, ModelSplitViewSet, UsageRecordViewSet

router = SimpleRouter()
router.register("usage", UsageRecordViewSet, basename="gateway-usage")
router.register("splits", ModelSplitViewSet, basename="gateway-splits")
router.register("batches", BatchViewSet, basename="gateway-batches")
urlpatterns = router.urls
