"""The node API (``/api/node/``): what agents call with their own credential. Enrolment is here; the
leased jobs and reports are Serving's (``serving.api.node_urls``), under the same prefix."""

from django.urls import path

from scheduler.api import views

app_name = "node-api"
urlpatterns = [
    path("enrol/", views.EnrolView.as_view(), name="enrol"),
    path("self/", views.NodeSelfView.as_view(), name="self"),
]
