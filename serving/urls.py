from django.urls import path

from serving import views

app_name = "serving"
urlpatterns = [
    path("", views.IndexView.as_view(), name="index"),
]
