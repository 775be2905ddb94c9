from django.urls import path

from serving import views

app_name = "serving"
urlpatterns = [
    path("", views.DeploymentsView.as_view(), name="index"),
    path("deploy/", views.DeployView.as_view(), name="deploy"),
    path("deploy/preview/", views.PreviewView.as_view(), name="preview"),
    path("deployments/<uuid:public_id>/", views.DeploymentView.as_view(), name="deployment"),
    path("deployments/<uuid:public_id>/<str:verb>/", views.DeploymentActionView.as_view(), name="deployment-action"),
]
