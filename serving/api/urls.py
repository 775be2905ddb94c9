from rest_framework.routers import SimpleRouter

from serving.api import views

app_name = "serving-api"
router = SimpleRouter()
router.register("deployments", views.DeploymentViewSet, basename="deployment")
urlpatterns = router.urls
