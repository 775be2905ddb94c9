from django.urls import path

from scheduler import views

app_name = "scheduler"
urlpatterns = [
    path("", views.FleetView.as_view(), name="index"),
    path("estimate/", views.EstimateView.as_view(), name="estimate"),
    path("enrol/", views.EnrolView.as_view(), name="enrol"),
    path("placement/", views.PlacementView.as_view(), name="placement"),
    path("placement/parked/<path:model>/retry/", views.RetryParkedView.as_view(), name="parked-retry"),
    path("nodes/<uuid:public_id>/", views.NodeDetailView.as_view(), name="node"),
    # Before the actions' pattern, which would take "labels" or "revoke" for a verb.
    path("nodes/<uuid:public_id>/labels/", views.NodeLabelsView.as_view(), name="node-labels"),
    path("nodes/<uuid:public_id>/revoke/", views.NodeRevokeView.as_view(), name="node-revoke"),
    path("nodes/<uuid:public_id>/<slug:verb>/", views.NodeActionView.as_view(), name="node-action"),
]
