from django.urls import path

from gateway import views

app_name = "gateway"
urlpatterns = [
    path("", views.IndexView.as_view(), name="index"),
]
