from rest_framework.routers import SimpleRouter

from scheduler.api import views

app_name = "scheduler-api"
router = SimpleRouter()
router.register("nodes", views.NodeViewSet, basename="node")
urlpatterns = router.urls
