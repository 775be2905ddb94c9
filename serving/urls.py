from django.urls import path

from serving.views import catalog as catalog_views, deployments as views, node_jobs as node_job_views

app_name = "serving"
urlpatterns = [
    path("", views.DeploymentsView.as_view(), name="index"),
    path("deploy/", views.DeployView.as_view(), name="deploy"),
    path("deploy/preview/", views.PreviewView.as_view(), name="preview"),
    path("deployments/<uuid:public_id>/", views.DeploymentView.as_view(), name="deployment"),
    path("deployments/<uuid:public_id>/stream/", views.deployment_stream, name="deployment-stream"),
    path("deployments/<uuid:public_id>/reconfigure/", views.ReconfigureView.as_view(), name="reconfigure"),
    path("deployments/<uuid:public_id>/<str:verb>/", views.DeploymentActionView.as_view(), name="deployment-action"),
    # The mirror: Held, Explore and Fetch, and a held model's card.
    path("held/", catalog_views.HeldView.as_view(), name="catalog-held"),
    path("held/<uuid:public_id>/", catalog_views.ModelCardView.as_view(), name="catalog-card"),
    path("held/<uuid:public_id>/restart/", catalog_views.ModelRestartView.as_view(), name="catalog-restart"),
    path("explore/", catalog_views.ExploreView.as_view(), name="catalog-explore"),
    path("fetch/", catalog_views.FetchView.as_view(), name="catalog-fetch"),
    path("serve/", catalog_views.ServeView.as_view(), name="catalog-serve"),
    path("jobs/<uuid:public_id>/", catalog_views.JobView.as_view(), name="catalog-job"),
    # A node's recent jobs: a fragment the fleet's node page loads (staff only).
    path("nodes/<uuid:public_id>/jobs/", node_job_views.NodeJobsView.as_view(), name="node-jobs"),
]
