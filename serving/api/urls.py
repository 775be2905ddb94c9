from django.urls import path
from rest_framework.routers import SimpleRouter

from serving.api import catalog as catalog_api, deployments as views, status as status_api, transfer

app_name = "serving-api"
router = SimpleRouter()
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("catalog/models", catalog_api.CatalogModelViewSet, basename="catalog-model")
router.register("catalog/files", catalog_api.ModelFileViewSet, basename="catalog-file")
router.register("catalog/fetches", catalog_api.FetchJobViewSet, basename="catalog-fetch")
router.register("hub", catalog_api.HubViewSet, basename="hub")
urlpatterns = router.urls + [
    path("serve/", catalog_api.ServeViewSet.as_view({"post": "create"}), name="serve"),
    path("status/", status_api.StatusView.as_view(), name="status"),
    # A node fetching the mirror's weights it lacks, with its signed link (serving.catalog.transfer).
    path("mirror/files/<uuid:public_id>/content/", transfer.WeightsContentView.as_view(), name="weights-content"),
]
