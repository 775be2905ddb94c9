from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from berth import health, views
from berth.api_root import ApiRootView
from tenancy.login import LoginView

api_patterns = [
    path("", ApiRootView.as_view(), name="api-root"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("gateway/", include("gateway.api.urls")),
    path("scheduler/", include("scheduler.api.urls")),
    path("tenancy/", include("tenancy.api.urls")),
    path("serving/", include("serving.api.urls")),
    path("node/", include("scheduler.api.node_urls")),
    path("node/", include("serving.api.node_urls")),
]

urlpatterns = [
    path("", views.DashboardView.as_view(), name="dashboard"),
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("v1/", include("gateway.batch.urls")),  # the Batch API: Django's (berth.asgi routes these here)
    path("api/", include(api_patterns)),
    path("gateway/", include("gateway.urls")),
    path("models/", include("serving.urls")),
    path("fleet/", include("scheduler.urls")),
    path("organisations/", include("tenancy.urls")),
    path("admin/", admin.site.urls),
]

handler404 = "berth.views.not_found"
handler500 = "berth.views.server_error"
