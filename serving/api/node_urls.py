"""Serving's half of the node API (``/api/node/``): the heartbeat and the leased jobs. Enrolment and the node's own
identity are Scheduler's (``scheduler.api.node_urls``), under the same prefix."""

from django.urls import path

from serving.api import node_heartbeat, node_jobs as views

app_name = "serving-node-api"
urlpatterns = [
    path("heartbeat/", node_heartbeat.HeartbeatView.as_view(), name="heartbeat"),
    path("jobs/claim/", views.ClaimView.as_view(), name="job-claim"),
    path("jobs/<uuid:public_id>/lease/", views.LeaseView.as_view(), name="job-lease"),
    path("jobs/<uuid:public_id>/report/", views.ReportView.as_view(), name="job-report"),
    path("jobs/<uuid:public_id>/complete/", views.CompleteView.as_view(), name="job-complete"),
    path("jobs/<uuid:public_id>/fail/", views.FailView.as_view(), name="job-fail"),
]
