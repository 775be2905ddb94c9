from django.urls import path
from rest_framework.routers import SimpleRouter

from scheduler.api import views

app_name = "scheduler-api"
router = SimpleRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("accelerators", views.AcceleratorViewSet, basename="accelerator")
router.register("calibrations", views.CalibrationRecordViewSet, basename="calibration")
urlpatterns = [path("estimate/", views.EstimateView.as_view(), name="estimate"), *router.urls]
