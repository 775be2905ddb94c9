from django.urls import path

from scheduler import views

app_name = "scheduler"
urlpatterns = [
    path("", views.FleetView.as_view(), name="index"),
]
