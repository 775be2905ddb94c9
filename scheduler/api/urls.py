from django.urls import path
from rest_framework.routers import SimpleRouter

from scheduler.api import views

app_name = "scheduler-api"
router = SimpleRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("accelerators", views.AcceleratorViewSet, basename="accelerator")
router.register("calibrations", views.CalibrationRecordViewSet, basename="calibration")
router.register("decisions", views.PlacementDecisionViewSet, basename="decision")
router.register("enrolment-tokens", views.EnrolmentTokenViewSet, basename="enrolment-token")
urlpatterns = [
    path("estimate/", views.EstimateView.as_view(), name="estimate"),
    path("placement/explain/", views.ExplainPlacementView.as_view(), name="explain"),
    path("placement/headroom/", views.HeadroomView.as_view(), name="headroom"),
    path("placement/parked/", views.ParkedUnplaceableView.as_view(), name="parked"),
    # Catalog names may hold a slash (org/model): the path converter keeps it.
    path("placement/parked/<path:model>/retry/", views.RetryParkedView.as_view(), name="parked-retry"),
    *router.urls,
]
